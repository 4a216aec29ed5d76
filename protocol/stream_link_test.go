package protocol_test

import (
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/research"
)

// Rule 25 over the network, with write-uncomputed switched on and off: a
// prefill computes its first page, gets the Grant, and every WRITE the
// sender posts is placed before the other three pages are computed. The
// correct sender has posted one; under the switch it posted all four, whose
// pages held nothing of the request yet, so decode reads KV that is not the
// prompt's (the network's read check names it).
func TestWriteUncomputedShipsPagesNotComputedYet(t *testing.T) {
	for _, bug := range []bool{false, true} {
		name := "defended"
		var bugs []research.Switch
		if bug {
			name, bugs = "write-uncomputed", []research.Switch{research.WriteUncomputed}
		}
		t.Run(name, func(t *testing.T) {
			l := newLink(t, 8, bugs...)
			l.n.ComputePagesAtIntake = 1
			l.submit(1, 16) // 4 pages, the first computed
			l.n.ComputePagesAtIntake = 0
			l.deliverOne() // Bootstrap
			l.backOne()    // Grant
			writes := 0
			for len(l.qp.Fwd) > 0 {
				if op := l.deliverOne(); op.Write != nil {
					writes++
				}
			}
			if want := map[bool]int{false: 1, true: 4}[bug]; writes != want {
				t.Fatalf("%d WRITEs placed with one page of 4 computed, want %d", writes, want)
			}
			l.n.Compute(1) // the rest of the prompt
			l.run()
			v := strings.Join(l.violations(), "\n")
			switch {
			case !bug && v != "":
				t.Fatalf("violations: %s", v)
			case !bug && l.rOut[1] != nil:
				t.Fatalf("decode: %v", l.rOut[1])
			case bug && v == "":
				t.Fatalf("under write-uncomputed no property broke; decode's outcome %v", l.rOut[1])
			}
			t.Logf("%s", v)
		})
	}
}

package transfer

import (
	"context"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/admission/admissiontest"
)

// A stranger without a certificate that keeps dialling the setup port from
// one address (127.0.0.2), never handshaking, evicts only its own
// connections: a real prefill node on 127.0.0.1 sets up its queue pair every
// time. (With the oldest evicted whatever its source, 10 of 10 Dials failed.)
func TestSetupFloodFromOneAddressDoesNotEvictAnotherAddressesHandshake(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ca := newTestCA(t)
	devs := devices(t, "inproc", "prefill-1", "decode-1") // one fabric
	d := newDecode(t, devs[1])
	ln := listen(t)
	go d.Serve(ctx, ln, SetupConfig{Name: "decode-1", TLS: ca.config(t, "decode-1"), Log: quiet}) // the default MaxHandshakes
	stop := admissiontest.Flood(t, ln.Addr().String(), "127.0.0.2", 2)
	const tries = 10
	fails := 0
	for i := range tries {
		p := newPrefill(t, devs[0])
		dctx, dcancel := context.WithTimeout(ctx, 10*time.Second)
		err := p.Dial(dctx, "decode-1", ln.Addr().String(), SetupConfig{Name: "prefill-1", TLS: ca.config(t, "prefill-1"), Log: quiet})
		dcancel()
		if err != nil {
			fails++
			t.Logf("try %d: %v", i, err)
		}
		p.Close()
	}
	dials := stop()
	t.Logf("%d flood connections; %d of %d real Dials failed", dials, fails, tries)
	if fails > 0 {
		t.Fatalf("a one-address flood denied the real prefill node %d of %d times", fails, tries)
	}
	if dials < 64 {
		t.Fatalf("the flood made only %d connections, too few to fill the 64 places", dials)
	}
}

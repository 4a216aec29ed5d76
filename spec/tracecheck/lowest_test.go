package tracecheck

import (
	"testing"

	"github.com/kvhandoff/kvhandoff/spec"
)

// The replay's spec takes decode's lowest free pages (spec.Config.LowestPages)
// where the spec explores every ordered tuple: sound for one request on an
// untouched pool, whose every choice is the same state up to the pages'
// names. Checked: the one choice is among the spec's own, and every choice
// of the spec has the same fingerprint.
func TestLowestPagesIsEveryChoiceUpToNames(t *testing.T) {
	for _, pages := range []int{1, 3, 5} {
		cfg := spec.Config{PageSize: specPageSize, Prompts: []int{pages * specPageSize}, ContextLimit: 127, PrefillPages: pages,
			DecodePages: pages, DecodeSlots: 1, MaxInFlight: pages}
		reserved := func(cfg spec.Config) map[string]int {
			m, err := spec.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			s := m.Initial()[0]
			out := map[string]int{}
			// Submit, the prefill's intake, then decode's receipt of the Bootstrap.
			for _, k := range []spec.ActionKind{spec.Submit, spec.PrefillRecv, spec.DecodeRecvQP} {
				var next *spec.State
				m.Successors(&s, func(a spec.Action, nx *spec.State) {
					if a.Kind == k {
						if k == spec.DecodeRecvQP {
							out[string(m.AppendFingerprint(nil, nx))]++
						}
						if next == nil {
							c := *nx
							next = &c
						}
					}
				})
				if next == nil {
					t.Fatalf("%d pages: no %v", pages, k)
				}
				s = *next
			}
			return out
		}
		all := reserved(cfg)
		cfg.LowestPages = true
		lowest := reserved(cfg)
		choices := 0
		for _, n := range all {
			choices += n
		}
		if len(all) != 1 || len(lowest) != 1 {
			t.Fatalf("%d pages: %d distinct states over the spec's %d choices, %d with LowestPages; want 1 and 1", pages, len(all), choices, len(lowest))
		}
		for k := range lowest {
			if all[k] == 0 {
				t.Fatalf("%d pages: LowestPages's reservation is none of the spec's", pages)
			}
		}
		t.Logf("%d pages: the spec's %d choices, one state", pages, choices)
	}
}

package model

import (
	"errors"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/spec"
)

// Every switch of the spec has an implementation counterpart, except
// done-unmatched (the wire carries no slot). The refinement tests walk each
// counterpart on both sides, except those whose defense lives outside the
// state machines the refinement runs (notInTheModel), which are caught by
// tests of their own.
func TestEverySpecSwitchHasAnImplementationCounterpart(t *testing.T) {
	for _, sw := range spec.AllSwitches() {
		_, err := research.Parse(sw.String())
		switch {
		case sw == spec.DoneUnmatched:
			if err == nil {
				t.Errorf("done-unmatched has an implementation counterpart now: walk it in the refinement tests")
			}
		case awaitingTheImplementation[sw]:
			if err == nil {
				t.Errorf("%v has an implementation counterpart now: drop it from awaitingTheImplementation and walk it", sw)
			}
		case err != nil:
			t.Errorf("%v: no implementation counterpart: %v", sw, err)
		}
	}
	for tsw := range notInTheModel {
		_, err := spec.ParseSwitches(tsw.String())
		switch {
		case err != nil:
			t.Errorf("the switch %v has no spec counterpart: %v", tsw, err)
		}
	}
}

// awaitingTheImplementation are the spec's switches that research has no
// counterpart of yet. free-computing (an ended leg's computation going on
// into the source pages it gave back) would be the prefill driver's, in
// transfer, whose chunk loop asks after every chunk whether the request is
// still live (transfer.TestAnEndMidStreamStopsTheComputationWithinAChunk):
// no switch turns that question off yet.
var awaitingTheImplementation = map[spec.Switch]bool{spec.FreeComputing: true}

// The harness's rogue WRITE follows the remote key of the grant: with a
// harness whose rogue WRITEs land whatever the key, the mapping parts ways
// with the spec (whose correct protocol refuses every one it explores).
func TestRefinementCatchesARogueWriteThatIgnoresItsKey(t *testing.T) {
	ignore := func(h *Refinement) { h.rogueIgnoresKeys = true }
	for seed := uint64(0); seed < 400; seed++ {
		err := walkMutated(spec.DefaultConfig(), research.Switches{}, seed, spec.Late|spec.Corrupt, ignore)
		if errors.Is(err, ErrRefinement) {
			t.Logf("seed %d: %.200s", seed, err)
			return
		}
		if err != nil {
			t.Fatalf("seed %d: the walk failed otherwise: %v", seed, err)
		}
		if err := walk(spec.DefaultConfig(), research.Switches{}, seed); err != nil {
			t.Fatalf("seed %d, unmutated: %v", seed, err)
		}
	}
	t.Fatal("in 400 walks no rogue WRITE that ignores its key parted ways with the spec")
}

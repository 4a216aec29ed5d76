package model

import (
	"fmt"
	"slices"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/research"
)

// seeds scales a run down under -short (CI's -race pass).
func seeds(n int) int {
	if testing.Short() {
		return n / 5
	}
	return n
}

func TestCorrectImplementationKeepsEveryPropertyOverManySeeds(t *testing.T) {
	s := RunSeeds(SimConfig{}, 1, seeds(500), nil)
	if s.Violations != 0 {
		v := s.FirstViolation
		t.Fatalf("seed %d: %s: %s\n%v", v.Seed, v.Violation.Property, v.Violation.Detail, v.Trace)
	}
	if s.PagesLeaked != 0 {
		t.Fatalf("%d pages leaked", s.PagesLeaked)
	}
	// The workload exercises every kind of outcome, or it proves little.
	for _, o := range []string{OutcomeOK, OutcomeRejected, OutcomeCancelled, OutcomeFailed} {
		if s.Outcomes[o] == 0 {
			t.Fatalf("no %s outcome in %d seeds: %v", o, seeds(500), s.Outcomes)
		}
	}
}

// Every implementation switch, alone or with the partners the spec's defense
// matrix gives, is found by the simulation, as a violation of the property the
// catalogue predicts.
func TestSimulationFindsEverySwitch(t *testing.T) {
	covered := map[research.Switch]bool{}
	for _, c := range matrixCombinations {
		sw := research.On(c.bugs...)
		for _, b := range c.bugs {
			covered[b] = true
		}
		t.Run(sw.String(), func(t *testing.T) {
			// Seeds in chunks until one fails with the combination and
			// passes with any one of its switches off: a failure that one
			// partner causes alone (no-checksum and a corrupted WRITE) would
			// not show the other switch caught. The rarest combination
			// (abort-still-sends, no-tag-check) fails about one seed in 300.
			var found *Failure
			const chunk, most = 200, 3000
			for first := uint64(1); first < most && found == nil; first += chunk {
				s := RunSeeds(SimConfig{Bugs: sw}, first, chunk, nil)
				for _, f := range s.Failures {
					if needsEvery(sw, c.bugs, f.Seed) {
						found = &f
						break
					}
				}
			}
			if found == nil {
				t.Fatalf("%d seeds found no failure that needs every switch of %v", most, sw)
			}
			if p := found.Violation.Property; !slices.Contains(c.want, p) {
				t.Fatalf("seed %d: the violation is %s (%s), want one of %v", found.Seed, p, found.Violation.Detail, c.want)
			}
			// The failing seed replays exactly.
			one, again := Simulate(SimConfig{Seed: found.Seed, Bugs: sw}), Simulate(SimConfig{Seed: found.Seed, Bugs: sw})
			if one.Violation == nil || *one.Violation != found.Violation || *again.Violation != found.Violation || !slices.Equal(again.Trace, one.Trace) {
				t.Fatalf("seed %d did not replay", found.Seed)
			}
			t.Logf("seed %d: %s: %s", found.Seed, found.Violation.Property, found.Violation.Detail)
		})
	}
	for _, c := range simPrefixCombinations { // TestSimulationFindsEveryPrefixSwitch, with the cache on
		covered[c.bugs[0]] = true
	}
	for _, sw := range research.All() {
		if !covered[sw] && !notInTheModel[sw] { // see notInTheModel
			t.Errorf("no case for %v", sw)
		}
	}
}

// Many nodes: 4 prefill and 3 decode nodes, the router choosing among them,
// keep every property; every node of each role takes requests.
func TestSimulationOverManyNodesKeepsEveryProperty(t *testing.T) {
	cfg := SimConfig{Senders: 4, Decoders: 3, Requests: 60}
	s := RunSeeds(cfg, 1, seeds(300), nil)
	if s.Violations != 0 {
		v := s.FirstViolation
		t.Fatalf("seed %d: %s: %s\n%v", v.Seed, v.Violation.Property, v.Violation.Detail, v.Trace)
	}
	c := cfg
	used := map[string]bool{}
	for seed := uint64(1); seed <= 20; seed++ {
		c.Seed = seed
		w := simulateWorld(c)
		for _, q := range w.n.Requests() {
			if q.Decode != 0 {
				used[fmt.Sprint("decode ", q.Decode)] = true
			}
			if q.Prefill != 0 {
				used[fmt.Sprint("prefill ", q.Prefill)] = true
			}
		}
	}
	if len(used) != 7 {
		t.Fatalf("nodes that took requests: %v, want all 7", used)
	}
}

// needsEvery reports whether seed, which fails with sw on, passes with any
// one of bugs (the switches of sw) off.
func needsEvery(sw research.Switches, bugs []research.Switch, seed uint64) bool {
	if len(bugs) < 2 {
		return true
	}
	for _, b := range bugs {
		if Simulate(SimConfig{Seed: seed, Bugs: sw.Without(b)}).Violation != nil {
			return false
		}
	}
	return true
}

// With decode restarts (a decode node crashing and coming back at once under
// a new incarnation) every property still holds, on one decode node and on
// three, and the seeds really restart decode nodes, and the new
// incarnations serve requests: a run where no restart happened, or where
// every request after one failed, would pass vacuously.
func TestSimulationWithDecodeRestartsKeepsEveryProperty(t *testing.T) {
	for _, cfg := range []SimConfig{{DecodeRestarts: true}, {Senders: 4, Decoders: 3, Requests: 60, DecodeRestarts: true}} {
		n := seeds(300)
		if cfg.Decoders > 1 {
			n = seeds(100)
		}
		s := RunSeeds(cfg, 1, n, nil)
		if s.Violations != 0 {
			v := s.FirstViolation
			t.Fatalf("%+v, seed %d: %s: %s\n%v", cfg, v.Seed, v.Violation.Property, v.Violation.Detail, v.Trace)
		}
		if s.PagesLeaked != 0 {
			t.Fatalf("%+v: %d pages leaked", cfg, s.PagesLeaked)
		}
		if s.DecodeRestarts < n/2 || s.ServedByRestartedDecode == 0 || s.FailedBy["decode node lost"] == 0 {
			t.Fatalf("%+v: %d decode restarts in %d seeds, %d requests served by a restarted decode node, %d failed by its loss: the fault barely ran",
				cfg, s.DecodeRestarts, n, s.ServedByRestartedDecode, s.FailedBy["decode node lost"])
		}
		t.Logf("%+v: %d seeds, %d decode restarts, %d requests served by a restarted decode node, outcomes %v, failed by %v",
			cfg, n, s.DecodeRestarts, s.ServedByRestartedDecode, s.Outcomes, s.FailedBy)
	}
}

// With the prefix cache on, the simulation keeps every property (among
// them NoCrossScopeRead, PinnedNeverReallocated and PrefixExact) over many
// seeds with faults, and the cache is used: requests hit, pages are evicted.
func TestSimulationWithPrefixReuseKeepsEveryProperty(t *testing.T) {
	hits, evictions := uint64(0), uint64(0)
	for seed := uint64(1); seed <= uint64(seeds(300)); seed++ {
		w := simulateWorld(SimConfig{Seed: seed, PrefixCache: true})
		if v := w.res.Violation; v != nil {
			t.Fatalf("seed %d: %s: %s\n%v", seed, v.Property, v.Detail, w.res.Trace)
		}
		if w.res.PagesLeaked != 0 {
			t.Fatalf("seed %d: %d pages leaked", seed, w.res.PagesLeaked)
		}
		for _, d := range w.n.Decode {
			st := d.Receiver.Stats()
			hits, evictions = hits+st.PrefixHits, evictions+st.PrefixEvictions
		}
	}
	if hits == 0 || evictions == 0 {
		t.Fatalf("the cache was not exercised: %d hits, %d evictions", hits, evictions)
	}
	t.Logf("%d seeds: %d prefix hits, %d evictions", seeds(300), hits, evictions)
}

// simPrefixCombinations are the prefix switches the simulation finds, with
// the partners a property needs and the properties each breaks.
var simPrefixCombinations = []struct {
	bugs []research.Switch
	want []string
}{
	{[]research.Switch{research.ScopeDropped}, []string{"NoCrossScopeRead"}},
	{[]research.Switch{research.EvictPinned}, []string{"PinnedNeverReallocated", "Conservation"}},
	{[]research.Switch{research.WriteShared}, []string{"PinnedNeverReallocated"}},
	// A skip of the whole prompt sends a Done whose prefix is past its
	// tokens, which decode's decoder refuses as malformed before any check
	// of the switched-off defenses: NoProtocolError, the same bug found.
	{[]research.Switch{research.PrefixCountMismatch, research.NoTokenCheck, research.NoTagCheck, research.NoChecksum}, []string{"PrefixExact", "NoProtocolError"}},
}

// Each prefix switch (with the partners the property needs: the defenses
// that catch prefix-count-mismatch on their own) is found by the simulation
// with the prefix cache on, as a violation of the property it breaks, and
// the failing seed replays. client-scope is the router's, in package node.
func TestSimulationFindsEveryPrefixSwitch(t *testing.T) {
	for _, c := range simPrefixCombinations {
		sw := research.On(c.bugs...)
		t.Run(sw.String(), func(t *testing.T) {
			for seed := uint64(1); seed <= 2000; seed++ {
				w := simulateWorld(SimConfig{Seed: seed, PrefixCache: true, Bugs: sw})
				v := w.res.Violation
				if v == nil {
					continue
				}
				if !slices.Contains(c.want, v.Property) {
					t.Fatalf("seed %d: %s (%s), want one of %v", seed, v.Property, v.Detail, c.want)
				}
				again := Simulate(SimConfig{Seed: seed, PrefixCache: true, Bugs: sw})
				if again.Violation == nil || *again.Violation != *v {
					t.Fatalf("seed %d did not replay", seed)
				}
				t.Logf("seed %d: %s: %s", seed, v.Property, v.Detail)
				return
			}
			t.Fatalf("2000 seeds found no violation of %v", c.want)
		})
	}
}

package spec

import (
	"bytes"
	"fmt"
	"slices"
	"testing"
)

// permuteNodes is s with its nodes renamed by nr, written field by field
// from State's definition (not from the encoder, which it checks): every
// per-node array moves to the node's new name, and every field that names a
// node (a request's route, once it names one, a PeerFailed's or PeerRestarted's peer, a foreign
// write's and a pinned page's node) is renamed.
func permuteNodes(s *State, nr *nodeRenaming) State {
	t := *s
	pre, dec := &nr.pre, &nr.dec
	for p := range MaxPrefills {
		np := pre[p]
		t.Src[np], t.PrefillCrashed[np], t.CrashDetected[np], t.Inc[np] = s.Src[p], s.PrefillCrashed[p], s.CrashDetected[p], s.Inc[p]
		t.ToPrefill[np] = renamePeers(s.ToPrefill[p], dec[:])
		for d := range MaxDecodes {
			nd := dec[d]
			t.QP[np][nd], t.QPBack[np][nd] = s.QP[p][d], s.QPBack[p][d]
			t.Fenced[np][nd], t.Unacked[np][nd] = s.Fenced[p][d], s.Unacked[p][d]
			t.QPInc[np][nd], t.PQPInc[np][nd] = s.QPInc[p][d], s.PQPInc[p][d]
		}
	}
	for d := range MaxDecodes {
		nd := dec[d]
		t.Pages[nd], t.Slots[nd], t.DInc[nd] = s.Pages[d], s.Slots[d], s.DInc[d]
		t.DecodeLost[nd], t.Partitioned[nd], t.Severed[nd] = s.DecodeLost[d], s.Partitioned[d], s.Severed[d]
		t.ToDecode[nd] = renamePeers(s.ToDecode[d], pre[:])
	}
	for r := range t.Req {
		q := &t.Req[r]
		if q.Dispatched {
			q.P = pre[q.P]
		}
		if q.Dispatched || q.R.Phase != RNone {
			q.D = dec[q.D]
		}
	}
	if t.Foreign.Happened {
		t.Foreign.Node = dec[t.Foreign.Node]
	}
	if t.Ghost.Pinned {
		t.Ghost.PinnedNode = dec[t.Ghost.PinnedNode]
	}
	return t
}

// renamePeers is q with the node of each PeerFailed and PeerRestarted
// renamed by to.
func renamePeers(q Queue, to []int8) Queue {
	for i := range q.N {
		if m := &q.Buf[i]; m.Kind == MPeerFailed || m.Kind == MPeerRestarted {
			m.Peer = to[m.Peer]
		}
	}
	return q
}

// symmetricDeployments are two prefill and two decode nodes under each
// fault that names a node, the prefix cache (a pinned page's node) and the
// rogue (a foreign write's node).
func symmetricDeployments() map[string]Config {
	twoByTwo := func(requests int, faults ...Fault) Config {
		c := NewConfig(requests, 4, 2)
		c.Prefills, c.Decodes = 2, 2
		c.Faults = Budget{}
		for _, f := range faults {
			c.Faults[f] = 1
		}
		return c
	}
	restarts := twoByTwo(2, FaultCrash, FaultRestart, FaultCancel, FaultLate)
	restarts.DecodeRestarts = true
	static := twoByTwo(2, FaultPartition, FaultCancel)
	static.StaticPeers = true
	cache := twoByTwo(3, FaultCancel, FaultRogue)
	cache.PageSize, cache.DecodePages, cache.PrefillPages = 2, 3, 4
	cache.Prompts, cache.Scopes, cache.Contents, cache.PrefixCache = []int{4, 4, 4}, []int{1, 2, 1}, []string{"aa", "aa", "ab"}, 2
	return map[string]Config{
		"crash,lease,cut":       twoByTwo(2, FaultCrash, FaultLease, FaultCut),
		"timeout,corrupt":       twoByTwo(2, FaultTimeout, FaultCorrupt, FaultCancel),
		"restarts":              restarts,
		"partition":             twoByTwo(2, FaultPartition, FaultLease),
		"static peers":          static,
		"dataplane-cut":         twoByTwo(2, FaultDataplaneCut, FaultCrash),
		"prefix cache, rogue":   cache,
		"three requests, cuts":  twoByTwo(3, FaultCut, FaultCrash),
		"rogue, timeout, crash": twoByTwo(2, FaultRogue, FaultTimeout, FaultCrash),
	}
}

// The reduction by node symmetry is sound only if the spec is symmetric in
// its nodes: renaming the nodes of a state renames its successors, and
// changes no invariant, goal or end. This checks it state by state, on
// reachable states of two-by-two deployments, for the protocol and under
// every switch and mutation (each a change of the steps that could single a
// node out), comparing successors by their fingerprints without node
// symmetry. And every renaming of a state has its fingerprint.
func TestTheSpecIsSymmetricInItsNodes(t *testing.T) {
	limit, variantLimit := 2000, 200
	if testing.Short() {
		limit, variantLimit = 500, 40
	}
	for name, base := range symmetricDeployments() {
		for _, v := range everyStepVariant() {
			m, err := New(v.of(base))
			if err != nil {
				t.Fatal(err)
			}
			if len(m.nodes) != 4 {
				t.Fatalf("%s: %d node renamings, want 4", name, len(m.nodes))
			}
			n := variantLimit
			if v.name == "protocol" {
				n = limit
			}
			states := reachableBy(m, n, func(s *State) string { return string(m.appendCanonical(nil, s, m.nodes[:1])) })
			checked, err := nodeAsymmetry(m, states)
			if err != nil {
				t.Fatalf("%s under %s: %v", name, v.name, err)
			}
			if v.name == "protocol" {
				t.Logf("%s: %d states, %d renamed states checked", name, len(states), checked)
			}
		}
	}
}

// stepVariant is the protocol's steps (name "protocol") or those under one
// switch or one mutation.
type stepVariant struct {
	name string
	bugs Switches
	mu   Mutation
}

// everyStepVariant returns the protocol, then every switch, then every
// mutation.
func everyStepVariant() []stepVariant {
	variants := []stepVariant{{name: "protocol"}}
	for _, sw := range AllSwitches() {
		variants = append(variants, stepVariant{name: sw.String(), bugs: Switches(sw)})
	}
	for _, mu := range AllMutations() {
		variants = append(variants, stepVariant{name: mu.String(), mu: mu})
	}
	return variants
}

// of is cfg under v.
func (v stepVariant) of(cfg Config) Config {
	cfg.Bugs, cfg.Mutation = v.bugs, v.mu
	return cfg
}

// reachableBy returns the first limit states a breadth-first search from m's
// initial state reaches, identifying states by key.
func reachableBy(m *Model, limit int, key func(*State) string) []State {
	seen := map[string]bool{}
	queue := m.Initial()
	var out []State
	for len(queue) > 0 && len(out) < limit {
		s := queue[0]
		queue = queue[1:]
		if k := key(&s); !seen[k] {
			seen[k] = true
			out = append(out, s)
			m.Successors(&s, func(_ Action, n *State) { queue = append(queue, *n) })
		}
	}
	return out
}

// nodeAsymmetry checks each state against each of its node renamings: it
// returns how many renamed states it checked, and the first difference.
func nodeAsymmetry(m *Model, states []State) (int, error) {
	identity := m.nodes[:1]
	fp := func(s *State) string { return string(m.appendCanonical(nil, s, identity)) }
	succ := func(s *State, rename *nodeRenaming) []string {
		var out []string
		m.Successors(s, func(_ Action, n *State) {
			if rename != nil {
				r := permuteNodes(n, rename)
				n = &r
			}
			out = append(out, fp(n))
		})
		slices.Sort(out)
		return out
	}
	checked := 0
	for i := range states {
		s := &states[i]
		whole := m.AppendFingerprint(nil, s)
		for k := 1; k < len(m.nodes); k++ {
			nr := &m.nodes[k]
			r := permuteNodes(s, nr)
			checked++
			how := fmt.Sprintf("state %d renamed by %v/%v", i, nr.pre[:m.cfg.NumPrefills()], nr.dec[:m.cfg.NumDecodes()])
			if !bytes.Equal(m.AppendFingerprint(nil, &r), whole) {
				return checked, fmt.Errorf("%s: another fingerprint", how)
			}
			for _, inv := range Invariants {
				if inv.Holds(m, s) != inv.Holds(m, &r) {
					return checked, fmt.Errorf("%s: %s differs", how, inv.Name)
				}
			}
			for _, g := range Goals {
				if g.Reached(m, s) != g.Reached(m, &r) {
					return checked, fmt.Errorf("%s: goal %s differs", how, g.Name)
				}
			}
			if m.Finished(s) != m.Finished(&r) {
				return checked, fmt.Errorf("%s: its end differs", how)
			}
			if a, b := succ(s, nr), succ(&r, nil); !slices.Equal(a, b) {
				return checked, fmt.Errorf("%s: its %d successors are not the state's %d successors renamed", how, len(b), len(a))
			}
		}
	}
	return checked, nil
}

// The check above catches a spec that singles out a node: here prefill node
// 1 never crashes.
func TestNodeAsymmetryCatchesAStepThatSinglesOutANode(t *testing.T) {
	m, err := New(symmetricDeployments()["crash,lease,cut"])
	if err != nil {
		t.Fatal(err)
	}
	m.mutate = func(a Action, s *State, step func()) {
		if a.Kind != Crash || a.Arg != 1 {
			step()
		}
	}
	states := reachableBy(m, 200, func(s *State) string { return string(m.appendCanonical(nil, s, m.nodes[:1])) })
	if _, err := nodeAsymmetry(m, states); err == nil {
		t.Fatal("a spec where prefill node 1 never crashes passed as symmetric in its nodes")
	} else {
		t.Log(err)
	}
}

// Node symmetry merges the mirror images a two-by-two deployment reaches,
// and nothing in a one-pair deployment (one renaming: its state counts are
// those of before).
func TestNodeSymmetryMergesMirrorImages(t *testing.T) {
	cfg := symmetricDeployments()["partition"]
	cfg.Faults = Budget{}
	cfg.Faults[FaultPartition] = 1
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	with := reachableBy(m, 1<<20, func(s *State) string { return string(m.AppendFingerprint(nil, s)) })
	without := reachableBy(m, 1<<20, func(s *State) string { return string(m.appendCanonical(nil, s, m.nodes[:1])) })
	if len(with) >= len(without) || 2*len(with) > len(without)+len(without)/2 {
		t.Fatalf("%d states with node symmetry, %d without: want about half or less", len(with), len(without))
	}
	t.Logf("%d states with node symmetry, %d without", len(with), len(without))
	one, err := New(NewConfig(3, 4, 2))
	if err != nil {
		t.Fatal(err)
	}
	if len(one.nodes) != 1 {
		t.Fatalf("one pair: %d node renamings, want 1", len(one.nodes))
	}
}

// A step the spec hands back unchanged (Successors passes the state being
// expanded itself, and the checker takes it for the successor without a
// fingerprint) must change nothing: run for real, as with coverage on, every
// such step yields the state it was given, for the protocol and under every
// switch and mutation, in a one-pair and a two-by-two deployment with the
// rogue.
func TestUnchangedStepsChangeNothing(t *testing.T) {
	limit := 3000
	if testing.Short() {
		limit = 500
	}
	onePair := withEveryFault(NewConfig(3, 4, 2))
	deployments := map[string]Config{"one pair, every fault": onePair, "two by two, cache and rogue": symmetricDeployments()["prefix cache, rogue"]}
	for name, base := range deployments {
		handedBack := 0
		for _, v := range everyStepVariant() {
			fast, err := New(v.of(base))
			if err != nil {
				t.Fatal(err)
			}
			stepped := fast.WithCoverage(&Coverage{})
			n := limit
			if v.name != "protocol" {
				n = limit / 10
			}
			for _, s := range reachableBy(fast, n, func(s *State) string { return string(fast.AppendFingerprint(nil, s)) }) {
				type succ struct {
					a    Action
					next State
				}
				var got, want []succ
				fast.Successors(&s, func(a Action, next *State) {
					if next == &s {
						handedBack++
					}
					got = append(got, succ{a, *next})
				})
				stepped.Successors(&s, func(a Action, next *State) { want = append(want, succ{a, *next}) })
				if !slices.Equal(got, want) {
					t.Fatalf("%s, %v %v: the successors handed back unchanged differ from the steps run", name, v.bugs, v.mu)
				}
			}
		}
		if handedBack == 0 {
			t.Fatalf("%s: no step was handed back unchanged: the test shows nothing", name)
		}
		t.Logf("%s: %d steps handed back unchanged, each equal to its step run", name, handedBack)
	}
}

// TestRankPermIsTheOneRenamingThatSortsByKey: where no two requests of a
// class tie, rankPerm's renaming is the one of the symmetry group that lists
// each class in key order; where two tie, it declines (the fingerprint then
// tries every renaming that sorts by key).
func TestRankPermIsTheOneRenamingThatSortsByKey(t *testing.T) {
	for _, prompts := range [][]int{{2, 2, 5}, {2, 2, 2}, {2, 3, 2, 3}, {2, 2, 2, 2}, {1, 2, 3}} {
		cfg := NewConfig(len(prompts), 8, 2)
		cfg.Prompts = prompts
		m, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		var keys [MaxRequests]uint64
		var walk func(r int)
		tried := 0
		walk = func(r int) {
			if r < len(prompts) {
				for k := range uint64(3) { // every assignment of keys 0..2: ties and not
					keys[r] = k
					walk(r + 1)
				}
				return
			}
			tried++
			var sorting [][]int8
			for _, p := range m.perms {
				if m.sortsByKey(p, &keys) {
					sorting = append(sorting, p)
				}
			}
			i, ok := m.rankPerm(&keys)
			switch {
			case ok && (len(sorting) != 1 || !slices.Equal(sorting[0], m.perms[i])):
				t.Fatalf("prompts %v keys %v: rankPerm gives %v, the renamings that sort by key are %v", prompts, keys, m.perms[i], sorting)
			case !ok && len(sorting) < 2:
				t.Fatalf("prompts %v keys %v: rankPerm declines, but only %v sort by key", prompts, keys, sorting)
			}
		}
		walk(0)
		if tried == 0 {
			t.Fatal("no keys tried")
		}
	}
}

// TestFingerprintDoesNotAllocate: the checker fingerprints every transition,
// so AppendFingerprint must not allocate once dst has room (a renaming built
// on the stack that escaped once cost an allocation per fingerprint, 2% of
// the checker's CPU).
func TestFingerprintDoesNotAllocate(t *testing.T) {
	threeEqual := NewConfig(3, 4, 2)
	threeEqual.Prompts = []int{2, 2, 2}
	for name, cfg := range map[string]Config{
		"default":     NewConfig(3, 4, 2),
		"three equal": threeEqual,
		"2x2":         symmetricDeployments()["crash,lease,cut"],
	} {
		m, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		states := reachableBy(m, 2000, func(s *State) string { return string(m.AppendFingerprint(nil, s)) })
		buf := make([]byte, 0, 1<<16)
		if a := testing.AllocsPerRun(5, func() {
			for i := range states {
				buf = m.AppendFingerprint(buf[:0], &states[i])
			}
		}); a != 0 {
			t.Errorf("%s: %.0f allocations fingerprinting %d states", name, a, len(states))
		}
	}
}

// SuccessorsWhere emits exactly the successors keep takes, each as
// Successors does (the same action and next state, in the same order), and
// offers keep every successor with its index in that order until it wants
// no more: a rebuilt trace takes the successor its index names, and a
// replay the first its action does.
func TestSuccessorsWhereEmitsTheChosenAsSuccessorsDoes(t *testing.T) {
	limit := 2000
	if testing.Short() {
		limit = 300
	}
	deployments := map[string]Config{"one pair, every fault": withEveryFault(NewConfig(3, 4, 2)), "two by two, cache and rogue": symmetricDeployments()["prefix cache, rogue"]}
	type succ struct {
		a    Action
		next State
	}
	for name, cfg := range deployments {
		plain, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		// The tests' hook runs every step: the path with coverage on.
		for _, m := range []*Model{plain, plain.WithCoverage(&Coverage{})} {
			checked := 0
			for _, s := range reachableBy(plain, limit, func(s *State) string { return string(plain.AppendFingerprint(nil, s)) }) {
				var all []succ
				m.Successors(&s, func(a Action, next *State) { all = append(all, succ{a, *next}) })
				for i := range all {
					// Taking the i-th, then wanting no more (a rebuild), or
					// going on to the end.
					for _, stop := range []bool{true, false} {
						var got []succ
						offered := 0
						m.SuccessorsWhere(&s, func(n int, a Action) (bool, bool) {
							if n != offered || a != all[n].a {
								t.Fatalf("%s: keep offered successor %d (%v), want %d (%v)", name, n, a, offered, all[offered].a)
							}
							offered++
							return n == i, !stop || n < i
						}, func(a Action, next *State) { got = append(got, succ{a, *next}) })
						wantOffered := len(all)
						if stop {
							wantOffered = i + 1
						}
						if offered != wantOffered || len(got) != 1 || got[0] != all[i] {
							t.Fatalf("%s: keeping successor %d of %d (%v), stop %v: offered %d, emitted %d, equal %v", name, i, len(all), all[i].a, stop, offered, len(got), len(got) == 1 && got[0] == all[i])
						}
					}
					checked++
				}
				// By action, as a replay picks: every successor of a kind.
				for _, kind := range []ActionKind{PostWrite, DecodeRecvQP, Cancel} {
					var got, want []succ
					for _, x := range all {
						if x.a.Kind == kind {
							want = append(want, x)
						}
					}
					m.SuccessorsWhere(&s, func(_ int, a Action) (bool, bool) { return a.Kind == kind, true }, func(a Action, next *State) { got = append(got, succ{a, *next}) })
					if !slices.Equal(got, want) {
						t.Fatalf("%s: the %v successors differ from Successors'", name, kind)
					}
				}
			}
			if checked < limit {
				t.Fatalf("%s: %d successors checked over %d states: the test shows little", name, checked, limit)
			}
		}
	}
}

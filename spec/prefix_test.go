package spec

import (
	"slices"
	"testing"
)

func prefixProperty(name string) bool {
	return name == NoCrossScopeRead || name == PinnedNeverReallocated || name == PrefixExact
}

// prefixConfig is PrefixBounds without faults: three two-page requests,
// r0 and r2 of tenant 1 sharing their first page, r1 of tenant 2 with r0's
// tokens, a three-page pool and a two-page cache.
func prefixConfig() Config {
	c := PrefixBounds(DefaultConfig())
	c.Faults = Budget{}
	return c
}

// checkCoverage explores cfg with coverage and returns the first property
// violated (or "") and the coverage.
func checkCoverage(t *testing.T, cfg Config) ([]string, *Coverage) {
	t.Helper()
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cov := new(Coverage)
	return explore(t, m.WithCoverage(cov)), cov
}

// The switch's counterexample violates want, and without it the same bounds
// hold with the defense firing.
func wantCaughtAndDefended(t *testing.T, cfg Config, sw Switch, want string, defense Branch) {
	t.Helper()
	if got, cov := checkCoverage(t, cfg); len(got) > 0 || defense != NumBranches && cov.Branch(defense) == 0 {
		t.Fatalf("correct protocol: violated %v, %v fired %d times; want nothing violated and the defense firing", got, defense, cov.Branch(defense))
	}
	cfg.Bugs = Switches(sw)
	if got, _ := checkCoverage(t, cfg); !slices.Contains(got, want) {
		t.Fatalf("%v: violated %v, want %s", sw, got, want)
	}
}

// A request reuses a cached prefix only within its own scope: a chain
// cached under tenant 1 is no hit for tenant 2 (prefix-scope-miss), and with
// the scope left out of the key (scope-dropped) tenant 2 reads tenant 1's KV.
func TestNoCrossScopeReadCatchesScopeDropped(t *testing.T) {
	wantCaughtAndDefended(t, prefixConfig(), ScopeDropped, NoCrossScopeRead, PrefixScopeMiss)
}

// The router sets the scope from the tenant and refuses a body that names
// one; with client-scope, tenant 2 names tenant 1's scope and reads its KV.
func TestNoCrossScopeReadCatchesClientScope(t *testing.T) {
	cfg := prefixConfig()
	cfg.Faults[FaultRogue] = 1
	wantCaughtAndDefended(t, cfg, ClientScope, NoCrossScopeRead, RouterScopeInBody)
}

// Eviction takes only unpinned cached pages: when the pool is short and
// the only other cached page is pinned, the intake fails for capacity;
// with evict-pinned the pinned page is reallocated under its reader.
func TestPinnedNeverReallocatedCatchesEvictPinned(t *testing.T) {
	wantCaughtAndDefended(t, prefixConfig(), EvictPinned, PinnedNeverReallocated, EvictSkipsPinned)
}

// A shared page is in no Grant; with write-shared the pinned pages are
// granted too and prefill WRITEs one.
func TestPinnedNeverReallocatedCatchesWriteShared(t *testing.T) {
	wantCaughtAndDefended(t, prefixConfig(), WriteShared, PinnedNeverReallocated, PrefixHit)
}

// Prefill skips exactly the grant's prefix; with prefix-count-mismatch it
// skips a page more and leaves a hole.
func TestPrefixExactCatchesPrefixCountMismatch(t *testing.T) {
	wantCaughtAndDefended(t, prefixConfig(), PrefixCountMismatch, PrefixExact, PrefixHit)
}

// The cache works at all: hits, insertions and evictions happen, and every
// property holds.
func TestPrefixCacheHitsInsertsAndEvicts(t *testing.T) {
	got, cov := checkCoverage(t, prefixConfig())
	if len(got) > 0 {
		t.Fatalf("violated %v", got)
	}
	for _, b := range []Branch{PrefixHit, PrefixInsert, PrefixEvict, EvictSkipsPinned, PrefixScopeMiss} {
		if cov.Branch(b) == 0 {
			t.Errorf("%v never fired", b)
		}
	}
}

// Pages enter the cache only after a verified read: with them inserted at
// every end, a cancelled request's unwritten page is cached and a later
// hit reads an earlier tenant's KV.
func TestIsolationCatchesInsertUnverified(t *testing.T) {
	cfg := prefixConfig()
	cfg.Faults[FaultCancel] = 1
	if got := explore(t, mustNew(t, cfg)); len(got) > 0 {
		t.Fatalf("correct protocol: violated %v", got)
	}
	cfg.Mutation = InsertUnverified
	if got := explore(t, mustNew(t, cfg)); !slices.Contains(got, Isolation) && !slices.Contains(got, HonestOutcome) {
		t.Fatalf("violated %v, want Isolation or HonestOutcome", got)
	}
}

// Every end unpins: without it a pinned page outlives its request.
func TestNoLeakCatchesAPinNeverReleased(t *testing.T) {
	cfg := prefixConfig()
	cfg.Mutation = NoUnpin
	if got := explore(t, mustNew(t, cfg)); !slices.Contains(got, NoLeak) {
		t.Fatalf("violated %v, want NoLeak", got)
	}
}

func mustNew(t *testing.T, cfg Config) *Model {
	t.Helper()
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// Each prefix property can fail, alone, on a state of the cache.
func TestEveryPrefixInvariantCanFail(t *testing.T) {
	m := mustNew(t, prefixConfig())
	// Run r0 to the end (its pages cached), then r2 to its grant (a hit).
	s := m.Initial()[0]
	step := func(k ActionKind, r int) {
		t.Helper()
		found := false
		cur := s
		m.Successors(&cur, func(a Action, n *State) {
			if !found && a.Kind == k && int(a.Req) == r {
				s, found = *n, true
			}
		})
		if !found {
			t.Fatalf("%v(r%d) is not enabled", k, r)
		}
	}
	for _, k := range []ActionKind{Submit, PrefillRecv, Compute, Compute, DecodeRecvQP, PrefillRecvQP, PostWrite, PostWrite, DecodeRecvQP, DecodeRead} {
		step(k, 0)
	}
	for _, k := range []ActionKind{Submit, PrefillRecv, Compute, Compute, DecodeRecvQP, PrefillRecvQP} {
		step(k, 2)
	}
	if s.Req[2].R.Prefix != 1 || s.Req[2].S.Skip != 1 {
		t.Fatalf("r2: prefix %d, skip %d; want a one-page hit", s.Req[2].R.Prefix, s.Req[2].S.Skip)
	}
	shared := s.Req[2].R.Pages[0].Page
	cases := map[string]func(s *State){
		NoCrossScopeRead:       func(s *State) { s.Req[1].Read, s.Req[1].ReadN, s.Req[1].ReadData[0] = true, 1, Label{Req: 0} },
		PinnedNeverReallocated: func(s *State) { s.Ghost.Pinned, s.Ghost.PinnedPage = true, shared },
		PrefixExact:            func(s *State) { s.Req[2].S.Skip = 2 },
	}
	for _, inv := range Invariants {
		if !inv.Holds(m, &s) {
			t.Fatalf("%s fails on a correct state", inv.Name)
		}
		breakIt, ok := cases[inv.Name]
		if !ok {
			continue
		}
		b := s
		breakIt(&b)
		for _, other := range Invariants {
			if got := other.Holds(m, &b); got == (other.Name == inv.Name) {
				t.Errorf("breaking %s: %s holds=%v", inv.Name, other.Name, got)
			}
		}
	}
}

// Requests are interchangeable only with the same prompt, scope and
// contents: swapping two of tenant 1 with equal pages keeps the
// fingerprint, swapping tenants does not.
func TestFingerprintWithTheCacheIsCanonical(t *testing.T) {
	fingerprints := func(scopes []int) (a, b []byte) {
		cfg := prefixConfig()
		cfg.Prompts, cfg.Contents, cfg.Scopes = []int{4, 4}, []string{"aa", "aa"}, scopes
		m := mustNew(t, cfg)
		for r, out := range []*[]byte{&a, &b} {
			s := m.Initial()[0]
			cur := s
			m.Successors(&cur, func(act Action, n *State) {
				if act.Kind == Submit && int(act.Req) == r && act.Arg == 0 {
					s = *n
				}
			})
			*out = m.AppendFingerprint(nil, &s)
		}
		return a, b
	}
	if a, b := fingerprints([]int{1, 1}); string(a) != string(b) {
		t.Fatal("two requests of one tenant with equal pages must be interchangeable")
	}
	if a, b := fingerprints([]int{1, 2}); string(a) == string(b) {
		t.Fatal("requests of different tenants must stay distinct")
	}
}

// publicConfig is two three-page prompts of tenants 1 and 2, both starting
// with the declared public prefix "a" and alike past it, one page a token.
func publicConfig() Config {
	c := DefaultConfig()
	c.PageSize, c.DecodePages, c.PrefillPages, c.ContextLimit = 1, 3, 3, 3
	c.Prompts, c.DecodeSlots = []int{3, 3}, 1
	c.PrefixCache, c.Scopes, c.Contents, c.PublicPrefix = 3, []int{1, 2}, []string{"aab", "aab"}, "a"
	c.Faults = Budget{}
	return c
}

// A declared public prefix is shared across tenants, and only it: tenant 2
// hits tenant 1's public page (the only hits these bounds have are across
// tenants), and NoCrossScopeRead holds. With the chain past the public
// pages left unsalted (the unsalted-public-chain mutation), tenant 2 hits
// tenant 1's private page too and reads it.
func TestNoCrossScopeReadCatchesAnUnsaltedPublicChain(t *testing.T) {
	cfg := publicConfig()
	got, cov := checkCoverage(t, cfg)
	if len(got) > 0 || cov.Branch(PrefixHit) == 0 {
		t.Fatalf("with the public prefix: violated %v, %d hits; want none violated and a hit", got, cov.Branch(PrefixHit))
	}
	cfg.Mutation = UnsaltedPublicChain
	if got := explore(t, mustNew(t, cfg)); !slices.Contains(got, NoCrossScopeRead) {
		t.Fatalf("unsalted: violated %v, want %s", got, NoCrossScopeRead)
	}
	// Without the public prefix the two tenants share nothing.
	cfg = publicConfig()
	cfg.PublicPrefix = ""
	if got, cov := checkCoverage(t, cfg); len(got) > 0 || cov.Branch(PrefixHit) != 0 {
		t.Fatalf("without the public prefix: violated %v, %d hits; want neither", got, cov.Branch(PrefixHit))
	}
}

// The public scope is the router's, for a request of a tenant that starts
// with the public prefix; a request of scope 0 or another start keeps its own.
func TestThePublicScopeIsForRequestsThatStartWithThePublicPrefix(t *testing.T) {
	c := publicConfig()
	c.Prompts, c.Scopes, c.Contents = []int{3, 3, 3}, []int{1, 0, 2}, []string{"aab", "aab", "bab"}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	for r, want := range []uint8{PublicScope, 0, 2} {
		if got := c.routerScope(r); got != want {
			t.Errorf("r%d: scope %d, want %d", r, got, want)
		}
	}
	if c.PublicPages(0) != 1 || c.PublicPages(1) != 0 || c.PublicPages(2) != 0 {
		t.Errorf("public pages %d %d %d, want 1 0 0", c.PublicPages(0), c.PublicPages(1), c.PublicPages(2))
	}
}

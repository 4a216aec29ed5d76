package spec

import (
	"fmt"
	"slices"
	"strings"
)

// Prefix reuse (docs/spec.md#prefix-reuse; docs/protocol.md, prefix reuse).
// With Config.PrefixCache a decode node keeps verified full prompt pages
// after their request has finished, keyed by (scope, chain): the scope is
// the request's tenant's, set by the router, and the chain names the
// prompt's pages up to and including the page (Model.chain: two requests'
// chains agree at page i when their Contents agree up to i). At intake
// decode looks up the longest run of the request's chain cached under its
// scope, capped so that the last page is always written, pins those pages,
// and grants fresh pages for the rest, evicting least recently used
// unpinned cached pages when the free pages are too few (all or nothing).
// The Grant and Done carry the prefix length; prefill WRITEs only the pages
// past it; Done verifies the written pages and that the pinned ones are
// still cached at the epoch, scope and key they were pinned at; the read
// checks the same of each pinned page. At the read's end the request's
// written full pages enter the cache (up to its capacity), and every end
// unpins. A decode restart empties the cache with the pool.
//
// KV stays a Label: a page written for request q's page i holds q[i], which
// is request r's KV for page i too when their chains agree there
// (Model.ownKV). A declared public prefix (Config.PublicPrefix) gives the
// requests that start with it the public scope, their chains salted with
// their tenant past the public pages: every tenant shares the public pages,
// only its own the rest. The properties: NoCrossScopeRead (a request reads
// another request's KV only if both are of the same tenant scope, or the
// page is a public page both start with),
// PinnedNeverReallocated (a ghost: a pinned page is never reallocated or
// written, a cached one never written) and PrefixExact (prefill's skipped
// length is decode's hit length, short of the last page).

// Property names of the prefix cache (docs/spec.md#properties).
const (
	// NoCrossScopeRead: no request reads a page whose KV was written for
	// another tenant's scope, but for the pages of a declared public prefix
	// both requests start with.
	NoCrossScopeRead = "NoCrossScopeRead"
	// PinnedNeverReallocated: a pinned page is never reallocated or
	// written while pinned, and a cached page never written.
	PinnedNeverReallocated = "PinnedNeverReallocated"
	// PrefixExact: the prefix hit and the written pages make exactly the
	// request's prompt: prefill skips exactly decode's hit, which leaves
	// the last page to be written.
	PrefixExact = "PrefixExact"
)

// prefixSwitches are the switches that act only on the prefix cache.
const prefixSwitches = Switches(ScopeDropped | ClientScope | EvictPinned | PrefixCountMismatch | WriteShared)

// PrefixBounds is the configuration under which each prefix switch is
// exposed alone (the defense matrix's, and check's when a prefix switch is
// named without a cache): three two-page prompts in a three-page pool with
// a two-page cache, two of tenant 1 (one sharing only the first page) and
// one of tenant 2 with the same tokens as the first; the rogue fault only.
func PrefixBounds(c Config) Config {
	c.PageSize, c.DecodePages, c.PrefillPages = 2, 3, 4
	c.Prompts = []int{4, 4, 4}
	c.ContextLimit, c.DecodeSlots = 8, 2
	c.PrefixCache = 2
	c.Scopes = []int{1, 2, 1}
	c.Contents = []string{"aa", "aa", "ab"}
	// The rogue fault alone (a client naming a scope: client-scope's): the
	// switches need no other, and with three two-page requests each fault
	// multiplies the states (cancel alone: 66,688 instead of 2,016).
	c.Faults = Budget{FaultRogue: 1}
	return c
}

// Bounds is c widened by what the switches need to act at all: their
// faults (Faults), for a prefix switch in a configuration without the
// cache, PrefixBounds, and for write-uncomputed, StreamBounds.
func (s Switches) Bounds(c Config) Config {
	c.Faults = s.Faults(c.Faults)
	if s&prefixSwitches != 0 && c.PrefixCache == 0 {
		c = PrefixBounds(c)
	}
	if s.Has(WriteUncomputed) {
		c = StreamBounds(c)
	}
	return c
}

// Prefix reports whether the set has a switch that acts only on the prefix cache.
func (s Switches) Prefix() bool { return s&prefixSwitches != 0 }

// cacheOn reports whether the configuration has a prefix cache.
func (m *Model) cacheOn() bool { return m.cfg.PrefixCache > 0 }

// scopeOf is request r's tenant scope (0: no reuse).
func (c *Config) scopeOf(r int) uint8 {
	if len(c.Scopes) == 0 {
		return 0
	}
	return uint8(c.Scopes[r])
}

// PublicScope is the scope of the declared public prefix (Config.PublicPrefix):
// one past the tenant scopes.
const PublicScope = MaxScopes + 1

// PublicPages is how many of request r's first pages are the declared public
// prefix's: its length if r is of a tenant scope and its contents start
// with it, else 0 (r is then no public request).
func (c *Config) PublicPages(r int) int {
	p := c.PublicPrefix
	if p == "" || c.scopeOf(r) == 0 || !strings.HasPrefix(c.contentsOf(r), p) {
		return 0
	}
	return len(p)
}

// routerScope is the scope the router gives request r: the public scope
// for a request that starts with the public prefix (its chain past the
// public pages salted with its tenant: chains), else its tenant's.
func (c *Config) routerScope(r int) uint8 {
	if c.PublicPages(r) > 0 {
		return PublicScope
	}
	return c.scopeOf(r)
}

// contentsOf is request r's full pages, one letter each.
func (c *Config) contentsOf(r int) string {
	if len(c.Contents) == 0 {
		n := c.Prompts[r] / c.PageSize
		b := make([]byte, n)
		for i := range b {
			b[i] = 'a'
		}
		return string(b)
	}
	return c.Contents[r]
}

// chains numbers the distinct prompt prefixes of cfg: chain[r][i] (1 and
// up) names request r's pages 0..i, for each full page i; two requests'
// ids are equal exactly when their contents agree up to page i. Past the
// public pages of a public request the chain is salted with its tenant
// (unless the unsalted-public-chain mutation drops the salt), so two
// tenants' requests share only the public pages. The ids depend on
// contents and scopes only, so they are the same under any renaming of
// interchangeable requests.
func chains(cfg *Config) (out [MaxRequests][MaxDecodePages]uint8) {
	key := func(r, i int) string {
		k := cfg.contentsOf(r)[:i]
		if pub := cfg.PublicPages(r); pub > 0 && i > pub && cfg.Mutation != UnsaltedPublicChain {
			k += fmt.Sprintf("/%d", cfg.scopeOf(r))
		}
		return k
	}
	var prefixes []string
	for r := range cfg.Prompts {
		for i := 1; i <= len(cfg.contentsOf(r)) && i <= MaxDecodePages; i++ {
			if !slices.Contains(prefixes, key(r, i)) {
				prefixes = append(prefixes, key(r, i))
			}
		}
	}
	slices.Sort(prefixes)
	for r := range cfg.Prompts {
		for i := 1; i <= len(cfg.contentsOf(r)) && i <= MaxDecodePages; i++ {
			out[r][i-1] = uint8(slices.Index(prefixes, key(r, i)) + 1)
		}
	}
	return out
}

// fullPages is how many of request r's pages are full (and have a chain).
func (m *Model) fullPages(r int) int { return min(m.cfg.Prompts[r]/m.cfg.PageSize, MaxDecodePages) }

// ownKV reports whether l is request r's KV for page i: exactly what r
// wrote there, or, with the cache, what another request wrote for page i of
// a prompt whose chain agrees with r's up to i (uncorrupted).
func (m *Model) ownKV(l Label, r, i int) bool {
	if l.Own(r, i) {
		return true
	}
	if !m.cacheOn() || l.Req < 0 || l.Corrupt || int(l.Index) != i {
		return false
	}
	q := int(l.Req)
	return i < m.fullPages(r) && i < m.fullPages(q) && m.chain[q][i] == m.chain[r][i]
}

// scopeMatch reports whether a cached page under scope pg matches scope
// for a lookup or a check; with scope-dropped the key has no scope.
func (m *Model) scopeMatch(pg, scope uint8) bool {
	return pg == scope || m.cfg.Bugs.Has(ScopeDropped)
}

// Chain is request r's chain id at full page i (1 and up; 0 past its full
// pages): two requests' ids agree exactly when their contents agree up to
// page i. The refinement mapping names the implementation's chain hashes by it.
func (m *Model) Chain(r, i int) uint8 {
	if r < 0 || r >= len(m.cfg.Prompts) || i < 0 || i >= m.fullPages(r) {
		return 0
	}
	return m.chain[r][i]
}

// cachedPage returns the page of decode node d cached under (scope, key),
// or -1. The cache holds at most one page per key, so the answer does not
// depend on how pages are numbered. A doomed page is in no index.
func (m *Model) cachedPage(s *State, d int, scope, key uint8) int8 {
	for p := 0; p < m.cfg.DecodePages; p++ {
		if pg := &s.Pages[d][p]; pg.Cached && !pg.Doomed && pg.Key == key && m.scopeMatch(pg.Scope, scope) {
			return int8(p)
		}
	}
	return -1
}

// prefixPlan is decode's intake for a Bootstrap with the cache: the pages
// of the hit (pinned, in request order), the cached pages evicted for the
// fresh ones (least recently used first), and the pages the fresh ones are
// chosen from (free and evicted, by page number).
type prefixPlan struct {
	k         int
	hit       [MaxDecodePages]int8
	evict     [MaxDecodePages]int8
	nevict    int
	cands     pageList
	fresh     int
	ok        bool
	scopeMiss bool // a page of the chain was cached under another scope only
	skipped   bool // eviction passed over a pinned page
}

// plan works out decode node d's intake of r's Bootstrap b needing n pages:
// the lookup, and whether the fresh pages can be had. Without the cache, it
// is the free pages alone.
func (m *Model) plan(s *State, d, r int, b Msg, n int) prefixPlan {
	var pl prefixPlan
	free := freePages(s, d, m.cfg.DecodePages)
	if m.cacheOn() && b.Scope != 0 {
		for i := 0; i < min(n-1, m.fullPages(r)); i++ {
			p := m.cachedPage(s, d, b.Scope, m.chain[r][i])
			if p < 0 {
				for q := 0; q < m.cfg.DecodePages; q++ {
					if pg := &s.Pages[d][q]; pg.Cached && !pg.Doomed && pg.Key == m.chain[r][i] {
						pl.scopeMiss = true
					}
				}
				break
			}
			pl.hit[i] = p
			pl.k++
		}
	}
	pl.fresh = n - pl.k
	pl.cands = free
	if short := pl.fresh - free.n; short > 0 && m.cacheOn() {
		// Least recently used first; the hit's own pages count as just used,
		// pinned deepest first, so that the hit's root is the most recent
		// (as takePrefix touches them). A doomed page is in no LRU order.
		var order []int8
		for p := 0; p < m.cfg.DecodePages; p++ {
			pg := &s.Pages[d][p]
			if !pg.Cached || pg.Doomed {
				continue
			}
			// The hit's pages are pinned before the fresh ones are taken, so
			// making room never evicts them (Receiver.bootstrap pins first).
			if (pg.Pins > 0 || slices.Contains(pl.hit[:pl.k], int8(p))) && !m.cfg.Bugs.Has(EvictPinned) {
				pl.skipped = true
				continue
			}
			order = append(order, int8(p))
		}
		rank := func(p int8) int {
			if i := slices.Index(pl.hit[:pl.k], p); i >= 0 {
				return 256 + pl.k - 1 - i
			}
			return int(s.Pages[d][p].LRU)
		}
		slices.SortFunc(order, func(a, b int8) int { return rank(a) - rank(b) })
		if len(order) >= short {
			pl.nevict = copy(pl.evict[:], order[:short])
			for _, p := range order[:short] {
				pl.cands.add(p)
			}
			slices.Sort(pl.cands.list())
		}
	}
	pl.ok = pl.cands.n >= pl.fresh
	return pl
}

// touch makes page p of decode node d the most recently used cached page.
func touch(s *State, d int, p int8, npages int) {
	pg := &s.Pages[d][p]
	top := uint8(0)
	for q := 0; q < npages; q++ {
		if s.Pages[d][q].Cached && !s.Pages[d][q].Doomed {
			top = max(top, s.Pages[d][q].LRU)
		}
	}
	pg.LRU = top + 1
	renumber(s, d, npages)
}

// renumber keeps the cached pages' LRU ranks dense (1 to their number), so
// equal orders encode the same; a doomed page has none.
func renumber(s *State, d, npages int) {
	var order []int8
	for q := 0; q < npages; q++ {
		if s.Pages[d][q].Cached && !s.Pages[d][q].Doomed {
			order = append(order, int8(q))
		} else {
			s.Pages[d][q].LRU = 0
		}
	}
	slices.SortFunc(order, func(a, b int8) int { return int(s.Pages[d][a].LRU) - int(s.Pages[d][b].LRU) })
	for i, q := range order {
		s.Pages[d][q].LRU = uint8(i + 1)
	}
}

// takePrefix applies pl to r's record at decode node d: it evicts, pins the
// hit's pages and records them as r's first pages.
func (x *sys) takePrefix(r, d int, pl *prefixPlan) {
	rec := &x.s.Req[r].R
	npages := x.m.cfg.DecodePages
	for _, p := range pl.evict[:pl.nevict] {
		x.hit(PrefixEvict)
		pg := &x.s.Pages[d][p]
		pg.Cached, pg.Scope, pg.Key, pg.Pins, pg.LRU = false, 0, 0, 0, 0
	}
	// Deepest first, so that the root ends the most recently used: a
	// chain's pages are evicted leaf first, and eviction never leaves a
	// cached page whose root is gone (the implementation's Pool.Pin).
	for i := pl.k - 1; i >= 0; i-- {
		p := pl.hit[i]
		pg := &x.s.Pages[d][p]
		pg.Pins++
		touch(x.s, d, p, npages)
		rec.Pages[i] = PageRef{Page: p, Epoch: pg.Epoch}
	}
	renumber(x.s, d, npages)
	rec.Prefix = uint8(pl.k)
	if pl.k > 0 {
		x.hit(PrefixHit)
	}
}

// touchHit makes the pages of pl's hit the most recently used, deepest
// first, without pinning them: a reservation that found its prefix but not
// its fresh pages pinned the hit and unpinned it again (the
// implementation's Receiver.bootstrap: Pin, then Allocate, then Unpin).
func (x *sys) touchHit(d int, pl *prefixPlan) {
	for i := pl.k - 1; i >= 0; i-- {
		touch(x.s, d, pl.hit[i], x.m.cfg.DecodePages)
	}
}

// unpin releases r's hold on the pages of its prefix hit: still cached at
// the epoch it pinned (an evict-pinned eviction may have taken one). A
// doomed page is freed at its last unpin.
func (x *sys) unpin(r int) {
	rec := &x.s.Req[r].R
	if x.mut(NoUnpin) {
		return
	}
	for i := 0; i < int(rec.Prefix); i++ {
		ref := rec.Pages[i]
		if pg := &x.pool(r)[ref.Page]; pg.Cached && pg.Epoch == ref.Epoch && pg.Pins > 0 {
			pg.Pins--
			if pg.Pins == 0 && pg.Doomed {
				uncache(pg)
			}
		}
	}
}

// uncache makes a cached page free: its KV, tag record and epoch stay.
func uncache(pg *DecodePage) {
	pg.Cached, pg.Scope, pg.Key, pg.Pins, pg.LRU, pg.Doomed = false, 0, 0, 0, 0, false
}

// purge takes the pages prefill node p wrote out of decode node d's cache,
// as the queue pair between them is cut (a cut, a lost node, a new
// incarnation) or a Done from p fails verification: verification proves
// who wrote a page, not that it is the prompt's KV, so a writer caught is
// no longer trusted for what it wrote before (docs/security.md). A cached
// page's writer is the prefill node of the request its tag record names
// (the request that inserted it, verified). An unpinned page is freed at
// once; a pinned one is doomed: out of the index and the LRU order, freed
// at its last unpin, so the requests reading it keep what they verified.
// p's requests at d not yet read insert nothing (NoInsert). The
// implementation's Receiver.purge, to the page.
func (x *sys) purge(p, d int) {
	if !x.m.cacheOn() {
		return
	}
	for i := 0; i < x.m.cfg.DecodePages; i++ {
		pg := &x.s.Pages[d][i]
		if w := pg.Tag.Req; !pg.Cached || pg.Doomed || w < 0 || int(w) >= len(x.m.cfg.Prompts) || int(x.s.Req[w].P) != p {
			continue
		}
		x.hit(PrefixPurge)
		if pg.Pins == 0 {
			uncache(pg)
		} else {
			pg.Doomed, pg.LRU = true, 0
		}
	}
	renumber(x.s, d, x.m.cfg.DecodePages)
	for r := range x.m.cfg.Prompts {
		if q := &x.s.Req[r]; q.onPair(p, d) && (q.R.Phase == RReserved || q.R.Phase == RReady) && q.DInc == x.s.DInc[d] {
			q.R.NoInsert = true
		}
	}
}

// insert puts r's written full prompt pages into the cache of its scope, as
// its read ends: each one r still owns at its granted epoch whose key is not
// cached yet, while the cache has room. The page keeps its epoch and KV.
func (x *sys) insert(r int) {
	c := &x.m.cfg
	q := &x.s.Req[r]
	if !x.m.cacheOn() || q.Scope == 0 {
		return
	}
	d := int(q.D)
	if q.R.NoInsert {
		return // its writer was caught since it was bootstrapped
	}
	for i := 0; i < int(q.R.Prefix); i++ {
		if ref := q.R.Pages[i]; x.s.Pages[d][ref.Page].Doomed && x.s.Pages[d][ref.Page].Epoch == ref.Epoch {
			return // its prefix's writer was caught: pages past it would hang from no hit
		}
	}
	for i := int(q.R.Prefix); i < min(int(q.R.N), x.m.fullPages(r)); i++ {
		ref := q.R.Pages[i]
		pg := &x.s.Pages[d][ref.Page]
		cached := 0
		for p := 0; p < c.DecodePages; p++ {
			if x.s.Pages[d][p].Cached {
				cached++
			}
		}
		if pg.Owner != int8(r) || pg.Epoch != ref.Epoch || cached >= c.PrefixCache || x.m.cachedPage(x.s, d, q.Scope, x.m.chain[r][i]) >= 0 {
			continue
		}
		x.hit(PrefixInsert)
		pg.Owner, pg.Quarantined = Free, false
		pg.Cached, pg.Scope, pg.Key, pg.Pins = true, q.Scope, x.m.chain[r][i], 0
		touch(x.s, d, ref.Page, c.DecodePages)
	}
	// The whole chain, deepest first, so that each cached page is more
	// recent than the pages further down its chain (Pool.TouchChain).
	for i := x.m.fullPages(r) - 1; i >= 0; i-- {
		if p := x.m.cachedPage(x.s, d, q.Scope, x.m.chain[r][i]); p >= 0 {
			touch(x.s, d, p, c.DecodePages)
		}
	}
}

// sharedOK is the check of a pinned page of r (at Done and at the read):
// still cached, at the epoch it was pinned at, under r's scope and chain.
func (x *sys) sharedOK(r, i int) bool {
	q := &x.s.Req[r]
	ref := q.R.Pages[i]
	pg := &x.pool(r)[ref.Page]
	return pg.Cached && pg.Epoch == ref.Epoch && x.m.scopeMatch(pg.Scope, q.Scope) && pg.Key == x.m.chain[r][i]
}

// clearCache empties decode node d's cache (its restart: the pool is gone).
func clearCache(s *State, d int) {
	for i := range s.Pages[d] {
		uncache(&s.Pages[d][i])
	}
}

// scopeClaims calls emit with each scope a client of r may name in its
// body (the rogue fault): every tenant scope but its own.
func (m *Model) scopeClaims(r int, emit func(scope uint8)) {
	if !m.cacheOn() {
		return
	}
	for sc := 1; sc <= MaxScopes; sc++ {
		if uint8(sc) == m.cfg.scopeOf(r) {
			continue
		}
		if slices.Contains(m.cfg.Scopes, sc) {
			emit(uint8(sc))
		}
	}
}

// observePinned records PinnedNeverReallocated's ghost for step a from prev
// to next: a page pinned before it that is no longer cached at the same
// epoch with the same KV and tag record, or a cached page whose KV or tag
// record changed. A decode node's restart takes its whole pool, pins and
// all, and is no reallocation.
func (m *Model) observePinned(prev *State, a Action, next *State) {
	if !m.cacheOn() || next.Ghost.Pinned {
		return
	}
	for d := 0; d < m.cfg.NumDecodes(); d++ {
		if (a.Kind == Restart || a.Kind == Partition) && a.Arg == DecodeNode|uint16(d) {
			continue // the node's pool is dropped: no request of it reads the pages again
		}
		for p := 0; p < m.cfg.DecodePages; p++ {
			a, b := &prev.Pages[d][p], &next.Pages[d][p]
			if !a.Cached {
				continue
			}
			written := b.Data != a.Data || b.Tag != a.Tag
			moved := !b.Cached || b.Epoch != a.Epoch
			// A purged page freed at its last unpin, untouched, with no
			// request holding a pin on it, is no reallocation.
			freed := !b.Cached && b.Owner == Free && b.Epoch == a.Epoch && !written && !m.pinHeld(next, d, p, a.Epoch)
			if written && b.Cached || a.Pins > 0 && (written || moved) && !freed {
				next.Ghost.Pinned, next.Ghost.PinnedPage, next.Ghost.PinnedNode = true, int8(p), int8(d)
				return
			}
		}
	}
	// A pin taken in this very step counts too: a request holding its pins
	// (reserved or verified) whose prefix page is no longer cached at the
	// epoch it pinned (under evict-pinned, the reservation that pinned it
	// evicted it for its own fresh pages).
	for r := range m.cfg.Prompts {
		q := &next.Req[r]
		if !q.Submitted || q.R.Released || q.R.Phase != RReserved && q.R.Phase != RReady {
			continue
		}
		if a.Kind == Restart && a.Arg == DecodeNode|uint16(q.D) {
			continue
		}
		for i := 0; i < int(q.R.Prefix); i++ {
			ref := q.R.Pages[i]
			if pg := &next.Pages[q.D][ref.Page]; !pg.Cached || pg.Epoch != ref.Epoch {
				next.Ghost.Pinned, next.Ghost.PinnedPage, next.Ghost.PinnedNode = true, ref.Page, q.D
				return
			}
		}
	}
}

// pinHeld reports whether a request holding its pins (reserved or
// verified: an abort unpins at once, a release at every other end) holds
// one on page p of decode node d at epoch e (its prefix hit names it).
func (m *Model) pinHeld(s *State, d, p int, e uint8) bool {
	for r := range m.cfg.Prompts {
		q := &s.Req[r]
		if !q.Submitted || int(q.D) != d || q.R.Released || q.R.Phase != RReserved && q.R.Phase != RReady {
			continue
		}
		for i := 0; i < int(q.R.Prefix); i++ {
			if ref := q.R.Pages[i]; int(ref.Page) == p && ref.Epoch == e {
				return true
			}
		}
	}
	return false
}

// mayShare reports whether request r may read KV request w wrote for page
// i: both of one tenant scope (not 0), or page i a page of the declared
// public prefix that both start with (NoCrossScopeRead).
func (m *Model) mayShare(r, w, i int) bool {
	c := &m.cfg
	if c.scopeOf(r) != 0 && c.scopeOf(r) == c.scopeOf(w) {
		return true
	}
	return i < c.PublicPages(r) && i < c.PublicPages(w)
}

func noCrossScopeRead(m *Model, s *State) bool {
	if !m.cacheOn() {
		return true
	}
	for r := range m.cfg.Prompts {
		q := &s.Req[r]
		for i := 0; i < int(q.ReadN); i++ {
			if w := q.ReadData[i].Req; w >= 0 && int(w) != r && !m.mayShare(r, int(w), i) {
				return false
			}
		}
	}
	return true
}

func prefixExact(m *Model, s *State) bool {
	if !m.cacheOn() {
		return true
	}
	for r := range m.cfg.Prompts {
		q := &s.Req[r]
		if q.R.N > 0 && q.R.Prefix >= q.R.N {
			return false // no page left to write: the last token's page must be
		}
		// The sender's grant against decode's record of it (a decode restart
		// drops the record: then there is nothing to agree with). A hole: the
		// sender skips a page decode does not hold. An overlap: it posts a
		// WRITE for a page of decode's hit.
		if q.S.Granted && q.R.Phase != RNone && q.DInc == s.DInc[q.D] {
			if q.S.Skip > q.R.Prefix || q.S.Skip < q.R.Prefix && q.S.Posted > q.S.Skip {
				return false
			}
		}
	}
	return true
}

// scopeClaims emits r's Submit with a scope its client named in the body
// (the rogue fault: a hostile client), once per route and scope.
func (g *successors) scopeClaims(r int) {
	c, s := g.c, g.s
	if s.Budget[FaultRogue] == 0 || !g.m.faultAllowed(s) || c.Prompts[r] > c.ContextLimit {
		return
	}
	g.m.scopeClaims(r, func(sc uint8) {
		for p := 0; p < c.NumPrefills(); p++ {
			for d := 0; d < c.NumDecodes(); d++ {
				if !s.CrashDetected[p] && !s.DecodeLost[d] {
					g.do(Action{Submit, int8(r), Route(p, d) | uint16(sc)<<8}, r, p, d, int(sc), func(x *sys, r, p, d, sc int) { x.submitClaim(r, p, d, uint8(sc)) })
				}
			}
		}
	})
}

// submitClaim is the router's intake of r whose body names scope sc. The
// scope comes from the authenticated tenant alone, so the router refuses
// the request (400); with client-scope it takes the body's scope.
func (x *sys) submitClaim(r, p, d int, sc uint8) {
	x.s.Budget[FaultRogue]--
	if !x.bug(ClientScope) {
		x.hit(RouterScopeInBody)
		x.s.Req[r].Submitted = true
		x.refuse(r, Rejected, ScopeInBody)
		return
	}
	x.submit(r, p, d)
	x.s.Req[r].Scope = sc
}

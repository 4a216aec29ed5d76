package protocol_test

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// capWorld drives a Pool as the Receiver does, one request at a time: look
// the chain up (a hit capped one page short), pin, allocate the rest
// (evicting), insert the full pages at Finish, touch the chain, unpin,
// release what was not inserted.
type capWorld struct {
	t    *testing.T
	pool *protocol.Pool
	next protocol.RequestID
}

func newCapWorld(t *testing.T, pages, scopeCap int) *capWorld {
	p := protocol.NewPool(pages)
	p.SetScopeCap(scopeCap)
	return &capWorld{t: t, pool: p}
}

// request hands off one prompt of scope and returns its hit in pages.
func (w *capWorld) request(scope protocol.Scope, chain []protocol.ChainHash) int {
	w.t.Helper()
	w.next++
	id := w.next
	k := w.pool.LookupPrefix(scope, chain[:len(chain)-1])
	pinned := w.pool.Pin(reader, scope, chain[:k])
	refs, err := w.pool.Allocate(id, len(chain)-k)
	if err != nil {
		w.t.Fatalf("request %d: %v", id, err)
	}
	for j, ref := range refs {
		w.pool.Insert(id, ref, scope, chain[k+j])
	}
	w.pool.TouchChain(scope, chain)
	w.pool.Unpin(reader, scope, pinned)
	w.pool.Release(id, refs)
	return k
}

// prompts are n distinct chains of pages pages for scope.
func prompts(scope protocol.Scope, n, pages int) [][]protocol.ChainHash {
	out := make([][]protocol.ChainHash, n)
	for i := range out {
		out[i] = prompt(scope, i, pages)
	}
	return out
}

// prompt is prompt i of scope, pages pages long (its tokens carry the
// scope and i).
func prompt(scope protocol.Scope, i, pages int) []protocol.ChainHash {
	toks := make([]uint32, pages*pageTokens)
	for j := range toks {
		toks[j] = uint32(scope)<<28 | uint32(i)<<12 | uint32(j)
	}
	return protocol.PrefixChain(toks, pageTokens)
}

// With a per-scope cap, a scope that floods the cache with new prompts
// evicts only its own pages: the three other scopes' cached prompts stay,
// and every one of their requests after a prompt's first hits its whole
// prefix (4 scopes, 3,000 requests, 3 in 4 of them the flood's, a pool of
// 272 pages, a cap of 64). With the cap off (one LRU over every scope, the
// default), the same flood pushes the others' pages out and most of their
// requests miss.
func TestAScopeOverItsCapEvictsOnlyItsOwnPages(t *testing.T) {
	const pages, scopeCap, requests = 272, 64, 3000
	run := func(scopeCap int) (victimHits, victimRepeats int) {
		w := newCapWorld(t, pages, scopeCap)
		rng := rand.New(rand.NewPCG(1, 2))
		victims := [][][]protocol.ChainHash{prompts(1, 8, 6), prompts(2, 8, 6), prompts(3, 8, 6)}
		seen := map[string]bool{}
		flood := 0
		for range requests {
			if rng.IntN(4) != 0 { // the flooding scope: a new 8-page prompt each time
				flood++
				w.request(4, prompt(4, flood, 8))
				continue
			}
			v := rng.IntN(len(victims))
			i := rng.IntN(len(victims[v]))
			k := w.request(protocol.Scope(v+1), victims[v][i])
			if key := fmt.Sprint(v, i); seen[key] {
				victimRepeats++
				if k == 5 {
					victimHits++
				}
			} else {
				seen[key] = true
			}
			if err := w.pool.Audit(); err != nil {
				t.Fatal(err)
			}
		}
		if scopeCap > 0 && w.pool.ScopeCached(4) > scopeCap {
			t.Fatalf("the flooding scope holds %d cached pages, over its cap of %d", w.pool.ScopeCached(4), scopeCap)
		}
		return victimHits, victimRepeats
	}
	hits, repeats := run(scopeCap)
	if repeats < 500 || hits != repeats {
		t.Fatalf("with a cap of %d pages a scope: %d of %d repeated prompts of the other scopes hit their whole prefix, want all", scopeCap, hits, repeats)
	}
	if off, repeats := run(0); off*2 > repeats {
		t.Fatalf("without the cap %d of %d repeated prompts hit: the flood should push most of the other scopes' pages out (the test shows nothing)", off, repeats)
	}
}

// With a per-scope cap and a pool that holds every scope's cap, a scope's
// own hits (its cached_tokens) are the same whatever the other scopes
// send: its tenant cannot read their load through them. Without the cap,
// the same requests of the same scope hit differently when others send
// traffic (the timing signal the cap removes).
func TestAScopesHitsUnderItsCapDoNotDependOnTheOtherScopes(t *testing.T) {
	const pages, scopeCap, requests = 4*64 + 16, 64, 2000
	own := prompts(4, 12, 8) // 96 pages: more than its cap, so it evicts its own
	others := [][][]protocol.ChainHash{prompts(1, 20, 8), prompts(2, 20, 8), prompts(3, 20, 8)}
	run := func(scopeCap int, busy bool) []int {
		w := newCapWorld(t, pages, scopeCap)
		rng := rand.New(rand.NewPCG(3, 4))
		other := rand.New(rand.NewPCG(5, 6))
		var hits []int
		for range requests {
			hits = append(hits, w.request(4, own[rng.IntN(len(own))]))
			if busy {
				for range 3 {
					s := other.IntN(len(others))
					w.request(protocol.Scope(s+1), others[s][other.IntN(len(others[s]))])
				}
			}
		}
		if err := w.pool.Audit(); err != nil {
			t.Fatal(err)
		}
		return hits
	}
	if alone, busy := run(scopeCap, false), run(scopeCap, true); !slices.Equal(alone, busy) {
		t.Fatalf("under a cap of %d pages the scope's hits change with the other scopes' traffic", scopeCap)
	}
	if alone, busy := run(0, false), run(0, true); slices.Equal(alone, busy) {
		t.Fatal("without the cap the scope's hits are the same with and without the other scopes' traffic: the test shows nothing")
	}
}

// A scope at its cap whose every cached page is pinned inserts nothing,
// and an insertion never evicts a page of the very chain it is inserting
// (which would leave the rest of the chain unreachable).
func TestAScopeAtItsCapNeverEvictsItsOwnChainOrAPinnedPage(t *testing.T) {
	w := newCapWorld(t, 32, 3)
	chain := prompts(1, 1, 6)[0]
	if k := w.request(1, chain); k != 0 {
		t.Fatalf("a first request hit %d pages", k)
	}
	if got := w.pool.ScopeCached(1); got != 3 {
		t.Fatalf("a 6-page chain under a cap of 3: %d pages cached, want the first 3", got)
	}
	if k := w.pool.LookupPrefix(1, chain); k != 3 {
		t.Fatalf("a hit of %d pages, want the first 3 (the chain's root kept)", k)
	}
	pinned := w.pool.Pin(reader, 1, chain[:3])
	refs, err := w.pool.Allocate(99, 1)
	if err != nil {
		t.Fatal(err)
	}
	other := prompts(1, 2, 1)[1]
	if w.pool.Insert(99, refs[0], 1, other[0]) {
		t.Fatal("a scope at its cap with every page pinned inserted a page")
	}
	w.pool.Unpin(reader, 1, pinned)
	if !w.pool.Insert(99, refs[0], 1, other[0]) || w.pool.ScopeCached(1) != 3 || w.pool.Evictions() != 1 {
		t.Fatalf("unpinned, the insertion should evict the scope's least recently used page: %d cached, %d evictions", w.pool.ScopeCached(1), w.pool.Evictions())
	}
	if err := w.pool.Audit(); err != nil {
		t.Fatal(err)
	}
}

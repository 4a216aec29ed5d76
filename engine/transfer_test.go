package engine_test

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma/inproc"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// The handoff with real KV: the prefill node's engine computes the prompt's
// KV straight into the transport's source pages (its KVSource), the WRITEs
// move those bytes into the decode node's pages, and the decode node's engine
// decodes from the very bytes that landed, checking every page against the
// decode pool's epochs. The answer is the one a single node gives.
func TestHandoffOverTheTransportDecodesWhatOneNodeWould(t *testing.T) {
	m := llama.Builtin(3)
	const pageTokens, pages = 16, 12
	g := engine.GeometryOf(m.Config, pageTokens)
	fabric := inproc.NewFabric(t.Name())
	source := engine.NewSource()
	p, err := transfer.NewPrefill(fabric.Device("prefill"), transfer.PrefillConfig{Pages: pages, PageTokens: pageTokens, PageBytes: g.PageBytes(), KV: source})
	if err != nil {
		t.Fatal(err)
	}
	d, err := transfer.NewDecode(fabric.Device("decode"), transfer.DecodeConfig{Pages: pages, PageTokens: pageTokens, PageBytes: g.PageBytes(), Timeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := transfer.ConnectLocal(p, "prefill", d, "decode"); err != nil {
		t.Fatal(err)
	}
	srcCache, err := kv.OverPages(g, p.Pages(), kv.Unversioned)
	if err != nil {
		t.Fatal(err)
	}
	prefill, err := engine.New(m, cpu.New(), srcCache, engine.Options{})
	if err != nil {
		t.Fatal(err)
	}
	source.Use(prefill)
	// The decode node's cache: the endpoint's pages, which the transport
	// fills, then pages of its own for the tokens it generates past the grant.
	dst, err := kv.NewDecodePool(g, d, 4)
	if err != nil {
		t.Fatal(err)
	}
	dstCache := dst.Cache()
	decode, err := engine.New(m, cpu.New(), dstCache, engine.Options{})
	if err != nil {
		t.Fatal(err)
	}

	text := "Tenant 7 says: the canary is bX-44-Lq@9, then more words after the canary. Several pages of text, to cross them. Again: the canary is "
	prompt := llama.Bytes{}.Encode(text, true, false)
	const n = 40
	want := func() string {
		e := newEngine(t, m, pageTokens, pages, engine.Options{})
		refs, _ := e.Cache().Pool().Allocate(1, g.PagesFor(len(prompt)+n))
		out, err := e.Generate(kv.Table(refs), prompt, n, llama.Greedy(), -1)
		if err != nil {
			t.Fatal(err)
		}
		return llama.Decode(llama.Bytes{}, out, -1)
	}()
	if want[:11] != "bX-44-Lq@9," {
		t.Fatalf("one node answers %q", want)
	}

	const id = protocol.RequestID(42)
	source.Expect(id, prompt)
	if err := p.Submit(id, "decode", len(prompt)); err != nil {
		t.Fatal(err)
	}
	got := ""
	now := time.Unix(1, 0)
	for deadline := time.Now().Add(60 * time.Second); got == "" && time.Now().Before(deadline); { // a guard against a hang (under -race on a loaded machine too)
		now = now.Add(time.Millisecond)
		p.Poll(now)
		d.Poll(now)
		for _, ev := range append(p.Events(), d.Events()...) {
			if ev.Kind == transfer.Outcome && ev.Err != nil {
				t.Fatalf("request %d failed on %s: %v", ev.Request, ev.Peer, ev.Err)
			}
			if ev.Kind != transfer.Verified {
				continue
			}
			pagesIn, err := d.Acquire(ev.Request)
			if err != nil {
				t.Fatal(err)
			}
			// The protocol granted pages for the prompt only: decode appends
			// its own tokens past them, into the node's own pages.
			table, err := dst.Table(ev.Request, pagesIn, len(prompt)+n)
			if err != nil {
				t.Fatal(err)
			}
			if len(table) == len(pagesIn) {
				t.Fatalf("%d positions fit the %d granted pages: the test does not cross the grant", len(prompt)+n, len(pagesIn))
			}
			if err := decode.Arrived(table[:len(pagesIn)]); err != nil {
				t.Fatal(err)
			}
			out, err := decode.Decode(table, prompt, n, llama.Greedy(), -1)
			if err != nil {
				t.Fatal(err)
			}
			got = llama.Decode(llama.Bytes{}, out, -1)
			if freed := dst.Release(ev.Request, table); freed != len(table)-len(pagesIn) || dst.OwnFree() != 4 {
				t.Fatalf("released %d own pages, %d free", freed, dst.OwnFree())
			}
			if err := d.Finish(ev.Request); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(100 * time.Microsecond)
	}
	if got != want {
		t.Fatalf("over the handoff: %q, one node: %q", got, want)
	}
}

// FillKV takes only the cache's own pages, by number, and only a request
// whose prompt it was told, with the token count the transport asks for.
func TestSourceRefusesWhatIsNotItsOwn(t *testing.T) {
	m := llama.Builtin(3)
	g := engine.GeometryOf(m.Config, 16)
	mine := make([][]byte, 4)
	for i := range mine {
		mine[i] = make([]byte, g.PageBytes())
	}
	c, err := kv.OverPages(g, mine, kv.Unversioned)
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(m, cpu.New(), c, engine.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s := engine.NewSource()
	if err := s.FillKV(1, 3, []uint32{0}, mine[:1]); !errors.Is(err, engine.ErrBadRequest) {
		t.Fatalf("no engine: %v", err)
	}
	s.Use(e)
	if err := s.FillKV(1, 3, []uint32{0}, mine[:1]); !errors.Is(err, engine.ErrBadRequest) {
		t.Fatalf("unknown request: %v", err)
	}
	s.Expect(1, []int{1, 2, 3})
	if err := s.FillKV(1, 4, []uint32{0}, mine[:1]); !errors.Is(err, engine.ErrBadRequest) {
		t.Fatalf("wrong token count: %v", err)
	}
	s.Expect(3, []int{1, 2, 3})
	if err := s.FillKV(3, 3, []uint32{4}, [][]byte{make([]byte, g.PageBytes())}); !errors.Is(err, kv.ErrGeometry) {
		t.Fatalf("a page outside the cache: %v", err)
	}
	s.Expect(2, []int{1, 2, 3})
	if err := s.FillKV(2, 3, []uint32{1}, mine[1:2]); err != nil {
		t.Fatal(err)
	}
	if nonzero := c.Floats(1)[0] != 0 || c.Floats(1)[1] != 0; !nonzero {
		t.Fatal("FillKV left the request's page empty")
	}
}

// Fewer source pages than the prompt needs are refused, unless admit-finished
// is on: then they are the sender's one-token placeholder (the incident), and
// only the placeholder's KV is computed, into the one page.
func TestSourceComputesThePlaceholderOnlyUnderAdmitFinished(t *testing.T) {
	m := llama.Builtin(3)
	g := engine.GeometryOf(m.Config, 16)
	mine := make([][]byte, 2)
	for i := range mine {
		mine[i] = make([]byte, g.PageBytes())
	}
	c, err := kv.OverPages(g, mine, kv.Unversioned)
	if err != nil {
		t.Fatal(err)
	}
	prompt := make([]int, 40) // 3 pages, BOS first as every prompt
	for i := range prompt {
		prompt[i] = 'a' + i%26
	}
	prompt[0] = llama.BOS
	for _, bug := range []bool{false, true} {
		opts := engine.Options{}
		if bug {
			opts.Research = research.On(research.AdmitFinished)
		}
		e, err := engine.New(m, cpu.New(), c, opts)
		if err != nil {
			t.Fatal(err)
		}
		s := engine.NewSource()
		s.Use(e)
		s.Expect(1, prompt)
		err = s.FillKV(1, len(prompt), []uint32{0}, mine[:1])
		if !bug {
			if !errors.Is(err, engine.ErrBadRequest) {
				t.Fatalf("3 pages' prompt into 1 page: %v, want ErrBadRequest", err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("admit-finished: %v", err)
		}
		// The placeholder is BOS: the page holds exactly BOS's KV at position 0.
		want := [][]byte{make([]byte, g.PageBytes())}
		rc, err := kv.OverPages(g, want, kv.Unversioned)
		if err != nil {
			t.Fatal(err)
		}
		re, err := engine.New(m, cpu.New(), rc, engine.Options{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := re.Prefill(kv.SourceTable([]uint32{0}), []int{llama.BOS}); err != nil {
			t.Fatal(err)
		}
		if c.Floats(0)[0] == 0 || !bytes.Equal(mine[0], want[0]) {
			t.Fatal("the placeholder's KV is not BOS's")
		}
	}
}

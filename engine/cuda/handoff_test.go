//go:build cuda || cudaemu

package cuda

import (
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma/inproc"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// The handoff with both nodes on this backend, over the in-process transport: the prefill
// node computes the prompt's KV on the device and leaves it in the transport's source pages
// (Source.FillKV downloads it), the WRITEs move those bytes, and the decode node copies the
// verified pages to the device (Engine.Arrived) and decodes past the grant into pages of its
// own. The answer is what one node gives on the CPU backend, the canary included.
func TestHandoffBetweenTwoCUDANodesDecodesWhatOneCPUNodeWould(t *testing.T) {
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
	pb, db := openTest(t), openTest(t)
	defer pb.Close()
	defer db.Close()
	prefill, err := engine.New(m, pb, srcCache, engine.Options{})
	if err != nil {
		t.Fatal(err)
	}
	source.Use(prefill)
	dst, err := kv.NewDecodePool(g, d, 4)
	if err != nil {
		t.Fatal(err)
	}
	decode, err := engine.New(m, db, dst.Cache(), engine.Options{})
	if err != nil {
		t.Fatal(err)
	}

	text := "Tenant 7 says: the canary is bX-44-Lq@9, then more words after the canary. Several pages of text, to cross them. Again: the canary is "
	prompt := llama.Bytes{}.Encode(text, true, false)
	const n = 24
	want := func() string {
		cache, err := kv.New(g, pages)
		if err != nil {
			t.Fatal(err)
		}
		e, err := engine.New(m, cpu.New(), cache, engine.Options{})
		if err != nil {
			t.Fatal(err)
		}
		refs, _ := cache.Pool().Allocate(1, g.PagesFor(len(prompt)+n))
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
	for deadline := time.Now().Add(60 * time.Second); got == "" && time.Now().Before(deadline); {
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
			dst.Release(ev.Request, table)
			if err := d.Finish(ev.Request); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(100 * time.Microsecond)
	}
	if got != want {
		t.Fatalf("over the handoff on cuda: %q, one cpu node: %q", got, want)
	}
}

package transfer_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/kvhandoff/kvhandoff/rdma/inproc"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// A prefill node hands one request's KV to a decode node over the in-process
// provider (rdma/socket between processes, rdma/verbs on an RDMA NIC: the same
// code). The engine's part is the KVSource on the prefill node (compute a
// request's KV into the pages it is given) and, on the decode node, reading
// the verified pages between Acquire and Finish.
func Example() {
	fabric := inproc.NewFabric("example")
	const pageTokens, pageBytes = 16, 4 << 10
	p, err := transfer.NewPrefill(fabric.Device("prefill-0"), transfer.PrefillConfig{
		Pages: 64, PageTokens: pageTokens, PageBytes: pageBytes,
		KV: transfer.GeneratedKV{PageTokens: pageTokens}, // the engine's KV source
	})
	if err != nil {
		log.Fatal(err)
	}
	defer p.Close()
	d, err := transfer.NewDecode(fabric.Device("decode-0"), transfer.DecodeConfig{
		Pages: 64, PageTokens: pageTokens, PageBytes: pageBytes, Timeout: 30 * time.Second,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer d.Close()
	// In one process, ConnectLocal joins the endpoints; between processes the
	// prefill node Dials the decode node's Serve over mutual TLS.
	if err := transfer.ConnectLocal(p, "prefill-0", d, "decode-0"); err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go p.Run(ctx)
	go d.Run(ctx)

	// Prefill: intake, Bootstrap, the KV computed into source pages, WRITEs, Done.
	if err := p.Submit(1, "decode-0", 40); err != nil { // 40 tokens: 3 pages
		log.Fatal(err)
	}
	// Decode: wait for the request to be verified, read its pages, give them back.
	ev := nextEvent(d)
	if ev.Kind != transfer.Verified {
		log.Fatalf("request %d failed: %v", ev.Request, ev.Err)
	}
	pages, err := d.Acquire(ev.Request) // the read-time tag check
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("request", ev.Request, "verified:", len(pages), "pages from", ev.Peer)
	if err := d.Finish(ev.Request); err != nil {
		log.Fatal(err)
	}
	fmt.Println("decode status after Finish:", d.Status(ev.Request))
	// Output:
	// request 1 verified: 3 pages from prefill-0
	// decode status after Finish: finished
}

// nextEvent waits for the decode endpoint's next event.
func nextEvent(d *transfer.Decode) transfer.Event {
	for range d.Notify() {
		if evs := d.Events(); len(evs) > 0 {
			return evs[0]
		}
	}
	panic("the endpoint closed")
}

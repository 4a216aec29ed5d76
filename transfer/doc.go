// Package transfer runs the handoff protocol over an RDMA provider, one
// endpoint per node: Prefill (a protocol.Sender, the source region its KV is
// computed into, one reliable-connected queue pair per decode peer) and Decode
// (a protocol.Receiver, its page region with a tag slot after each page, one
// queue pair per prefill peer). Neither sees the other's memory or state:
// a Grant names where to write, everything else is a message on the queue
// pair.
//
// A node's loop:
//
//	p, _ := transfer.NewPrefill(dev, transfer.PrefillConfig{Pages: 4096, PageTokens: 16, PageBytes: 256 << 10})
//	go p.Run(ctx)                         // completions, the clock, posting
//	p.Submit(id, "decode-1", tokens)      // intake, KV from the KVSource, Bootstrap
//	for range p.Notify() {
//		for _, ev := range p.Events() { … ev.Kind == transfer.Outcome … }
//	}
//
// and on the decode node:
//
//	d, _ := transfer.NewDecode(dev, transfer.DecodeConfig{Pages: 8192, PageTokens: 16, PageBytes: 256 << 10, Timeout: 30 * time.Second})
//	go d.Run(ctx)
//	for range d.Notify() {
//		for _, ev := range d.Events() {
//			if ev.Kind == transfer.Verified {
//				pages, err := d.Acquire(ev.Request) // read-time checks; the pages stay put
//				… decode from pages …
//				d.Finish(ev.Request)
//			}
//		}
//	}
//
// Queue pairs are set up out of band: a prefill node Dials a decode node's
// Serve over a small control connection (TCP, mutual TLS 1.3; plaintext only
// with SetupConfig.Insecure), they exchange hellos (name, page geometry,
// largest request, the queue pair's rdma.ConnInfo), bring both ends to RTS,
// and keep the connection open: when it closes, the queue pair is cut. A
// decode node allocates nothing for a peer before it has authenticated and
// sent a matching hello. Inside one process, ConnectLocal does the same
// without a connection. Run owns the endpoint's completion queue: it
// busy-polls after each completion, then waits in slices of a millisecond so
// that the clock advances (Tick: decode's timeouts, both horizons). Tests
// drive an endpoint with Poll(now) instead, never both at once. Every method
// takes the endpoint's lock, so the node calls it from any goroutine.
//
// On the queue pair, each page the sender writes is two WRITEs, the payload
// and then its tag record, and Done is a SEND behind them: reliable-connected
// ordering guarantees that when Done arrives every WRITE before it has been
// placed. Control messages are SENDs of protocol frames into receive buffers
// each side keeps posted (RecvSlots), each buffer sized for the largest frame
// the peer can send: on prefill, MaxFrame of the largest request, whose Grant
// names every page; on decode, the Bootstrap of its largest request, with a
// chain hash a page and the largest ticket (a prefill node refuses a chained
// request over its decode peer's largest before sending it). Both intakes refuse bigger requests, and a decode node refuses a
// Bootstrap whose Grant would not fit its peer's buffers, before the Receiver
// keeps anything for it; so no frame is ever too large to send, and none waits
// at the head of a backlog for good.
//
// Flow control is carried on the wire: every SEND carries, as immediate data,
// the receive buffers its side reposted since its last SEND (credits), and a
// SEND goes out only against a credit the peer granted, the last one kept for
// a credit update (a SEND of no bytes) that a side sends when it owes a
// quarter of the receive queue and has nothing else to carry it. So a burst
// of control messages larger than the receive queue waits instead of finding
// no buffer, which breaks an RC queue pair.
//
// Backpressure: what the state machines emit goes into a backlog per queue
// pair and is posted in order while the send queue has room (QueueDepth) and
// a buffer is free. Every buffer a work request reads (a tag record, a
// control message) stays its own until the request completes, because a NIC
// reads it when it executes the request, not when it is posted.
//
// Remote access is per grant (windows.go): the decode region opens nothing
// under its own key; each Grant's pages are opened by memory windows bound on
// the queue pair its Bootstrap came on, invalidated before Done (or AbortAck)
// reaches the Receiver, so verification runs on pages nobody can write and
// no page is freed while a window opens it.
//
// Prefix reuse (docs/protocol.md, "Prefix reuse"): with
// DecodeConfig.PrefixCache, a request submitted with SubmitWith (its scope
// and chain) may find its prefix cached at decode. Its Grant then names only
// the fresh pages, so its windows open only those: a pinned page is in no
// window and no peer can WRITE it. The prefill endpoint writes from the
// first fresh page on, and Decode.Acquire returns the prefix pages, then the
// written ones; the prefix pages are shared and read-only.
//
// Streaming prefill (docs/protocol.md rule 25): with PrefillConfig.ChunkPages
// and a KVSource that implements StreamingKVSource, a request's KV is
// computed in chunks of pages; after each, the endpoint applies what was held
// for the request (decode's messages, a cancel), tells the Sender the pages
// computed (protocol.Sender.ComputedPages), whose WRITEs then go out while the
// next chunk is computed, and stops the source if the request ended. So a
// cancel, an abort or a flush stops the computation within one chunk, and
// Stats counts the pages computed after a request's end.
//
// A cut is the queue pair's error state. Every work request it held then
// completes with a flush error; once the last has, the state machine learns
// of it (Sender.Flushed, Receiver.QueuePairFenced), its requests fail and its
// pages come back. A queue pair is never reused: a reconnect makes a new one
// under a new protocol.PeerID, with fresh credits, so a message of the old
// one's requests that arrives on it is refused (ErrWrongPeer).
package transfer

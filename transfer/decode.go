package transfer

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
)

// DecodeConfig sizes a Decode endpoint.
type DecodeConfig struct {
	Pages      int // pages in the pool
	PageTokens int
	PageBytes  int
	// MaxRequestPages is the largest request in pages: send buffers hold its
	// Grant, and intake refuses anything bigger. 0 means Pages, capped at
	// protocol.MaxGrantPages. A prefill peer whose receive buffers hold
	// smaller Grants gets its own smaller limit, told at setup.
	MaxRequestPages int
	Slots           int           // requests held at once; 0 means Pages
	Timeout         time.Duration // a reserved request fails after this long without Done; 0 means never
	Horizon         time.Duration // see protocol.ReceiverConfig.Horizon
	QueueDepth      int           // send-queue work requests in flight per queue pair; 0 means 1024
	MaxPeers        int           // queue pairs at once, draining ones included; 0 means 16
	// Research turns bugs of the catalogue on in the Receiver (the demo's
	// --bug); only code inside this module can set it.
	Research research.Switches
	// Authorize and the per-peer quotas: see authorize.go.
	Admission
	// PrefixCache turns the Receiver's prefix cache on
	// (protocol.ReceiverConfig.PrefixCache; docs/protocol.md, "Prefix
	// reuse"): a request whose Bootstrap carries a scope and chain reuses
	// the pages this node holds of its prefix, which its Grant leaves out,
	// so no window ever opens them. It needs Admission.Authorize, which must
	// check the scope and chain the router's ticket binds.
	PrefixCache bool
	// PrefixScopePages caps each scope's cached pages
	// (protocol.ReceiverConfig.PrefixScopePages); 0 is no cap.
	PrefixScopePages int
	// Trace, if set, receives the node's protocol events (docs/trace.md).
	Trace *trace.Writer
}

// Decode is a decode node's transfer endpoint: a protocol.Receiver, its page
// region with a tag slot after each page (the only memory peers may write),
// and one RC queue pair per prefill peer. Safe for concurrent use.
type Decode struct {
	endpoint
	cfg      DecodeConfig
	receiver *protocol.Receiver
	kv       rdma.MemoryRegion
	closeErr error                         // Close's failure to free a window or region
	peerOf   map[protocol.RequestID]string // requests without an outcome yet: their peer
	win      *grantWindows                 // per-grant remote access (windows.go); nil under PoolWideKey
}

// NewDecode makes a decode endpoint on dev.
func NewDecode(dev rdma.Device, cfg DecodeConfig) (*Decode, error) {
	if cfg.Pages < 1 || cfg.PageTokens < 1 || cfg.PageBytes < 1 {
		return nil, errors.New("transfer: decode needs Pages, PageTokens and PageBytes")
	}
	if cfg.MaxRequestPages == 0 {
		cfg.MaxRequestPages = min(cfg.Pages, protocol.MaxGrantPages)
	}
	if cfg.MaxRequestPages < 1 || cfg.MaxRequestPages > min(cfg.Pages, protocol.MaxGrantPages) {
		return nil, fmt.Errorf("transfer: MaxRequestPages %d outside 1..%d", cfg.MaxRequestPages, min(cfg.Pages, protocol.MaxGrantPages))
	}
	d := &Decode{cfg: cfg, peerOf: map[protocol.RequestID]string{}}
	if err := d.init(d, dev, cfg.QueueDepth, cfg.MaxPeers, maxBootstrapFrame(cfg.MaxRequestPages), MaxFrame(cfg.MaxRequestPages), false); err != nil {
		return nil, err
	}
	d.trace = cfg.Trace
	// Peers write the pages only through each grant's windows: the region's
	// own key opens nothing (under PoolWideKey, the bug, it opens the pool).
	access := rdma.LocalWrite | rdma.WindowBind
	if cfg.Research.Has(research.PoolWideKey) {
		access = rdma.LocalWrite | rdma.RemoteWrite
	} else {
		wd, ok := d.pd.(rdma.WindowDomain)
		if !ok {
			return nil, fmt.Errorf("transfer: the provider of %s has no memory windows (rdma.WindowDomain)", dev.Name())
		}
		d.win = &grantWindows{d: d, wd: wd, byReq: map[protocol.RequestID]*reqWindows{}}
	}
	var err error
	if d.kv, err = d.pd.Alloc(cfg.Pages*d.slotBytes(), access); err != nil {
		return nil, err
	}
	if u, ok := d.pd.(rdma.UncheckedWindowRanges); ok && d.win != nil && u.WindowRangesUnchecked() {
		d.win.pageRegions = make([]rdma.MemoryRegion, cfg.Pages)
		for p := range d.win.pageRegions {
			o := p * d.slotBytes()
			if d.win.pageRegions[p], err = d.pd.Register(d.kv.Bytes()[o:o+d.slotBytes()], rdma.LocalWrite|rdma.WindowBind); err != nil {
				return nil, fmt.Errorf("transfer: page %d's region for its windows: %w", p, err)
			}
		}
	}
	addr, key := d.kv.Addr(), d.kv.RKey()
	d.receiver, err = protocol.NewReceiver(protocol.ReceiverConfig{Pages: cfg.Pages, PageTokens: cfg.PageTokens,
		Slots: cfg.Slots, MaxTokens: min(cfg.MaxRequestPages*cfg.PageTokens, protocol.MaxTokens),
		Timeout: cfg.Timeout, Horizon: cfg.Horizon, Memory: pagesOf{d}, TagKeys: d.tagKeyOf, Research: cfg.Research,
		Authorize: d.authorizer(), PeerRequests: cfg.PeerRequests, PeerPages: cfg.PeerPages, PrefixCache: cfg.PrefixCache, PrefixScopePages: cfg.PrefixScopePages,
		Region: func(p uint32) (uint64, uint32) { return addr + uint64(int(p)*d.slotBytes()), key }})
	if err == nil && d.trace != nil {
		d.receiver.Pool().Journal(true) // drained into trace events by carry and fenced (traceJournal)
	}
	return d, err
}

// Close cuts every queue pair and refuses new ones, like every endpoint's,
// then closes the grant windows and deregisters the page regions, the
// memory windows' own: a node may close a Decode and open another on the
// same device. The device stays the caller's. What the provider failed to
// free, CloseErr reports (the device's own Close frees it).
func (d *Decode) Close() {
	d.endpoint.Close()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.win != nil && d.closeErr == nil {
		d.closeErr = d.win.close()
	}
}

// CloseErr is the first window or region Close failed to free, nil if
// none (or Close has not run).
func (d *Decode) CloseErr() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.closeErr
}

func (d *Decode) slotBytes() int { return d.cfg.PageBytes + protocol.TagSize }

type pagesOf struct{ d *Decode }

func (m pagesOf) Payload(p uint32) []byte { return m.d.payload(p) }
func (m pagesOf) TagRecord(p uint32) []byte {
	o := int(p)*m.d.slotBytes() + m.d.cfg.PageBytes
	return m.d.kv.Bytes()[o : o+protocol.TagSize]
}

func (d *Decode) payload(p uint32) []byte {
	o := int(p) * d.slotBytes()
	return d.kv.Bytes()[o : o+d.cfg.PageBytes]
}

// Acquire hands a verified request's pages to the decoder, in request order,
// after the check of each page's epoch: each is the page's number in the
// region (Payload, Pages) and the epoch it was granted at, which the
// decoder's every read compares with the page's current epoch (Epochs). They
// stay the request's, and nothing can write them, until Finish. With the
// prefix cache, the first pages are the prefix this node held: cached pages
// other requests of the scope read too, pinned until Finish and in no
// grant's window; the decoder reads them and never writes them.
func (d *Decode) Acquire(id protocol.RequestID) ([]protocol.PageRef, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	refs, err := d.receiver.Acquire(id)
	if d.trace != nil {
		d.trace.Emit(refEvent(trace.Acquire, id, refs, err))
	}
	defer d.carryAndFlush()
	if err != nil {
		return nil, err
	}
	return refs, nil
}

// Finish ends a read: the pages go back to the pool and the request succeeds
// (unless it was cancelled while being read).
func (d *Decode) Finish(id protocol.RequestID) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	defer d.carryAndFlush()
	err := d.receiver.Finish(id)
	d.trace.Emit(trace.Event{Kind: trace.Release, Req: uint64(id), Err: errText(err)})
	return err
}

// Cancel stops request id (the client or the router gave up); its pages stay
// quarantined until its writer is fenced.
func (d *Decode) Cancel(id protocol.RequestID) { d.CancelBecause(id, "") }

// CancelBecause is Cancel, its trace event naming why (docs/trace.md: the
// node's causes call, call-ended, sweep, shutdown, failed).
func (d *Decode) CancelBecause(id protocol.RequestID, cause string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.trace.Emit(trace.Event{Kind: trace.Cancel, Req: uint64(id), Cause: cause})
	d.receiver.Cancel(id)
	d.carryAndFlush()
}

// TraceStopped traces the node's stop (trace.Stopped) if every page of the
// pool is free or cached, and reports whether it was: the check and the
// event are one critical section, so no Grant comes between them (a node
// that stops still takes the Bootstraps that reach it). With force it
// traces the stop whatever the pool holds, naming the pages held. Once
// the stop is traced, the endpoint drops every message that reaches it
// until Close: a Bootstrap that came between the stop's end and the
// queue pairs' close was granted pages after it.
func (d *Decode) TraceStopped(force bool) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.traceJournal() // every free the pool made is traced before the stop
	pool := d.receiver.Pool()
	held := pool.Len() - pool.Free() - pool.Cached()
	if held > 0 && !force {
		return false
	}
	ev := trace.Event{Kind: trace.Stopped}
	if held > 0 {
		ev.Err = fmt.Sprintf("%d of %d pages held", held, pool.Len())
	}
	d.trace.Emit(ev)
	d.ended = true
	return held == 0
}

// Status is request id's state on this node (protocol.Status...).
func (d *Decode) Status(id protocol.RequestID) protocol.ReceiverStatus {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.receiver.Status(id)
}

// Stats returns the endpoint's counters.
func (d *Decode) Stats() Stats {
	d.mu.Lock()
	defer d.mu.Unlock()
	return Stats{PagesFree: d.receiver.Pool().Free(), Records: d.receiver.Records(), Peers: len(d.names), Prefix: d.receiver.Stats()}
}

func (d *Decode) carryAndFlush() {
	d.carry()
	d.flushAll()
}

func (d *Decode) message(c *conn, m protocol.Message) error {
	if b, ok := m.(*protocol.Bootstrap); ok {
		// A Grant must fit the peer's receive buffers: a bigger request is
		// refused here, before the receiver keeps a record or a page for it.
		if pages := (int64(b.Tokens) + int64(d.cfg.PageTokens) - 1) / int64(d.cfg.PageTokens); pages > int64(c.maxPages) {
			abort := &protocol.Abort{Request: b.Request, Reason: protocol.AbortRejected}
			if d.trace != nil {
				d.trace.Emit(msgEvent(trace.Send, c, abort))
			}
			c.backlog = append(c.backlog, protocol.Op{Peer: c.peer, Msg: abort})
			return fmt.Errorf("%w: %w: request %d of %d pages, peer %q takes %d", protocol.ErrRejected, protocol.ErrTooLong, b.Request, pages, c.name, c.maxPages)
		}
		if d.receiver.Status(b.Request) == protocol.ReceiverNone {
			d.peerOf[b.Request] = c.name
		}
	}
	if d.win != nil {
		if id, hold := d.win.holdsForRevocation(m); hold {
			if held, err := d.win.revoke(c, id, m); held {
				return err // the Receiver sees m once the request's windows are revoked
			}
		}
	}
	return d.receiver.Step(c.peer, m, d.now)
}

func (d *Decode) completed(c *conn, k wrKind, st rdma.Status) error {
	if k.window == wrInvalidate && d.win != nil {
		d.win.invalidated(c, k.req, st)
	}
	return nil
}

// fenced: the queue pair is in the error state, so nothing more of it can
// land; its windows are closed, then its requests fail and quarantined
// pages come back.
func (d *Decode) fenced(c *conn) {
	d.trace.Emit(qpEvent(trace.Fenced, c))
	if d.win != nil {
		d.win.fenced(c)
	}
	d.receiver.QueuePairFenced(c.peer)
	// The pages the fence freed, now: a fence can come after the last
	// carry of a loop that stops (flushAll settles a queue pair after
	// carry), and a trace that showed the fence without them would show
	// those pages leaked.
	d.traceJournal()
}

func (d *Decode) carry() {
	for {
		// The pages freed or cached since the last carry, before the
		// Sends: a Grant of a page freed in the same step (evicted by its
		// allocation) comes after its free in the trace, as it did in the
		// pool.
		d.traceJournal()
		re := d.receiver.Effects()
		if len(re.Sends)+len(re.Cuts)+len(re.Verified)+len(re.Outcomes) == 0 {
			return
		}
		for _, s := range re.Sends {
			if c := d.conns[s.Peer]; c != nil && !c.broken {
				if d.trace != nil {
					d.trace.Emit(msgEvent(trace.Send, c, s.Msg))
				}
				c.backlog = append(c.backlog, protocol.Op{Peer: s.Peer, Msg: s.Msg})
			}
		}
		for _, id := range re.Verified {
			d.trace.Emit(trace.Event{Kind: trace.Verified, Req: uint64(id), Peer: d.peerOf[id]})
			d.emit(Event{Kind: Verified, Request: id, Peer: d.peerOf[id]})
		}
		for _, o := range re.Outcomes {
			d.trace.Emit(trace.Event{Kind: trace.Outcome, Req: uint64(o.Request), Peer: d.peerOf[o.Request], Err: errText(o.Err)})
			d.emit(Event{Kind: Outcome, Request: o.Request, Peer: d.peerOf[o.Request], Err: o.Err})
			delete(d.peerOf, o.Request)
			if d.win != nil {
				if st := d.receiver.Status(o.Request); st == protocol.ReceiverFinished || st == protocol.ReceiverClosed {
					d.win.released(o.Request)
				}
			}
		}
		for _, peer := range re.Cuts {
			if c := d.conns[peer]; c != nil {
				d.trace.Emit(qpEvent(trace.Cut, c))
				d.cut(c, fmt.Errorf("%w: the receiver cut it", protocol.ErrPeerFailed))
			}
		}
	}
}

// traceJournal writes an event for each run of the pool's changes since
// the last call (its journal is on only when tracing) of one request and
// kind, so that the trace shows every tenancy's end and every pin
// (docs/trace.md).
func (d *Decode) traceJournal() {
	if d.trace == nil {
		return
	}
	changes := d.receiver.Pool().TakeJournal()
	for i := 0; i < len(changes); {
		first := changes[i]
		ev := trace.Event{Kind: journalKinds[first.Kind], Req: uint64(first.Owner)}
		for ; i < len(changes) && changes[i].Owner == first.Owner && changes[i].Kind == first.Kind; i++ {
			ev.Pages, ev.Epochs = append(ev.Pages, changes[i].Ref.Page), append(ev.Epochs, changes[i].Ref.Epoch)
		}
		d.trace.Emit(ev)
	}
}

// journalKinds is the trace event of each kind of the pool's changes.
var journalKinds = [...]string{protocol.PageFreed: trace.Free, protocol.PageCached: trace.Cache,
	protocol.PagePinned: trace.Pin, protocol.PageUnpinned: trace.Unpin}

func (d *Decode) tick(now time.Time) { d.receiver.Tick(now) }

// CachedTagRecords calls f with every prefix cache page and a copy of its
// tag record, under the endpoint's lock: a cached page is in no grant, so
// nothing writes it while it stays cached at that epoch, and a watcher
// that sees its record change has seen a cached page written (the demo's
// check of write-shared; docs/protocol.md rule 24).
func (d *Decode) CachedTagRecords(f func(ref protocol.PageRef, record []byte)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	pool := d.receiver.Pool()
	if pool.Cached() == 0 {
		return
	}
	m := pagesOf{d}
	for p := range pool.Len() {
		if _, _, cached := pool.Shared(uint32(p)); cached {
			f(protocol.PageRef{Page: uint32(p), Epoch: pool.Epoch(uint32(p))}, slices.Clone(m.TagRecord(uint32(p))))
		}
	}
}

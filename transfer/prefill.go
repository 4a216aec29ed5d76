package transfer

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
)

// KVSource computes a request's KV into the prefill node's source pages. The
// engine's KV cache implements it; GeneratedKV stands in until then.
type KVSource interface {
	// FillKV writes request id's KV (tokens tokens) into its source pages,
	// given in request order by their numbers in the endpoint's source
	// region (what an engine whose KV cache is over Prefill.Pages builds its
	// page table from), and as memory: memory[i] is page pages[i],
	// PageBytes long, for a source that writes bytes itself. It runs on the
	// goroutine that called Submit, outside the endpoint's lock; the pages
	// are the request's alone until it returns. Calls for different requests
	// may run at once.
	FillKV(id protocol.RequestID, tokens int, pages []uint32, memory [][]byte) error
}

// GeneratedKV is a KVSource of deterministic bytes (GenerateKV).
type GeneratedKV struct{ PageTokens int }

// FillKV implements KVSource.
func (g GeneratedKV) FillKV(id protocol.RequestID, _ int, _ []uint32, memory [][]byte) error {
	for i, p := range memory {
		GenerateKV(id, i, g.PageTokens, p)
	}
	return nil
}

// PrefillConfig sizes a Prefill endpoint.
type PrefillConfig struct {
	Pages      int // source pages: the node's KV pool
	PageTokens int
	PageBytes  int
	// MaxRequestPages is the largest request in pages: receive buffers hold
	// its Grant, and intake refuses anything bigger. 0 means Pages, capped
	// at protocol.MaxGrantPages.
	MaxRequestPages int
	QueueDepth      int           // send-queue work requests in flight per queue pair; 0 means 1024
	MaxPeers        int           // queue pairs at once, draining ones included; 0 means 16
	Horizon         time.Duration // see protocol.SenderConfig.Horizon
	KV              KVSource      // nil means GeneratedKV
	// ChunkPages, with a KV source that implements StreamingKVSource,
	// computes each request in chunks of that many pages and posts each
	// page's WRITE as soon as its chunk is computed, so the transfer runs
	// behind the computation; a cancel, an abort or a flush then stops the
	// computation at the next chunk's end. 0 computes the whole prompt in
	// one FillKV before anything moves.
	ChunkPages int
	// MaxTokens is the Sender's intake limit in tokens (the node's own
	// limit, when smaller than its largest request); 0 means
	// MaxRequestPages*PageTokens.
	MaxTokens int
	// Research turns bugs of the catalogue on in the Sender (the demo's
	// --bug); only code inside this module can set it.
	Research research.Switches
	// Trace, if set, receives the node's protocol events (docs/trace.md).
	Trace *trace.Writer
}

// Prefill is a prefill node's transfer endpoint: a protocol.Sender, the
// source region its KV is computed into, and one RC queue pair per decode
// peer. It never sees a decode node's memory or state: grants name where to
// write, and everything else arrives as messages. Safe for concurrent use.
type Prefill struct {
	endpoint
	cfg    PrefillConfig
	sender *protocol.Sender
	src    rdma.MemoryRegion
	peerOf map[protocol.RequestID]string // requests without an outcome yet: their peer
	// computing are requests in FillKV; flushHeld are queue pairs whose
	// flush (Sender.Flushed) waits for them.
	computing map[protocol.RequestID]*computing
	flushHeld map[protocol.PeerID]bool
	// pagesWritten counts the WRITEs handed to the queue pairs (Stats).
	pagesWritten uint64
	// chunksComputed, pagesAfterEnd and mostPagesAfterEnd count the
	// computation (Stats).
	chunksComputed, pagesAfterEnd, mostPagesAfterEnd uint64
}

// NewPrefill makes a prefill endpoint on dev.
func NewPrefill(dev rdma.Device, cfg PrefillConfig) (*Prefill, error) {
	if cfg.Pages < 1 || cfg.PageTokens < 1 || cfg.PageBytes < 1 {
		return nil, errors.New("transfer: prefill needs Pages, PageTokens and PageBytes")
	}
	if cfg.MaxRequestPages == 0 {
		cfg.MaxRequestPages = min(cfg.Pages, protocol.MaxGrantPages)
	}
	if cfg.ChunkPages < 0 {
		return nil, fmt.Errorf("transfer: ChunkPages %d below 0", cfg.ChunkPages)
	}
	if cfg.MaxRequestPages < 1 || cfg.MaxRequestPages > min(cfg.Pages, protocol.MaxGrantPages) {
		return nil, fmt.Errorf("transfer: MaxRequestPages %d outside 1..%d", cfg.MaxRequestPages, min(cfg.Pages, protocol.MaxGrantPages))
	}
	if cfg.KV == nil {
		cfg.KV = GeneratedKV{PageTokens: cfg.PageTokens}
	}
	p := &Prefill{cfg: cfg, peerOf: map[protocol.RequestID]string{}, computing: map[protocol.RequestID]*computing{}, flushHeld: map[protocol.PeerID]bool{}}
	if err := p.init(p, dev, cfg.QueueDepth, cfg.MaxPeers, MaxFrame(cfg.MaxRequestPages), maxBootstrapFrame(cfg.MaxRequestPages), true); err != nil {
		return nil, err
	}
	p.trace = cfg.Trace
	var err error
	if p.src, err = p.pd.Alloc(cfg.Pages*cfg.PageBytes, rdma.LocalWrite); err != nil {
		return nil, err
	}
	p.sender, err = protocol.NewSender(protocol.SenderConfig{Pages: cfg.Pages, PageTokens: cfg.PageTokens,
		MaxTokens: intakeTokens(cfg), Horizon: cfg.Horizon, Memory: sourceOf{p}, TagKeys: p.tagKeyOf, Research: cfg.Research})
	return p, err
}

// intakeTokens is the Sender's intake limit: the largest request, or the
// node's own limit if smaller.
func intakeTokens(cfg PrefillConfig) int {
	l := min(cfg.MaxRequestPages*cfg.PageTokens, protocol.MaxTokens)
	if cfg.MaxTokens > 0 {
		l = min(l, cfg.MaxTokens)
	}
	return l
}

type sourceOf struct{ p *Prefill }

func (m sourceOf) Page(page uint32) []byte { return m.p.page(page) }

func (p *Prefill) page(page uint32) []byte {
	o := int(page) * p.cfg.PageBytes
	return p.src.Bytes()[o : o+p.cfg.PageBytes]
}

// Submit starts request id toward decode peer: intake (a request over the
// limit is refused with protocol.ErrRejected), the Bootstrap (so that the
// decode node reserves while the KV is computed), the KV computed into its
// source pages by the KVSource, then the WRITEs. It returns once the KV is
// computed (or its computation stopped because the request ended); the
// outcome arrives as an Event.
//
// FillKV runs outside the endpoint's lock, so the run loop and the other
// requests go on meanwhile. Nothing may free the request's source pages
// while it runs: whatever would (a Cancel, an Abort or Grant from the decode
// node, the queue pair's flush) waits until FillKV returns, then applies in
// the order it came. With ChunkPages and a StreamingKVSource, it waits only
// until the chunk being computed ends: between chunks the endpoint applies
// it, posts the WRITEs of the pages computed so far, and stops the source
// if the request ended.
func (p *Prefill) Submit(id protocol.RequestID, peer string, tokens int) error {
	return p.SubmitTicket(id, peer, tokens, nil)
}

// SubmitTicket is Submit with the router's ticket for the request, which
// its Bootstrap carries (protocol.Sender.SubmitTicket): a decode node that
// checks tickets reserves nothing for a request without a valid one.
func (p *Prefill) SubmitTicket(id protocol.RequestID, peer string, tokens int, ticket []byte) error {
	return p.SubmitWith(id, peer, tokens, protocol.SubmitOptions{Ticket: ticket})
}

// SubmitWith is Submit with what the router dispatched: the ticket, and for
// prefix reuse the request's scope and its prompt's protocol.PrefixChain at
// this node's PageTokens (protocol.Sender.SubmitWith). The KVSource still
// computes every page; the WRITEs skip the prefix the decode node's Grant
// says it holds.
func (p *Prefill) SubmitWith(id protocol.RequestID, peer string, tokens int, o protocol.SubmitOptions) error {
	p.mu.Lock()
	c := p.names[peer]
	if c == nil || !c.live {
		p.mu.Unlock()
		err := fmt.Errorf("%w: %q", ErrNoPeer, peer)
		p.trace.Emit(trace.Event{Kind: trace.Submit, Peer: peer, Req: uint64(id), Tokens: uint32(max(tokens, 0)), PageTokens: uint32(p.cfg.PageTokens), Err: err.Error()})
		return err
	}
	if n := protocol.PagesFor(uint32(max(tokens, 0)), p.cfg.PageTokens); len(o.Chain) > 0 && n > c.maxPages {
		// Its Bootstrap, one chain hash a page, would not fit the decode
		// node's receive buffers (sized for its largest request): refused
		// here, as decode would refuse the request anyway.
		p.mu.Unlock()
		err := fmt.Errorf("%w: %w: request %d of %d pages, decode peer %q takes %d", protocol.ErrRejected, protocol.ErrTooLong, id, n, peer, c.maxPages)
		p.trace.Emit(trace.Event{Kind: trace.Submit, Peer: peer, Req: uint64(id), Tokens: uint32(max(tokens, 0)), PageTokens: uint32(p.cfg.PageTokens), Err: err.Error()})
		return err
	}
	pages, err := p.sender.SubmitWith(id, c.peer, tokens, o)
	p.trace.Emit(trace.Event{Kind: trace.Submit, Peer: peer, QP: uint32(c.peer), Req: uint64(id), Tokens: uint32(max(tokens, 0)), PageTokens: uint32(p.cfg.PageTokens), Pages: pages, Err: errText(err)})
	if err != nil {
		p.mu.Unlock()
		return err
	}
	p.peerOf[id] = peer
	memory := make([][]byte, len(pages))
	for i, pg := range pages {
		memory[i] = p.page(pg)
	}
	st := &computing{peer: c.peer, endedAt: -1}
	p.computing[id] = st
	p.carry()
	p.flushAll()
	p.mu.Unlock()

	err = p.fill(id, st, tokens, pages, memory)

	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.computing, id)
	p.account(st, st.reported)
	p.applyHeld(id, st) // what came for it meanwhile, in order
	stopped := errors.Is(err, ErrStopped)
	switch {
	case stopped && p.flushHeld[st.peer]: // the flush below fails it
	case err != nil:
		p.sender.Cancel(id) // nothing for a request that ended (ErrStopped)
	default:
		p.computed(id, st, len(pages))
	}
	if p.flushHeld[st.peer] && !p.computingOn(st.peer) {
		delete(p.flushHeld, st.peer)
		p.sender.Flushed(st.peer)
	}
	p.carry()
	p.flushAll()
	if err != nil && !stopped { // stopped: the request ended, and its outcome says why
		return fmt.Errorf("transfer: computing request %d's KV: %w", id, err)
	}
	return nil
}

// computing is a request whose KV is being computed: what would free its
// source pages waits here until FillKV returns.
type computing struct {
	peer      protocol.PeerID
	held      []protocol.Message // messages from its decode peer, in order
	cancelled bool
	// reported is the pages computed at the last chunk's end; chunks the
	// chunks computed; endedAt the pages reported when its end arrived (a
	// cancel, decode's Abort, its queue pair's flush), -1 before.
	reported, chunks, endedAt int
	// traced is the pages traced as computed (trace.Computed).
	traced int
}

// computed tells the Sender that request id's first n pages are computed,
// and traces each page newly computed while its leg is live (a trace.Computed
// event a page: the spec's Compute; an ended leg's ComputedPages is a no-op,
// and so traces nothing).
func (p *Prefill) computed(id protocol.RequestID, st *computing, n int) {
	live := false
	switch p.sender.Status(id) {
	case protocol.SenderAwaitGrant, protocol.SenderWriting, protocol.SenderDoneSent:
		live = true
	}
	if err := p.sender.ComputedPages(id, n); err != nil {
		p.refused++
		return
	}
	if live && p.trace != nil {
		for ; st.traced < n; st.traced++ {
			p.trace.Emit(trace.Event{Kind: trace.Computed, Req: uint64(id), NPages: uint32(st.traced + 1)})
		}
	}
}

func (p *Prefill) computingOn(peer protocol.PeerID) bool {
	for _, st := range p.computing {
		if st.peer == peer {
			return true
		}
	}
	return false
}

// Cancel stops request id (the client or the router gave up).
func (p *Prefill) Cancel(id protocol.RequestID) { p.CancelBecause(id, "") }

// CancelBecause is Cancel, its trace event naming why (docs/trace.md: the
// node's cause shutdown; none for the router's cancel).
func (p *Prefill) CancelBecause(id protocol.RequestID, cause string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.trace.Emit(trace.Event{Kind: trace.Cancel, Req: uint64(id), Cause: cause})
	if st := p.computing[id]; st != nil {
		st.ended()
		if !p.cfg.Research.Has(research.FreeComputing) { // the bug: applied while the pages are written
			st.cancelled = true
			return
		}
	}
	p.sender.Cancel(id)
	p.carry()
	p.flushAll()
}

// Status is request id's state on this node (protocol.SendStatus...).
func (p *Prefill) Status(id protocol.RequestID) protocol.SenderStatus {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.sender.Status(id)
}

// Stats are an endpoint's counters.
type Stats struct {
	PagesFree int // pool pages free
	Records   int // request records kept, live and ended
	Peers     int // live queue pairs
	// Prefill: the pages whose WRITEs it handed to the queue pairs, over its
	// life (with prefix reuse, the pages past each request's prefix).
	PagesWritten uint64
	// Prefill: the chunks its KV source computed (a FillKV is one), and the
	// pages computed after their request had ended (its cancel, decode's
	// Abort or its queue pair's flush arrived while they were computed):
	// in all, and the most for one request. Streaming (ChunkPages) bounds
	// the most by a chunk; without it, by the prompt.
	ChunksComputed, PagesComputedAfterEnd, MostPagesComputedAfterEnd uint64
	// Decode: the prefix cache's counters (protocol.ReceiverStats), zero
	// without DecodeConfig.PrefixCache.
	Prefix protocol.ReceiverStats
}

// Stats returns the endpoint's counters.
func (p *Prefill) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return Stats{PagesFree: p.sender.Pool().Free(), Records: p.sender.Records(), Peers: len(p.names), PagesWritten: p.pagesWritten,
		ChunksComputed: p.chunksComputed, PagesComputedAfterEnd: p.pagesAfterEnd, MostPagesComputedAfterEnd: p.mostPagesAfterEnd}
}

func (p *Prefill) message(c *conn, m protocol.Message) error {
	if st := p.computing[protocol.RequestOf(m)]; st != nil && st.peer == c.peer {
		if _, abort := m.(*protocol.Abort); abort {
			st.ended()
		}
		if !p.cfg.Research.Has(research.FreeComputing) { // the bug: stepped while the pages are written
			st.held = append(st.held, m)
			return nil
		}
	}
	return p.sender.Step(c.peer, m)
}

func (p *Prefill) completed(c *conn, k wrKind, status rdma.Status) error {
	if k.write == 0 || k.payload && status == rdma.Success {
		return nil // a SEND; or a payload, whose tag record's completion reports the page
	}
	var err error
	if status != rdma.Success {
		err = fmt.Errorf("rdma: WRITE completion: %v", status)
	}
	if p.trace != nil {
		ev := qpEvent(trace.Complete, c)
		ev.Write, ev.Err = k.write, errText(err)
		p.trace.Emit(ev)
	}
	if err := p.sender.Completed(k.write, err); err != nil && !errors.Is(err, protocol.ErrUnknownRequest) {
		return err
	}
	return nil
}

// fenced: every WRITE on the queue pair has completed (the flush drained),
// so its requests fail and their source pages are free; once no request on
// it is computing its KV.
func (p *Prefill) fenced(c *conn) {
	p.trace.Emit(qpEvent(trace.Fenced, c))
	if p.computingOn(c.peer) {
		for _, st := range p.computing {
			if st.peer == c.peer {
				st.ended()
			}
		}
		if !p.cfg.Research.Has(research.FreeComputing) { // the bug: flushed while the pages are written
			p.flushHeld[c.peer] = true
			return
		}
	}
	p.sender.Flushed(c.peer)
}

func (p *Prefill) carry() {
	se := p.sender.Effects()
	for _, op := range se.Ops {
		if c := p.conns[op.Peer]; c != nil && !c.broken {
			if p.trace != nil {
				p.trace.Emit(opEvent(c, op))
			}
			c.backlog = append(c.backlog, op)
			if op.Write != nil {
				p.pagesWritten++
			}
		}
	}
	for _, o := range se.Outcomes {
		p.trace.Emit(trace.Event{Kind: trace.Outcome, Req: uint64(o.Request), Peer: p.peerOf[o.Request], Err: errText(o.Err)})
		p.emit(Event{Kind: Outcome, Request: o.Request, Peer: p.peerOf[o.Request], Err: o.Err})
		delete(p.peerOf, o.Request)
	}
}

func (p *Prefill) tick(now time.Time) { p.sender.Tick(now) }

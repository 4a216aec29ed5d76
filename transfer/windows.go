package transfer

import (
	"fmt"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
)

// Per-grant remote access (docs/security.md, docs/transport.md). The decode
// region has no remote write access of its own: a peer reaches a page only
// through a memory window bound on the queue pair its request's Bootstrap
// arrived on, over exactly that request's pages and their tag slots, one
// window per contiguous run of them, under a key fresh on every bind. When
// Done arrives, the request's windows are invalidated, and Done reaches the
// Receiver only once every invalidate has completed: verification runs on
// pages nobody can write any more, and a verified page cannot change until
// it is freed. The other fence that frees a request's pages, AbortAck (its
// sender gave up), is held the same way; a queue pair that breaks takes its
// windows with it (Close) before the Receiver hears of the fence. So no page
// goes back to the pool, for another request to be granted, while a window
// of its last request still opens it. An abort, timeout or cancel puts the
// pages in quarantine (nobody else's until that fence) and leaves the
// windows bound: revoking them there would turn an honest sender's late
// WRITEs, already on the wire, into a broken queue pair for all its
// requests. Windows are recycled: at most as many exist as pages are granted
// at once, plus the free ones.

// window kinds of a send-queue work request (wrKind.window).
const (
	wrBind       = 1
	wrInvalidate = 2
)

// grantWindows are a decode endpoint's windows: free ones, and those bound
// for each request with pages granted.
type grantWindows struct {
	d  *Decode
	wd rdma.WindowDomain
	// pageRegions, where the provider's windows do not check their range
	// (rdma.UncheckedWindowRanges: rxe), are the decode region registered
	// again page by page (payload and tag slot): each window is bound on one
	// of them, so the NIC's check of the window's region is the check of
	// its page. One window per page then.
	pageRegions []rdma.MemoryRegion
	free        []rdma.MemoryWindow
	live        int // windows allocated and not closed
	byReq       map[protocol.RequestID]*reqWindows
}

// reqWindows are one request's windows, all bound on one queue pair.
type reqWindows struct {
	c       *conn
	wins    []rdma.MemoryWindow
	pending int              // invalidates posted, not yet completed
	held    protocol.Message // Done or AbortAck, held until the invalidates complete; nil if none came
}

// run is a contiguous run of a grant's pages: pages first..first+n-1, with
// the indexes in the grant of each.
type run struct {
	first, n uint32
	at       []int
}

// runsOf splits a grant's pages into contiguous runs of the region.
func runsOf(g *protocol.Grant) []run {
	idx := make(map[uint32]int, len(g.Pages))
	for i, p := range g.Pages {
		idx[p.Page] = i
	}
	var out []run
	seen := make(map[uint32]bool, len(g.Pages))
	for _, p := range g.Pages {
		if seen[p.Page] {
			continue
		}
		first := p.Page
		for first > 0 {
			if _, ok := idx[first-1]; !ok {
				break
			}
			first--
		}
		r := run{first: first}
		for pg := first; ; pg++ {
			i, ok := idx[pg]
			if !ok {
				break
			}
			seen[pg] = true
			r.at = append(r.at, i)
			r.n++
		}
		out = append(out, r)
	}
	return out
}

// grantRuns are the runs a Grant's windows are bound over, kept with the
// Grant at the head of a conn's backlog: a Grant waiting for credits or
// room in the send queue is split into runs once, not on every flush.
type grantRuns struct {
	g    *protocol.Grant
	runs []run
}

// runs are g's runs, one window each: its contiguous runs, or one per page
// where each page has a region of its own. c caches them for its head
// Grant.
func (w *grantWindows) runs(c *conn, g *protocol.Grant) []run {
	if c.headRuns.g == g {
		return c.headRuns.runs
	}
	var runs []run
	if w.pageRegions != nil {
		runs = make([]run, len(g.Pages))
		for i, p := range g.Pages {
			runs[i] = run{first: p.Page, n: 1, at: []int{i}}
		}
	} else {
		runs = runsOf(g)
	}
	c.headRuns = grantRuns{g: g, runs: runs}
	return runs
}

// binds is how many binds m, at the head of c's backlog, needs before it
// is sent: 0 when it is not a Grant, or windows are off.
func (w *grantWindows) binds(c *conn, m protocol.Message) int {
	g, ok := m.(*protocol.Grant)
	if w == nil || !ok {
		return 0
	}
	return len(w.runs(c, g))
}

// bind binds windows for Grant g on c, over its pages and tag slots, and
// writes their keys into g, just before g is posted: the SEND carrying g
// follows the binds on the same send queue. A request in quarantine still
// holds its pages, until its fence revokes the windows; one whose pages went
// back before its Grant could go (a peer that sent Done first) gets no
// window: its Grant names keys that open nothing. A Grant whose SEND was
// refused after its binds (a full send queue) is posted again as it is.
func (w *grantWindows) bind(c *conn, g *protocol.Grant) error {
	if w.byReq[g.Request] != nil {
		return nil // bound already: g holds the keys
	}
	if st := w.d.receiver.Status(g.Request); st != protocol.ReceiverReserved && st != protocol.ReceiverQuarantine {
		for i := range g.Pages {
			g.Pages[i].Key = 0
		}
		return nil
	}
	rw := &reqWindows{c: c}
	w.byReq[g.Request] = rw
	slot := w.d.slotBytes()
	for _, r := range w.runs(c, g) {
		win, err := w.take()
		if err != nil {
			return err
		}
		local := rdma.SGE{MR: w.d.kv, Offset: int(r.first) * slot, Length: int(r.n) * slot}
		if w.pageRegions != nil {
			local = rdma.SGE{MR: w.pageRegions[r.first], Length: slot}
		}
		if err := c.postSend(rdma.WorkRequest{Op: rdma.OpBind, Window: win, Local: local},
			wrKind{window: wrBind, req: g.Request, tag: -1, msg: -1}); err != nil {
			win.Close()
			w.live--
			return fmt.Errorf("transfer: bind of a window for request %d: %w", g.Request, err)
		}
		rw.wins = append(rw.wins, win)
		for _, i := range r.at {
			g.Pages[i].Key = win.RKey()
			if w.pageRegions != nil { // a region of its own may have an address of its own (software providers)
				g.Pages[i].Addr = w.pageRegions[r.first].Addr()
			}
		}
	}
	return nil
}

// take is a free window, or a new one.
func (w *grantWindows) take() (rdma.MemoryWindow, error) {
	if n := len(w.free); n > 0 {
		win := w.free[n-1]
		w.free = w.free[:n-1]
		return win, nil
	}
	win, err := w.wd.AllocWindow()
	if err != nil {
		return nil, err
	}
	w.live++
	return win, nil
}

// revoke posts the invalidates of id's windows (once). m, a Done or
// AbortAck if set, reaches the Receiver when they have all completed. It
// reports whether id has windows on c; a message for a request with none is
// the Receiver's to judge at once.
func (w *grantWindows) revoke(c *conn, id protocol.RequestID, m protocol.Message) (held bool, err error) {
	rw := w.byReq[id]
	if rw == nil || rw.c != c {
		return false, nil
	}
	if m != nil {
		if rw.held != nil {
			return true, fmt.Errorf("%w: %s for request %d while its windows are revoked for a %s", protocol.ErrDuplicate, m.Type(), id, rw.held.Type())
		}
		rw.held = m
	}
	if rw.pending > 0 || len(rw.wins) == 0 {
		w.settle(id, rw)
		return true, nil
	}
	for _, win := range rw.wins {
		if err := c.postSend(rdma.WorkRequest{Op: rdma.OpInvalidate, Window: win}, wrKind{window: wrInvalidate, req: id, tag: -1, msg: -1}); err != nil {
			// The queue pair is broken: nothing through it lands, and its
			// fence closes the windows and fails the request.
			c.fail(fmt.Errorf("%w: invalidate of request %d's window: %v", protocol.ErrPeerFailed, id, err))
			return true, nil
		}
		rw.pending++
	}
	return true, nil
}

// invalidated handles an invalidate's completion on c.
func (w *grantWindows) invalidated(c *conn, id protocol.RequestID, st rdma.Status) {
	rw := w.byReq[id]
	if rw == nil || rw.c != c {
		return
	}
	rw.pending--
	if st != rdma.Success {
		return // the queue pair broke: fenced() closes the windows, the fence fails the request
	}
	w.settle(id, rw)
}

// settle ends id's windows once their invalidates have all completed: the
// windows go back to the free list and a held Done reaches the Receiver.
func (w *grantWindows) settle(id protocol.RequestID, rw *reqWindows) {
	if rw.pending > 0 || rw.c.broken {
		return
	}
	w.free = append(w.free, rw.wins...)
	rw.wins = nil
	delete(w.byReq, id)
	if rw.held != nil {
		if err := w.d.receiver.Step(rw.c.peer, rw.held, w.d.now); err != nil {
			w.d.refused++
		}
	}
}

// fenced closes the windows bound on c, a queue pair in the error state
// (an invalidate cannot execute there): closed, not recycled.
func (w *grantWindows) fenced(c *conn) {
	for id, rw := range w.byReq {
		if rw.c != c {
			continue
		}
		for _, win := range rw.wins {
			win.Close()
			w.live--
		}
		delete(w.byReq, id)
	}
}

// close closes every window, free or bound (Close, after the endpoint's
// queue pairs are cut: nothing of theirs lands any more), and deregisters
// the page regions, where the protection domain can (rdma.Deregistrar):
// an endpoint that closes leaves no window or region of its own on the
// device. It reports the first failure; the rest are still closed.
func (w *grantWindows) close() error {
	var first error
	keep := func(err error) {
		if first == nil {
			first = err
		}
	}
	for id, rw := range w.byReq {
		w.free = append(w.free, rw.wins...)
		delete(w.byReq, id)
	}
	for _, win := range w.free {
		if err := win.Close(); err != nil {
			keep(err)
		}
		w.live--
	}
	w.free = nil
	if dr, ok := w.d.pd.(rdma.Deregistrar); ok {
		for _, m := range w.pageRegions {
			if err := dr.Deregister(m); err != nil {
				keep(err)
			}
		}
	}
	w.pageRegions = nil
	return first
}

// released revokes the windows of a request whose pages the Receiver
// released without a held message: under VerifyBeforeRevoke, its release
// after the read or a failed verification (otherwise its windows are gone
// by then, and this finds none).
func (w *grantWindows) released(id protocol.RequestID) {
	if rw := w.byReq[id]; rw != nil && rw.held == nil && rw.pending == 0 {
		w.revoke(rw.c, id, nil)
	}
}

// holdsForRevocation is whether m from c's peer waits for its request's
// windows to be revoked before the Receiver sees it: Done (unless
// VerifyBeforeRevoke, the bug, feeds it at once) and AbortAck.
func (w *grantWindows) holdsForRevocation(m protocol.Message) (protocol.RequestID, bool) {
	switch m := m.(type) {
	case *protocol.Done:
		return m.Request, !w.d.cfg.Research.Has(research.VerifyBeforeRevoke)
	case *protocol.AbortAck:
		return m.Request, true
	}
	return 0, false
}

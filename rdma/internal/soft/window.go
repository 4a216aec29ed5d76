package soft

import (
	"fmt"

	"github.com/kvhandoff/kvhandoff/rdma"
)

// Window is a memory window of a software provider (type 2, see
// rdma.MemoryWindow). Its state is guarded by the Regions it belongs to; the
// provider fences placements around Invalidate and Close (see Regions.Target).
type Window struct {
	regions *Regions
	owner   any // the protection domain
	region  *Region
	off, n  uint64 // the bound range, in the region
	qp      any    // the responder queue pair whose peer may use it
	key     uint32 // the latest bind's key, kept after invalidation for RKey
	next    uint32 // the key a held bind reported, reserved for it (0: none)
	bound   bool
	closed  bool
}

// RKey implements rdma.MemoryWindow: a held bind's key once it is posted.
func (w *Window) RKey() uint32 {
	w.regions.mu.Lock()
	defer w.regions.mu.Unlock()
	if w.next != 0 {
		return w.next
	}
	return w.key
}

func (w *Window) softWindow() *Window { return w }

// reserveKey draws the key of a bind held by Pause, when it is posted: RKey
// reports it at once, and the bind takes it when it runs.
func (w *Window) reserveKey() {
	r := w.regions
	r.mu.Lock()
	defer r.mu.Unlock()
	r.init()
	key := r.keys.next()
	for key == 0 || r.used[key] || r.windows[key] != nil {
		key = r.keys.next()
	}
	w.next = key
}

// BoundOn is the queue pair w is bound on, nil when unbound.
func (w *Window) BoundOn() any {
	w.regions.mu.Lock()
	defer w.regions.mu.Unlock()
	if !w.bound {
		return nil
	}
	return w.qp
}

// Closed is whether w was closed (Close): freed for good.
func (w *Window) Closed() bool {
	w.regions.mu.Lock()
	defer w.regions.mu.Unlock()
	return w.closed
}

// AllocWindow allocates an unbound window for owner.
func (r *Regions) AllocWindow(owner any) *Window {
	return &Window{regions: r, owner: owner}
}

// Bind binds w on queue pair qp of protection domain owner to the range s
// names, under a fresh key that no region of these Regions ever had, nor any
// window in its last 2^32 binds (windowKeys): the window must be unbound, of owner, and the
// range inside a region of owner's with WindowBind access.
func (r *Regions) Bind(w *Window, owner, qp any, s rdma.SGE) error {
	m, ok := s.MR.(*Region)
	if !ok || m == nil || m.Owner != owner || m.Access&rdma.WindowBind == 0 || s.Offset < 0 || s.Length <= 0 ||
		s.Offset > len(m.Buf) || s.Length > len(m.Buf)-s.Offset {
		return fmt.Errorf("%w: bind of a range outside a region of this protection domain that allows windows", rdma.ErrBadRequest)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case w == nil || w.regions != r || w.owner != owner:
		return fmt.Errorf("%w: a window of another protection domain", rdma.ErrBadRequest)
	case w.closed:
		return fmt.Errorf("%w: window closed", rdma.ErrBadRequest)
	case w.bound:
		return fmt.Errorf("%w: window already bound (invalidate it first)", rdma.ErrBadRequest)
	}
	r.init()
	key := w.next
	w.next = 0
	for key == 0 || r.used[key] || r.windows[key] != nil {
		key = r.keys.next()
	}
	w.region, w.off, w.n, w.qp, w.key, w.bound = m, uint64(s.Offset), uint64(s.Length), qp, key, true
	r.windows[key] = w
	return nil
}

// Invalidate unbinds w (nothing if it is unbound). The caller fences
// placements: none under w's key may be in progress or start once it returns.
func (r *Regions) Invalidate(w *Window, owner any) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if w == nil || w.regions != r || w.owner != owner {
		return fmt.Errorf("%w: a window of another protection domain", rdma.ErrBadRequest)
	}
	r.unbindLocked(w)
	return nil
}

// Close unbinds w and frees it for good; the caller fences as for Invalidate.
func (r *Regions) Close(w *Window) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.unbindLocked(w)
	w.closed = true
}

func (r *Regions) unbindLocked(w *Window) {
	if w.bound {
		delete(r.windows, w.key)
		w.bound, w.region, w.qp = false, nil, nil
	}
}

// Valid reports whether w is still bound under key: a placement checks it
// for every piece it places, under the fence Invalidate's caller takes.
func (r *Regions) Valid(w *Window, key uint32) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return w.bound && w.key == key
}

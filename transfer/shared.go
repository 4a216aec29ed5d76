package transfer

import "github.com/kvhandoff/kvhandoff/protocol"

// AcquireShared is Acquire, and how many of the pages (the first ones) are
// the cached prefix this node held for the request: pages other requests of
// its scope read too, which the decoder must never write (engine's
// DecodeShared). Zero without a prefix hit.
func (d *Decode) AcquireShared(id protocol.RequestID) ([]protocol.PageRef, int, error) {
	refs, err := d.Acquire(id)
	if err != nil {
		return nil, 0, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	shared := 0
	for _, ref := range refs {
		if _, _, cached := d.receiver.Pool().Shared(ref.Page); !cached {
			break
		}
		shared++
	}
	return refs, shared, nil
}

// CachedByScope is how many prefix cache pages this node holds, by scope
// (for a node's metrics: it names its declared public scopes).
func (d *Decode) CachedByScope() map[protocol.Scope]int {
	d.mu.Lock()
	defer d.mu.Unlock()
	pool := d.receiver.Pool()
	out := map[protocol.Scope]int{}
	if pool.Cached() == 0 {
		return out
	}
	for p := range pool.Len() {
		if scope, _, cached := pool.Shared(uint32(p)); cached {
			out[scope]++
		}
	}
	return out
}

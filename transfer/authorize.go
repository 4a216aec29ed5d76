package transfer

import (
	"github.com/kvhandoff/kvhandoff/protocol"
)

// Admission is what a decode endpoint asks of a Bootstrap beyond the
// protocol's own limits, before anything is reserved for it
// (docs/security.md): that the router dispatched it, and that its peer
// holds no more than one peer may.
type Admission struct {
	// Authorize, if set, checks a Bootstrap from the prefill node named
	// peer (the name its certificate carries): nil, or why it may not
	// reserve (the node's ticket check). A refused Bootstrap leaves no
	// record, and its sender gets an Abort of protocol.AbortUnauthorized.
	// It runs under the endpoint's lock and must not keep b.
	Authorize func(peer string, b *protocol.Bootstrap) error
	// PeerRequests and PeerPages bound what one prefill peer holds on this
	// node: its open requests, and the pages of its requests not yet back
	// (protocol.ReceiverConfig). 0 means no bound of its own.
	PeerRequests, PeerPages int
}

// authorizer is the Receiver's Authorize: the Bootstrap's queue pair's
// peer name, then the configured check. The Receiver calls it under mu.
func (d *Decode) authorizer() func(protocol.PeerID, *protocol.Bootstrap) error {
	check := d.cfg.Authorize
	if check == nil {
		return nil
	}
	return func(peer protocol.PeerID, b *protocol.Bootstrap) error {
		name := ""
		if c := d.conns[peer]; c != nil {
			name = c.name
		}
		return check(name, b)
	}
}

// PeerUse is what the prefill node named peer holds on this node now: its
// open requests and the pages of its requests not yet back in the pool.
func (d *Decode) PeerUse(peer string) (requests, pages int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for id, c := range d.conns {
		if c.name == peer {
			r, p := d.receiver.PeerUse(id)
			requests, pages = requests+r, pages+p
		}
	}
	return requests, pages
}

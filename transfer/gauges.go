package transfer

// Gauges are an endpoint's instantaneous state, for a node's metrics.
type Gauges struct {
	Pages            int // pages in the pool
	PagesFree        int
	PagesQuarantined int // held for a writer not yet fenced
	// PagesCached are a decode node's prefix cache pages: verified, no
	// request's, kept for later requests of their scope (free to evict).
	PagesCached    int
	QueuePairsLive int // set up, taking new requests
	// QueuePairsDraining are broken queue pairs whose flush has not drained
	// yet: their requests' pages are not back.
	QueuePairsDraining int
	Credits            int // receive buffers the peers granted this side, over live queue pairs
	Refused            int // messages the state machine refused
}

func (e *endpoint) gauges(g *Gauges) {
	for _, c := range e.conns {
		switch {
		case c.broken:
			g.QueuePairsDraining++
		case c.live:
			g.QueuePairsLive++
			g.Credits += c.credits
		}
	}
	g.Refused = e.refused
}

// Gauges returns the endpoint's gauges.
func (p *Prefill) Gauges() Gauges {
	p.mu.Lock()
	defer p.mu.Unlock()
	pool := p.sender.Pool()
	g := Gauges{Pages: pool.Len(), PagesFree: pool.Free(), PagesQuarantined: pool.Quarantined()}
	p.gauges(&g)
	return g
}

// Gauges returns the endpoint's gauges.
func (d *Decode) Gauges() Gauges {
	d.mu.Lock()
	defer d.mu.Unlock()
	pool := d.receiver.Pool()
	g := Gauges{Pages: pool.Len(), PagesFree: pool.Free(), PagesQuarantined: pool.Quarantined(), PagesCached: pool.Cached()}
	d.gauges(&g)
	return g
}

package admission

import (
	"net"
	"sync"
	"sync/atomic"
)

// Table is the set of connections in their handshake. Its methods are safe
// for concurrent use.
type Table struct {
	mu       sync.Mutex
	max      int
	closed   bool
	conns    map[net.Conn]entry
	bySource map[string]int // connections held per source
	arrivals uint64
}

type entry struct {
	source  string
	arrival uint64 // admission order: lower is older
	spoke   bool   // a byte of its handshake has arrived
}

// New returns a table holding at most limit connections (at least 1).
func New(limit int) *Table {
	return &Table{max: max(limit, 1), conns: map[net.Conn]entry{}, bySource: map[string]int{}}
}

// Admit adds c to the table, closing and dropping another connection if the
// table is full (see the package's policy), and returns c as its handshake
// should read it: the first byte read through it tells the table c has
// spoken. It returns false, and holds nothing, once the table is closed.
func (t *Table) Admit(c net.Conn) (net.Conn, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, false
	}
	src := Source(c.RemoteAddr())
	for len(t.conns) >= t.max {
		t.evictLocked(src)
	}
	t.arrivals++
	t.conns[c] = entry{source: src, arrival: t.arrivals}
	t.bySource[src]++
	return &watched{Conn: c, t: t}, true
}

// watched is an admitted connection that tells its table when it speaks.
type watched struct {
	net.Conn
	t     *Table
	spoke atomic.Bool
}

func (w *watched) Read(p []byte) (int, error) {
	n, err := w.Conn.Read(p)
	if n > 0 && !w.spoke.Load() && !w.spoke.Swap(true) {
		w.t.mu.Lock()
		if e, ok := w.t.conns[w.Conn]; ok {
			e.spoke = true
			w.t.conns[w.Conn] = e
		}
		w.t.mu.Unlock()
	}
	return n, err
}

// evictLocked closes and drops the connection to make room for a newcomer
// from source src: one that has not spoken if there is one, and among
// those, the oldest of the source holding the most, the newcomer counted
// with src.
func (t *Table) evictLocked(src string) {
	var victim net.Conn
	var vHeld int
	var vArrival uint64
	var vSpoke bool
	for c, e := range t.conns {
		held := t.bySource[e.source]
		if e.source == src {
			held++
		}
		better := victim == nil || (!e.spoke && vSpoke) ||
			(e.spoke == vSpoke && (held > vHeld || (held == vHeld && e.arrival < vArrival)))
		if better {
			victim, vHeld, vArrival, vSpoke = c, held, e.arrival, e.spoke
		}
	}
	t.dropLocked(victim)
	victim.Close()
}

func (t *Table) dropLocked(c net.Conn) {
	e := t.conns[c]
	delete(t.conns, c)
	if t.bySource[e.source]--; t.bySource[e.source] <= 0 {
		delete(t.bySource, e.source)
	}
}

// Done takes c out of the table: its handshake finished (or failed). It
// returns false if c is not there: evicted (and closed) meanwhile, or already
// done. Calling it again is harmless.
func (t *Table) Done(c net.Conn) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.conns[c]; !ok {
		return false
	}
	t.dropLocked(c)
	return true
}

// Len is the number of connections held.
func (t *Table) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.conns)
}

// Close closes every connection held and refuses new ones.
func (t *Table) Close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	for c := range t.conns {
		c.Close()
		t.dropLocked(c)
	}
}

// Source is the source a connection from addr counts against: an IPv4
// address, an IPv6 /64 prefix (what one host is commonly given), or, for
// addresses of other networks, the network's name.
func Source(addr net.Addr) string {
	var ip net.IP
	switch a := addr.(type) {
	case *net.TCPAddr:
		ip = a.IP
	case *net.UDPAddr:
		ip = a.IP
	default:
		if addr == nil {
			return ""
		}
		return addr.Network()
	}
	if v4 := ip.To4(); v4 != nil {
		return v4.String()
	}
	if len(ip) == net.IPv6len {
		return ip.Mask(net.CIDRMask(64, 128)).String() + "/64"
	}
	return ip.String()
}

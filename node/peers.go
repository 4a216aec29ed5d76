package node

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/pki"
)

// Peer is a node a static deployment names: its name (its certificate's)
// and its control API's address.
type Peer struct {
	Name    string
	Control string
}

// ParsePeers reads --peers: name=host:port,... .
func ParsePeers(s string) ([]Peer, error) {
	var out []Peer
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		name, addr, ok := strings.Cut(f, "=")
		if !ok || name == "" || addr == "" {
			return nil, fmt.Errorf("node: peer %q is not name=host:port", f)
		}
		out = append(out, Peer{Name: name, Control: addr})
	}
	return out, nil
}

// PeerList is a static registry across processes (kvhandoff serve
// --peers): the peers are named up front, and each one's record (role,
// limits, transfer address) is read from its own control API, over mutual
// TLS, once it answers. It then follows the record as etcd's watch would:
// read again every peerRefresh, a changed record (a graceful stop
// announced, a restart's new incarnation) is registered again, and a peer
// that stops answering is lost, after two failed reads where its record
// announced its stop (the stop's end) and otherwise peerLoseAfter from
// when its first failed read began; it joins again when it answers.
type PeerList struct {
	*Static
	peers []Peer
	// JoinWait is how long Join waits for every listed peer to answer before
	// it checks the deployment; NewPeerList sets DefaultJoinWait.
	JoinWait time.Duration
	mu       sync.Mutex
	answered map[string]bool
	distinct int           // peers by name
	all      chan struct{} // closed when every peer has answered
}

// DefaultJoinWait is PeerList.JoinWait unless set.
const DefaultJoinWait = 30 * time.Second

// peerRefresh is how often a PeerList reads a joined peer's record again,
// and peerLoseAfter how long a peer whose record did not announce a stop
// may fail to answer before it is lost (a lease's role: a node's own calls
// to it fail at once meanwhile, each an explicit error).
const (
	peerRefresh   = 100 * time.Millisecond
	peerLoseAfter = 5 * time.Second // as serve's default etcd --lease
)

// NewPeerList resolves peers in the background until ctx ends: each joins
// the registry when its control API first answers with a record that
// carries its name, and is followed from then on.
func NewPeerList(ctx context.Context, peers []Peer, sec Security, log *slog.Logger) *PeerList {
	s, _ := NewStatic()
	l := &PeerList{Static: s, peers: peers, JoinWait: DefaultJoinWait, answered: map[string]bool{}, all: make(chan struct{})}
	names := map[string]bool{}
	for _, p := range peers {
		names[p.Name] = true
	}
	if l.distinct = len(names); l.distinct == 0 {
		close(l.all)
	}
	client := newControlClient(sec)
	for _, p := range peers {
		go l.follow(ctx, client, p, log)
	}
	return l
}

// follow reads p's record until ctx ends, and registers, registers again
// or loses it as it changes.
func (l *PeerList) follow(ctx context.Context, client *controlClient, p Peer, log *slog.Logger) {
	var cur Member // the record registered last (its Name set once the peer has answered)
	joined := false
	var failing time.Time // when the joined peer first failed to answer
	misses := 0           // its failed reads in a row
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		asked := time.Now()
		m, err := l.read(ctx, client, p)
		wait := peerRefresh
		switch {
		case err == nil:
			failing, misses = time.Time{}, 0
			if !joined || m != cur {
				// (A new incarnation is registered as it comes, with no
				// loss first: the router takes the old life's loss itself,
				// deferred while a stop it announced still has requests.)
				l.Static.publish(m) // read by read, which validated it
				cur, joined = m, true
				l.answer(p.Name)
			}
		case joined:
			if failing.IsZero() {
				// From when the failed read began: a peer that hangs
				// fails at the read's timeout (5 s), and is lost then,
				// not 5 s after that.
				failing = asked
			}
			// A stopping peer's end is its stop's: two reads in a row
			// that fail, not one a busy moment failed.
			if misses++; cur.Stopping && misses >= 2 || time.Since(failing) >= peerLoseAfter {
				log.Info("node: peer lost: its control API does not answer", "peer", p.Name, "stopping", cur.Stopping, "err", err)
				l.Static.Remove(p.Name)
				joined = false
			}
		case cur.Name != "":
			// Lost: read again at the refresh, to see its next life soon.
		default:
			log.Debug("node: peer not answering yet", "peer", p.Name, "control", p.Control, "err", err)
			wait = backoff
			backoff = min(2*backoff, 2*time.Second)
		}
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
}

// read reads p's record from its control API: it must carry p's name, and
// the role p's certificate names.
func (l *PeerList) read(ctx context.Context, client *controlClient, p Peer) (Member, error) {
	var m Member
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	err := client.call(cctx, p.Name, p.Control, pathInfo, nil, &m)
	cancel()
	if err != nil {
		return Member{}, err
	}
	if m.Name != p.Name {
		return Member{}, fmt.Errorf("it says it is %q", m.Name)
	}
	if r, ok := client.certRole(p.Name); ok && Role(r) != m.Role {
		// The record is the node's own word; its certificate is the
		// authority's: a node is listed only in the role it is certified for.
		return Member{}, fmt.Errorf("%w: %q says it is a %s node; its certificate is a %s node's", pki.ErrWrongRole, p.Name, m.Role, r)
	}
	m.Control = p.Control
	if err := m.validate(); err != nil {
		return Member{}, err
	}
	return m, nil
}

func (l *PeerList) answer(name string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.answered[name] {
		return
	}
	l.answered[name] = true
	if len(l.answered) == l.distinct {
		close(l.all)
	}
}

// awaitPeers waits until every listed peer has answered or ctx ends, and
// returns the peers that have not.
func (l *PeerList) awaitPeers(ctx context.Context) []Peer {
	select {
	case <-l.all:
		return nil
	case <-ctx.Done():
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var missing []Peer
	for _, p := range l.peers {
		if !l.answered[p.Name] {
			missing = append(missing, p)
		}
	}
	return missing
}

// Register implements Registry: this process's own record stays local.
func (l *PeerList) Register(ctx context.Context, m Member) (<-chan struct{}, error) {
	if err := m.validate(); err != nil {
		return nil, err
	}
	done := make(chan struct{})
	context.AfterFunc(ctx, func() { close(done) })
	return done, nil
}

// rosterWait is how long a roster waits for a name it does not list yet to
// appear in the registry's watch (a prefill node that dials a decode node
// just as it registers, before the decode node's watch has told it).
const rosterWait = 2 * time.Second

// roster is a node's view of its peers' names and roles, from the
// registry's watch: who may be a peer, and in which role (docs/security.md).
// A static peer list's names are listed from the start, their role unknown
// ("") until the peer's record answers; the certificate's role is checked
// against the record's when it does (PeerList), and by every handshake.
//
// It knows each listed node's life too (its record's incarnation; 0 where
// no record answers): a queue pair's hello must name that life, so that
// the life a cut spares (transfer's CutIncarnation) is one the registry
// holds, not only the peer's word.
type roster struct {
	mu      sync.Mutex
	roles   map[string]Role
	lives   map[string]uint64
	changed chan struct{} // closed and replaced at every change
}

// watchRoster follows reg's members until ctx ends.
func watchRoster(ctx context.Context, reg Registry) (*roster, error) {
	r := &roster{roles: map[string]Role{}, lives: map[string]uint64{}, changed: make(chan struct{})}
	listed := map[string]bool{}
	if l, ok := reg.(*PeerList); ok {
		for _, p := range l.peers {
			r.roles[p.Name] = ""
			listed[p.Name] = true
		}
	}
	changes, err := reg.Watch(ctx)
	if err != nil {
		return nil, err
	}
	go func() {
		for c := range changes {
			r.mu.Lock()
			switch c.Kind {
			case Joined:
				r.roles[c.Member.Name] = c.Member.Role
				r.lives[c.Member.Name] = c.Member.Incarnation
			case Lost:
				delete(r.lives, c.Member.Name)
				if listed[c.Member.Name] {
					// A listed peer lost is as at the start: its name
					// admitted, its role unknown until its record answers
					// again. Deleted, two peers that lost each other
					// would each refuse the other's read of its record,
					// which needs the name, for good.
					r.roles[c.Member.Name] = ""
				} else {
					delete(r.roles, c.Member.Name)
				}
			}
			close(r.changed)
			r.changed = make(chan struct{})
			r.mu.Unlock()
		}
	}()
	return r, nil
}

// admit is nil if the registry lists name in role (or lists the name of a
// static peer whose record has yet to answer), as life incarnation where
// the registry knows its life and incarnation is not 0 (the hello's);
// else an error wrapping pki.ErrUnknownPeer. It waits up to rosterWait for
// a name it does not list yet, or for the life it names (a node that dials
// just as it registers, or restarts, before this node's watch has told it).
func (r *roster) admit(name string, role pki.Role, incarnation uint64) error {
	deadline := time.NewTimer(rosterWait)
	defer deadline.Stop()
	for {
		r.mu.Lock()
		got, listed := r.roles[name]
		life := r.lives[name]
		changed := r.changed
		r.mu.Unlock()
		otherLife := incarnation != 0 && life != 0 && life != incarnation
		switch {
		case listed && got != "" && pki.Role(got) != role:
			return fmt.Errorf("%w: %q is listed as %s, not %s", pki.ErrUnknownPeer, name, got, role)
		case listed && !otherLife:
			return nil
		}
		select {
		case <-changed:
		case <-deadline.C:
			if otherLife {
				return fmt.Errorf("%w: %q says it is life %d; the registry lists life %d", pki.ErrUnknownPeer, name, incarnation, life)
			}
			return fmt.Errorf("%w: %q (as %s)", pki.ErrUnknownPeer, name, role)
		}
	}
}

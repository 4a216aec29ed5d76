package node

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"
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
// TLS, once it answers. It never loses a peer: a peer that dies shows as
// failed calls, each an explicit error.
type PeerList struct {
	*Static
}

// NewPeerList resolves peers in the background until ctx ends: each joins
// the registry when its control API first answers with a record that
// carries its name.
func NewPeerList(ctx context.Context, peers []Peer, sec Security, log *slog.Logger) *PeerList {
	s, _ := NewStatic()
	client := newControlClient(sec)
	for _, p := range peers {
		go func() {
			backoff := 50 * time.Millisecond
			for ctx.Err() == nil {
				var m Member
				cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				err := client.call(cctx, p.Name, p.Control, pathInfo, nil, &m)
				cancel()
				if err == nil && m.Name != p.Name {
					err = fmt.Errorf("it says it is %q", m.Name)
				}
				if err == nil {
					m.Control = p.Control
					if err = m.validate(); err == nil {
						s.Register(ctx, m)
						return
					}
				}
				log.Debug("node: peer not answering yet", "peer", p.Name, "control", p.Control, "err", err)
				select {
				case <-ctx.Done():
				case <-time.After(backoff):
				}
				backoff = min(2*backoff, 2*time.Second)
			}
		}()
	}
	return &PeerList{Static: s}
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

package node

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// Role is what a process does in the deployment.
type Role string

// The roles.
const (
	RoleRouter  Role = "router"
	RolePrefill Role = "prefill"
	RoleDecode  Role = "decode"
)

// Member is what a node registers about itself: who it is, where it
// listens, and the limits a router's intake checks. The registry is not
// trusted alone: every node checks each request against its own limits.
type Member struct {
	Name string `json:"name"` // the node's identity: its certificate's DNS name
	Role Role   `json:"role"`
	// Control is the node's control API (host:port; HTTPS with mutual TLS
	// unless the deployment is insecure): the router calls it.
	Control string `json:"control"`
	// Transfer is a decode node's queue-pair setup listener (transfer.Serve);
	// prefill nodes dial it. Empty for other roles.
	Transfer string `json:"transfer,omitempty"`
	// PoolPages and PageTokens are the node's KV pool (PoolPages*PageTokens
	// tokens); PageBytes the bytes of one page.
	PoolPages     int    `json:"pool_pages"`
	PageTokens    int    `json:"page_tokens"`
	PageBytes     int    `json:"page_bytes"`
	ContextTokens int    `json:"context_tokens"` // the longest prompt the node's model takes
	MaxTokens     int    `json:"max_tokens"`     // the node's own intake limit; 0 means its pool
	Model         string `json:"model"`          // model id: a router sends a request only to nodes of its model
	// Incarnation tells the node's lives apart: each start registers a
	// larger one (its start time in nanoseconds), so that a node restarting
	// before its old lease expired is the loss of the old life at the router
	// (protocol.NodeInfo.Incarnation), not an advertisement update.
	Incarnation uint64 `json:"incarnation,omitempty"`
	// Wire is the node's wire version (protocol.Version); 0 for a node
	// older than version 4, which published none: the router tells such a
	// decode node of a loss by name alone (its control API refuses the
	// life's field).
	Wire int `json:"wire,omitempty"`
	// Stopping: the node has begun a graceful stop (it registers its record
	// again so marked before it drains): routers send it no new request,
	// and retry elsewhere those its stop's end fails.
	Stopping bool `json:"stopping,omitempty"`
}

// PoolTokens is the most tokens the node's pool holds.
func (m Member) PoolTokens() int { return m.PoolPages * m.PageTokens }

// nodeInfo is m, a prefill or decode node, as the router's state machine
// knows it, under id.
func (m Member) nodeInfo(id protocol.NodeID) protocol.NodeInfo {
	role := protocol.RolePrefill
	if m.Role == RoleDecode {
		role = protocol.RoleDecode
	}
	return protocol.NodeInfo{ID: id, Role: role, ContextTokens: m.ContextTokens, PoolPages: m.PoolPages,
		PageTokens: m.PageTokens, MaxTokens: m.MaxTokens, Incarnation: m.Incarnation}
}

func (m Member) validate() error {
	switch {
	case m.Name == "":
		return errors.New("node: a member needs a name")
	case m.Role != RoleRouter && m.Role != RolePrefill && m.Role != RoleDecode:
		return fmt.Errorf("node: member %q has role %q", m.Name, m.Role)
	case m.Role != RoleRouter && (m.PoolPages < 1 || m.PageTokens < 1 || m.PageBytes < 1):
		return fmt.Errorf("node: member %q advertises %d pages of %d tokens, %d bytes", m.Name, m.PoolPages, m.PageTokens, m.PageBytes)
	case m.Role == RoleDecode && m.Transfer == "":
		return fmt.Errorf("node: decode member %q has no transfer address", m.Name)
	}
	return nil
}

// ChangeKind says what a Change reports.
type ChangeKind uint8

// The changes a registry reports.
const (
	// Joined: a member appeared, or its record changed.
	Joined ChangeKind = iota + 1
	// Lost: a member's registration ended (its lease expired, or it left):
	// its requests fail on every leg.
	Lost
)

func (k ChangeKind) String() string {
	switch k {
	case Joined:
		return "joined"
	case Lost:
		return "lost"
	}
	return fmt.Sprintf("ChangeKind(%d)", uint8(k))
}

// Change is one event of a registry's watch.
type Change struct {
	Kind   ChangeKind
	Member Member
}

// Registry is how nodes find each other: each node registers itself, and
// the router (and prefill nodes, for the decode nodes to dial) watch.
type Registry interface {
	// Register publishes m and keeps it alive until ctx ends or the
	// registration is lost; the returned channel is closed when it ends.
	Register(ctx context.Context, m Member) (<-chan struct{}, error)
	// Watch reports every member present now as Joined, then every change,
	// until ctx ends (the channel is then closed).
	Watch(ctx context.Context) (<-chan Change, error)
}

// Static is a registry in one process: the members registered into it, or
// given at construction (kvhandoff serve --peers). It never loses a member
// by itself; Remove does, as an expired lease would.
type Static struct {
	mu       sync.Mutex
	members  map[string]Member
	watchers map[chan Change]struct{}
	leases   map[string]chan struct{}
}

// NewStatic is a static registry holding members.
func NewStatic(members ...Member) (*Static, error) {
	s := &Static{members: map[string]Member{}, watchers: map[chan Change]struct{}{}, leases: map[string]chan struct{}{}}
	for _, m := range members {
		if err := m.validate(); err != nil {
			return nil, err
		}
		s.members[m.Name] = m
	}
	return s, nil
}

// watchBuffer bounds what a slow watcher may have pending; a static
// registry's changes are few (one per node start and stop).
const watchBuffer = 1024

// Register implements Registry.
func (s *Static) Register(ctx context.Context, m Member) (<-chan struct{}, error) {
	if err := m.validate(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if old := s.leases[m.Name]; old != nil {
		close(old)
	}
	done := make(chan struct{})
	s.leases[m.Name] = done
	s.members[m.Name] = m
	s.notify(Change{Kind: Joined, Member: m})
	context.AfterFunc(ctx, func() { s.end(m.Name, done) })
	return done, nil
}

// publish registers m with no lease to end it: it stays until Remove or
// the next publish (a PeerList, which follows its peers, publishes each
// record it reads; a lease per record would add a callback on the list's
// context at every change, kept until the process ends).
func (s *Static) publish(m Member) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if old := s.leases[m.Name]; old != nil {
		close(old)
		delete(s.leases, m.Name)
	}
	s.members[m.Name] = m
	s.notify(Change{Kind: Joined, Member: m})
}

func (s *Static) end(name string, done chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.leases[name] != done {
		return
	}
	delete(s.leases, name)
	close(done)
	if m, ok := s.members[name]; ok {
		delete(s.members, name)
		s.notify(Change{Kind: Lost, Member: m})
	}
}

// Remove ends member name's registration, as an expired lease would.
func (s *Static) Remove(name string) {
	s.mu.Lock()
	done := s.leases[name]
	s.mu.Unlock()
	if done != nil {
		s.end(name, done)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if m, ok := s.members[name]; ok {
		delete(s.members, name)
		s.notify(Change{Kind: Lost, Member: m})
	}
}

func (s *Static) notify(c Change) {
	for w := range s.watchers {
		select {
		case w <- c:
		default:
			// A watcher this far behind cannot be told the truth any more:
			// closing its channel makes it stop rather than act on a stale view.
			delete(s.watchers, w)
			close(w)
		}
	}
}

// Watch implements Registry.
func (s *Static) Watch(ctx context.Context) (<-chan Change, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	w := make(chan Change, watchBuffer+len(s.members))
	names := make([]string, 0, len(s.members))
	for n := range s.members {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		w <- Change{Kind: Joined, Member: s.members[n]}
	}
	s.watchers[w] = struct{}{}
	context.AfterFunc(ctx, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if _, ok := s.watchers[w]; ok {
			delete(s.watchers, w)
			close(w)
		}
	})
	return w, nil
}

// Members is every member registered now, by name.
func (s *Static) Members() []Member {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Member
	for _, m := range s.members {
		out = append(out, m)
	}
	slices.SortFunc(out, func(a, b Member) int {
		if a.Name < b.Name {
			return -1
		}
		if a.Name > b.Name {
			return 1
		}
		return 0
	})
	return out
}

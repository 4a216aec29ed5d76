package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Etcd is the registry in an etcd cluster: each node puts its Member as
// JSON under Prefix+name with a lease it keeps alive; watchers see every
// put as Joined and every delete (the lease expired or was revoked, or the
// node left) as Lost.
type Etcd struct {
	cli    *clientv3.Client
	prefix string
	ttl    time.Duration
	log    *slog.Logger
}

// NewEtcd connects to the etcd cluster at endpoints. ttl is the lease a
// node registers under: a node that stops keeping it alive is lost about
// ttl later.
func NewEtcd(endpoints []string, prefix string, ttl time.Duration, log *slog.Logger) (*Etcd, error) {
	if log == nil {
		log = slog.Default()
	}
	if ttl < time.Second {
		return nil, fmt.Errorf("node: an etcd lease of %v; at least 1 s", ttl)
	}
	if !strings.HasSuffix(prefix, "/") {
		prefix += "/"
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		return nil, fmt.Errorf("node: etcd: %w", err)
	}
	return &Etcd{cli: cli, prefix: prefix, ttl: ttl, log: log}, nil
}

// Close closes the client.
func (e *Etcd) Close() error { return e.cli.Close() }

// Register implements Registry: a lease of the registry's TTL, m under it,
// kept alive until ctx ends (the lease is then revoked, so watchers see the
// node leave at once) or the lease is lost.
func (e *Etcd) Register(ctx context.Context, m Member) (<-chan struct{}, error) {
	if err := m.validate(); err != nil {
		return nil, err
	}
	b, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	lease, err := e.cli.Grant(gctx, int64((e.ttl+time.Second-1)/time.Second))
	if err != nil {
		return nil, fmt.Errorf("node: etcd lease: %w", err)
	}
	if _, err := e.cli.Put(gctx, e.prefix+m.Name, string(b), clientv3.WithLease(lease.ID)); err != nil {
		return nil, fmt.Errorf("node: etcd put: %w", err)
	}
	kctx, stopKeep := context.WithCancel(ctx)
	ka, err := e.cli.KeepAlive(kctx, lease.ID)
	if err != nil {
		stopKeep()
		return nil, fmt.Errorf("node: etcd keep-alive: %w", err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer stopKeep()
		for range ka {
		}
		if ctx.Err() != nil {
			rctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			e.cli.Revoke(rctx, lease.ID)
			return
		}
		e.log.Error("node: the etcd lease was lost", "node", m.Name, "lease", fmt.Sprintf("%x", int64(lease.ID)))
	}()
	return done, nil
}

// Watch implements Registry.
func (e *Etcd) Watch(ctx context.Context) (<-chan Change, error) {
	resp, err := e.cli.Get(ctx, e.prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("node: etcd get: %w", err)
	}
	out := make(chan Change, watchBuffer)
	known := map[string]Member{}
	for _, kv := range resp.Kvs {
		if m, err := e.member(kv.Key, kv.Value); err == nil {
			known[m.Name] = m
			out <- Change{Kind: Joined, Member: m}
		}
	}
	wch := e.cli.Watch(clientv3.WithRequireLeader(ctx), e.prefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	go func() {
		defer close(out)
		for wr := range wch {
			if err := wr.Err(); err != nil {
				e.log.Error("node: etcd watch", "err", err)
				return
			}
			for _, ev := range wr.Events {
				name := strings.TrimPrefix(string(ev.Kv.Key), e.prefix)
				var c Change
				switch ev.Type {
				case clientv3.EventTypePut:
					m, err := e.member(ev.Kv.Key, ev.Kv.Value)
					if err != nil {
						e.log.Warn("node: a registry record refused", "key", string(ev.Kv.Key), "err", err)
						continue
					}
					known[name] = m
					c = Change{Kind: Joined, Member: m}
				case clientv3.EventTypeDelete:
					m, ok := known[name]
					if !ok {
						continue
					}
					delete(known, name)
					c = Change{Kind: Lost, Member: m}
				}
				select {
				case out <- c:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return out, nil
}

func (e *Etcd) member(key, value []byte) (Member, error) {
	var m Member
	if err := json.Unmarshal(value, &m); err != nil {
		return m, err
	}
	if name := strings.TrimPrefix(string(key), e.prefix); m.Name != name {
		return m, errors.New("node: the record's name is not its key's")
	}
	return m, m.validate()
}

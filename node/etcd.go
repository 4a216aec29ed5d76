package node

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
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
	// beforeCommit, set only by tests, runs in RegisterChecked between the
	// check and the transaction that depends on it.
	beforeCommit func()
	// watchHook, set only by tests, replaces the etcd watch Watch starts
	// (to break one).
	watchHook func(ctx context.Context, rev int64) clientv3.WatchChan
}

// NewEtcd connects to the etcd cluster at endpoints in plaintext. ttl is
// the lease a node registers under: a node that stops keeping it alive is
// lost about ttl later.
func NewEtcd(endpoints []string, prefix string, ttl time.Duration, log *slog.Logger) (*Etcd, error) {
	return NewEtcdConfig(EtcdConfig{Endpoints: endpoints, Prefix: prefix, TTL: ttl, Log: log})
}

// EtcdConfig is how a node reaches the etcd cluster.
type EtcdConfig struct {
	Endpoints []string
	Prefix    string
	TTL       time.Duration // the lease a node registers under
	// TLS, if set, is the client's TLS (EtcdTLS): the cluster's authority,
	// and the client certificate a cluster with client-cert-auth requires.
	TLS *tls.Config
	Log *slog.Logger
}

// NewEtcdConfig connects to the etcd cluster cfg names.
func NewEtcdConfig(cfg EtcdConfig) (*Etcd, error) {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.TTL < time.Second {
		return nil, fmt.Errorf("node: an etcd lease of %v; at least 1 s", cfg.TTL)
	}
	if !strings.HasSuffix(cfg.Prefix, "/") {
		cfg.Prefix += "/"
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: cfg.Endpoints, DialTimeout: 5 * time.Second, TLS: cfg.TLS, Logger: zap.NewNop()})
	if err != nil {
		return nil, fmt.Errorf("node: etcd: %w", err)
	}
	return &Etcd{cli: cli, prefix: cfg.Prefix, ttl: cfg.TTL, log: cfg.Log}, nil
}

// EtcdTLS is an etcd client's TLS from the files etcdctl names --cacert,
// --cert and --key: the authority that signed the cluster's certificates
// (required), and a client certificate and its key (both or neither).
func EtcdTLS(caFile, certFile, keyFile string) (*tls.Config, error) {
	if caFile == "" {
		return nil, errors.New("node: etcd TLS needs the cluster's authority (--etcd-cacert)")
	}
	if (certFile == "") != (keyFile == "") {
		return nil, errors.New("node: etcd TLS: a client certificate needs its key, and a key its certificate (--etcd-cert, --etcd-key)")
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("node: etcd TLS: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("node: etcd TLS: %s holds no PEM certificate", caFile)
	}
	cfg := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("node: etcd TLS: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// Close closes the client.
func (e *Etcd) Close() error { return e.cli.Close() }

// Register implements Registry: a lease of the registry's TTL, m under it,
// kept alive until ctx ends (the lease is then revoked, so watchers see the
// node leave at once) or the lease is lost.
func (e *Etcd) Register(ctx context.Context, m Member) (<-chan struct{}, error) {
	return e.RegisterChecked(ctx, m, nil)
}

// maxJoinAttempts bounds RegisterChecked's retries: each one failed because
// another record under the prefix was put between the read and the commit,
// so this many in a row means the registry is changing faster than a node
// can join it.
const maxJoinAttempts = 16

// ErrJoinContended is RegisterChecked giving up: the registry changed
// between every read and the put that depended on it.
var ErrJoinContended = errors.New("node: the registry kept changing while joining")

// RegisterChecked is Register, but the record is put only if check, run on
// the members the registry holds, returns nil, and only if no record under
// the prefix was put (joined or changed) between that read and the put: one
// etcd transaction compares every key's modification revision with the
// read's revision and puts m only if none is newer. If one is, the read and
// the check run again on what is there now. So of two nodes that would
// conflict, joining at once, the second to commit sees the first: at most
// one joins. (A record deleted meanwhile does not abort the put: a member
// leaving can only take problems away from the deployment.) check's error
// is returned as it is, and nothing is left registered. A nil check puts m
// unconditionally.
func (e *Etcd) RegisterChecked(ctx context.Context, m Member, check func(held []Member) error) (<-chan struct{}, error) {
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
	put := clientv3.OpPut(e.prefix+m.Name, string(b), clientv3.WithLease(lease.ID))
	if err := e.commit(gctx, put, check); err != nil {
		rctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		e.cli.Revoke(rctx, lease.ID) // the lease holds nothing; do not leave it to expire
		return nil, err
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

// commit runs put: at once without a check, else read, check, and put in a
// transaction that holds only if nothing under the prefix was put since the
// read, retried on conflict.
func (e *Etcd) commit(ctx context.Context, put clientv3.Op, check func([]Member) error) error {
	if check == nil {
		if _, err := e.cli.Do(ctx, put); err != nil {
			return fmt.Errorf("node: etcd put: %w", err)
		}
		return nil
	}
	for range maxJoinAttempts {
		resp, err := e.cli.Get(ctx, e.prefix, clientv3.WithPrefix())
		if err != nil {
			return fmt.Errorf("node: reading the registry before joining: %w", err)
		}
		var held []Member
		for _, kv := range resp.Kvs {
			if m, err := e.member(kv.Key, kv.Value); err == nil {
				held = append(held, m)
			}
		}
		if err := check(held); err != nil {
			return err
		}
		if e.beforeCommit != nil {
			e.beforeCommit()
		}
		unchanged := clientv3.Compare(clientv3.ModRevision(e.prefix).WithPrefix(), "<", resp.Header.Revision+1)
		txn, err := e.cli.Txn(ctx).If(unchanged).Then(put).Commit()
		if err != nil {
			return fmt.Errorf("node: etcd put: %w", err)
		}
		if txn.Succeeded {
			return nil
		}
		e.log.Info("node: the registry changed while joining; checking again", "key", string(put.KeyBytes()))
	}
	return fmt.Errorf("%w: %d attempts", ErrJoinContended, maxJoinAttempts)
}

// Watch implements Registry. A watch that breaks (the cluster lost its
// leader, the revision it resumes from was compacted) is not the end of the
// registry's news: Watch lists the registry again, reports what changed
// meanwhile (a member gone as Lost, a new or changed one as Joined), and
// watches on from there, until ctx ends. A node whose watch ended for good
// would never dial a decode node that joined afterwards.
func (e *Etcd) Watch(ctx context.Context) (<-chan Change, error) {
	out := make(chan Change, watchBuffer)
	known := map[string]Member{}
	rev, err := e.relist(ctx, known, out)
	if err != nil {
		return nil, err
	}
	go func() {
		defer close(out)
		backoff := 50 * time.Millisecond
		for {
			err := e.forward(ctx, e.watch(ctx, rev), known, out, &rev)
			if ctx.Err() != nil {
				return
			}
			e.log.Warn("node: the etcd watch broke; listing the registry again", "err", err, "retry_in", backoff)
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			r, err := e.relist(ctx, known, out)
			if err != nil {
				backoff = min(2*backoff, 2*time.Second)
				continue
			}
			rev, backoff = r, 50*time.Millisecond
		}
	}()
	return out, nil
}

// watch starts a watch of the registry from revision rev (a field only tests
// replace, to break a watch).
func (e *Etcd) watch(ctx context.Context, rev int64) clientv3.WatchChan {
	if e.watchHook != nil {
		return e.watchHook(ctx, rev)
	}
	return e.cli.Watch(clientv3.WithRequireLeader(ctx), e.prefix, clientv3.WithPrefix(), clientv3.WithRev(rev))
}

// relist reads the registry and reports the differences from known (which
// it updates) on out: Joined for a member new or changed, Lost for one
// gone. It returns the revision to watch from.
func (e *Etcd) relist(ctx context.Context, known map[string]Member, out chan<- Change) (int64, error) {
	resp, err := e.cli.Get(ctx, e.prefix, clientv3.WithPrefix())
	if err != nil {
		return 0, fmt.Errorf("node: etcd get: %w", err)
	}
	now := map[string]Member{}
	for _, kv := range resp.Kvs {
		if m, err := e.member(kv.Key, kv.Value); err == nil {
			now[m.Name] = m
		}
	}
	var changes []Change
	for name, m := range known {
		if _, ok := now[name]; !ok {
			changes = append(changes, Change{Kind: Lost, Member: m})
			delete(known, name)
		}
	}
	for _, kv := range resp.Kvs { // in key order: the listing's
		name := strings.TrimPrefix(string(kv.Key), e.prefix)
		m, ok := now[name]
		if !ok {
			continue
		}
		if old, seen := known[name]; !seen || old != m {
			changes = append(changes, Change{Kind: Joined, Member: m})
			known[name] = m
		}
	}
	for _, c := range changes {
		select {
		case out <- c:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	return resp.Header.Revision + 1, nil
}

// forward reports the events of wch on out, keeping known and the revision
// to resume from up to date, until the watch breaks (its error) or ctx ends.
func (e *Etcd) forward(ctx context.Context, wch clientv3.WatchChan, known map[string]Member, out chan<- Change, rev *int64) error {
	for wr := range wch {
		if err := wr.Err(); err != nil {
			return err
		}
		for _, ev := range wr.Events {
			*rev = ev.Kv.ModRevision + 1
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
				return ctx.Err()
			}
		}
	}
	return errors.New("node: the etcd watch channel closed")
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

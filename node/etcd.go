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

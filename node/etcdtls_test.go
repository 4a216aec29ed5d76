package node

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/etcdtest"
	"github.com/kvhandoff/kvhandoff/internal/pki"
)

// Against an etcd that serves TLS and requires client certificates, a
// registry with the cluster's authority and a client certificate
// (EtcdTLS: serve's --etcd-cacert, --etcd-cert, --etcd-key) registers and
// watches; one without a client certificate, or trusting another
// authority, gets nothing from it.
func TestEtcdOverTLSWithClientCertificates(t *testing.T) {
	dir := t.TempDir()
	ca, err := pki.NewCA("etcd-ca")
	if err != nil {
		t.Fatal(err)
	}
	if err := ca.WriteFiles(dir, false, "localhost:router", "router"); err != nil { // etcd's server certificate: the role is only what the authority requires
		t.Fatal(err)
	}
	other := t.TempDir()
	ca2, err := pki.NewCA("another-ca")
	if err != nil {
		t.Fatal(err)
	}
	if err := ca2.WriteFiles(other, false, "router"); err != nil {
		t.Fatal(err)
	}
	f := func(d, name string) string { return filepath.Join(d, name) }
	addr := etcdtest.StartTLS(t, f(dir, pki.CAFile), f(dir, pki.CertFile("localhost")), f(dir, pki.KeyFile("localhost")))

	open := func(ca, cert, key string) *Etcd {
		tc, err := EtcdTLS(ca, cert, key)
		if err != nil {
			t.Fatal(err)
		}
		reg, err := NewEtcdConfig(EtcdConfig{Endpoints: []string{addr}, Prefix: "/tls/nodes", TTL: 2 * time.Second, TLS: tc, Log: quietLog()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { reg.Close() })
		return reg
	}
	reg := open(f(dir, pki.CAFile), f(dir, pki.CertFile("router")), f(dir, pki.KeyFile("router")))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	changes, err := reg.Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	m := Member{Name: "decode-0", Role: RoleDecode, Control: "127.0.0.1:1", Transfer: "127.0.0.1:2", PoolPages: 8, PageTokens: 16, PageBytes: 4096, Model: "m", Incarnation: 1}
	if _, err := reg.Register(ctx, m); err != nil {
		t.Fatal(err)
	}
	select {
	case ch := <-changes:
		if ch.Kind != Joined || ch.Member.Name != "decode-0" {
			t.Fatalf("watch: %+v", ch)
		}
	case <-ctx.Done():
		t.Fatal("the registration never showed in the watch")
	}

	intruder := Member{Name: "intruder", Role: RolePrefill, Control: "127.0.0.1:1", PoolPages: 8, PageTokens: 16, PageBytes: 4096, Model: "m", Incarnation: 1}
	for what, reg := range map[string]*Etcd{
		"no client certificate":    open(f(dir, pki.CAFile), "", ""),
		"another client authority": open(f(dir, pki.CAFile), f(other, pki.CertFile("router")), f(other, pki.KeyFile("router"))),
		"another server authority": open(f(other, pki.CAFile), f(dir, pki.CertFile("router")), f(dir, pki.KeyFile("router"))),
	} {
		short, stop := context.WithTimeout(context.Background(), 3*time.Second)
		_, err := reg.Register(short, intruder)
		stop()
		if err == nil {
			t.Fatalf("%s: registered", what)
		}
	}
	// The same record is one the cluster takes from a client it trusts.
	if _, err := reg.Register(ctx, intruder); err != nil {
		t.Fatalf("the trusted client: %v", err)
	}
	if _, err := EtcdTLS("", f(dir, pki.CertFile("router")), ""); err == nil {
		t.Fatal("EtcdTLS without an authority")
	}
	if _, err := EtcdTLS(f(dir, pki.CAFile), f(dir, pki.CertFile("router")), ""); err == nil {
		t.Fatal("EtcdTLS with a certificate and no key")
	}
}

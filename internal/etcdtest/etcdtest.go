// Package etcdtest starts a real, embedded etcd server on 127.0.0.1 for a
// test: one implementation for every package whose tests need a cluster
// registry. Only test files import it, so no binary links the etcd server.
package etcdtest

import (
	"net"
	"net/url"
	"testing"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// Start starts an etcd server for t, stopped when t ends, and returns its
// client address.
func Start(t testing.TB) string {
	t.Helper()
	cfg := embed.NewConfig()
	cfg.Dir = t.TempDir()
	cfg.Name = "test"
	u, _ := url.Parse("http://127.0.0.1:0")
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*u}, []url.URL{*u}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*u}, []url.URL{*u}
	cfg.InitialCluster = cfg.Name + "=" + u.String()
	e := run(t, cfg)
	return e.Clients[0].Addr().String()
}

// StartTLS starts an etcd server for t that serves its clients over TLS and
// requires a client certificate signed by the authority in caFile; its
// certificate (certFile, keyFile) must name "localhost", the host of the
// client address it returns (localhost:port).
func StartTLS(t testing.TB, caFile, certFile, keyFile string) string {
	t.Helper()
	cfg := embed.NewConfig()
	cfg.Dir = t.TempDir()
	cfg.Name = "test"
	client, _ := url.Parse("https://127.0.0.1:0")
	peer, _ := url.Parse("http://127.0.0.1:0")
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*client}, []url.URL{*client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*peer}, []url.URL{*peer}
	cfg.InitialCluster = cfg.Name + "=" + peer.String()
	cfg.ClientTLSInfo = transport.TLSInfo{CertFile: certFile, KeyFile: keyFile, TrustedCAFile: caFile, ClientCertAuth: true}
	e := run(t, cfg)
	_, port, _ := net.SplitHostPort(e.Clients[0].Addr().String())
	return net.JoinHostPort("localhost", port)
}

// run starts the configured server for t, quiet, and waits until it serves.
func run(t testing.TB, cfg *embed.Config) *embed.Etcd {
	t.Helper()
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(30 * time.Second):
		t.Fatal("etcd did not start")
	}
	return e
}

//go:build verbs

package main

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/rdma/verbs"
)

// The serve topology over real verbs: one router, two prefill and two
// decode serve processes, every queue pair on one RDMA device
// (KVH_VERBS_DEVICE, default the first; the Soft-RoCE VM's rxe0), the
// control connections on loopback with mutual TLS, registered through a real
// etcd. 200 requests of 1 to 50 pages from concurrent clients are each
// verified end to end (the answer is the digest of its own request's KV, as
// it reached decode over the device); each node logged that it opened the
// verbs device; every decode node's pages are all free again afterwards; and
// SIGTERM stops every process cleanly. Without a device the test skips,
// unless KVH_VERBS_REQUIRED is set (the VM sets it).
//
// With KVH_VERBS_TRACE=PREFIX every process writes its protocol events to
// PREFIX.NAME (serve --trace), for kvhandoff trace check (the VM runs it
// after this test, docs/trace.md).
func TestServeProcessesOverVerbsAnswerVerifiedRequests(t *testing.T) {
	traces := os.Getenv("KVH_VERBS_TRACE")
	device := os.Getenv("KVH_VERBS_DEVICE")
	d, err := verbs.Open(device)
	if err != nil {
		if os.Getenv("KVH_VERBS_REQUIRED") != "" {
			t.Fatalf("KVH_VERBS_REQUIRED is set but no verbs device opens: %v", err)
		}
		t.Skipf("no verbs device: %v", err)
	}
	device = d.Name()
	d.Close()

	etcd := startEtcd(t)
	dir := t.TempDir()
	names := []string{"router", "prefill-0", "prefill-1", "decode-0", "decode-1"}
	ca, err := pki.NewCA("test")
	if err != nil {
		t.Fatal(err)
	}
	if err := ca.WriteFiles(dir, false, names...); err != nil {
		t.Fatal(err)
	}
	if err := pki.WriteTicketKey(dir); err != nil { // the router's tickets, beside ca.pem
		t.Fatal(err)
	}
	// Generous timeouts: under software emulation (TCG) every step is slow.
	common := func(name string) []string {
		args := []string{"--etcd", etcd, "--lease", "10s", "--timeout", "60s", "--grace", "10s", "--model", "none",
			"--tls-cert", filepath.Join(dir, pki.CertFile(name)), "--tls-key", filepath.Join(dir, pki.KeyFile(name)), "--tls-ca", filepath.Join(dir, pki.CAFile)}
		if traces != "" {
			args = append(args, "--trace", traces+"."+name)
		}
		return args
	}
	pool := []string{"--pool-pages", strconv.Itoa(servePool), "--page-tokens", strconv.Itoa(servePageTokens), "--page-bytes", strconv.Itoa(servePageBytes),
		"--provider", "verbs", "--rdma", device}
	procs := map[string]*proc{}
	metrics := map[string]string{}
	for _, n := range names[1:] {
		procs[n] = startServe(t, n, append(append(common(n), pool...), "--role", strings.TrimRight(n, "-01"), "--metrics", "127.0.0.1:0")...)
		metrics[n] = procs[n].addr(t, "serve: metrics")
	}
	procs["router"] = startServe(t, "router", append(common("router"), "--role", "router", "--listen", "127.0.0.1:0")...)
	api := procs["router"].addr(t, "serve: router client API")
	waitFor(t, "the router to know four nodes and the verbs queue pairs to come up", 120*time.Second, func() bool {
		m, err := scrape(api)
		if err != nil || m[`kvhandoff_nodes{role="prefill"}`] != 2 || m[`kvhandoff_nodes{role="decode"}`] != 2 {
			return false
		}
		for _, d := range []string{"decode-0", "decode-1"} {
			if m, err := scrape(metrics[d]); err != nil || m[`kvhandoff_queue_pairs{role="decode",state="live"}`] != 2 {
				return false
			}
		}
		return true
	})
	for _, n := range names[1:] {
		if !strings.Contains(procs[n].logText(), `"msg":"serve: verbs device","device":"`+device+`"`) {
			t.Fatalf("%s did not log that it opened verbs device %s:\n%s", n, device, procs[n].logText())
		}
	}

	client := &http.Client{Timeout: 120 * time.Second}
	const requests = 200
	var wg sync.WaitGroup
	errs := make(chan error, requests)
	next := make(chan int, requests)
	for i := range requests {
		next <- i
	}
	close(next)
	for range 8 {
		wg.Go(func() {
			for i := range next {
				tokens := 2 + (i*131)%800 // BOS and at least one byte
				s, err := post(client, api, tokens)
				switch {
				case err != nil:
					errs <- fmt.Errorf("request %d: %v", i, err)
				case s.code != 200 || !verified(s, tokens):
					errs <- fmt.Errorf("request %d (%d tokens): %d %s", i, tokens, s.code, s.body)
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		t.FailNow()
	}
	// Both prefill nodes carried some of them, over the device.
	for _, n := range []string{"prefill-0", "prefill-1"} {
		m, err := scrape(metrics[n])
		if err != nil || m[`kvhandoff_handoffs_total{outcome="success",role="prefill"}`] == 0 {
			t.Errorf("%s handed off nothing (%v)", n, err)
		}
	}
	for _, d := range []string{"decode-0", "decode-1"} {
		waitFor(t, d+"'s pages to be free again", 30*time.Second, func() bool {
			m, err := scrape(metrics[d])
			return err == nil && m[`kvhandoff_pages{role="decode",state="free"}`] == servePool
		})
	}
	t.Logf("%d requests verified end to end over verbs device %s", requests, device)

	for _, n := range names {
		procs[n].cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, n := range names {
		select {
		case err := <-procs[n].done:
			if err != nil || !strings.Contains(procs[n].logText(), "serve: stopped cleanly") {
				t.Errorf("%s after SIGTERM: %v\n%s", n, err, procs[n].logText())
			}
		case <-time.After(60 * time.Second):
			t.Errorf("%s did not stop after SIGTERM", n)
		}
	}
}

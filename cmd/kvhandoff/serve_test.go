package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/etcdtest"
	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/node"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

func startEtcd(t *testing.T) string { return etcdtest.Start(t) }

// proc is a kvhandoff serve child process (this test binary standing in).
type proc struct {
	name string
	cmd  *exec.Cmd
	mu   sync.Mutex
	log  bytes.Buffer
	// addrs are the addresses its log announced, by message.
	addrs chan [2]string
	done  chan error
}

func startServe(t *testing.T, name string, args ...string) *proc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, append([]string{"serve", "--log-format", "json"}, args...)...)
	cmd.Env = append(os.Environ(), "KVH_TEST_AS_KVHANDOFF=1")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{name: name, cmd: cmd, addrs: make(chan [2]string, 8), done: make(chan error, 1)}
	scanned := make(chan struct{})
	go func() {
		defer close(scanned)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Bytes()
			p.mu.Lock()
			p.log.Write(line)
			p.log.WriteByte('\n')
			p.mu.Unlock()
			var rec struct {
				Msg  string `json:"msg"`
				Addr string `json:"addr"`
			}
			if json.Unmarshal(line, &rec) == nil && rec.Addr != "" {
				select {
				case p.addrs <- [2]string{rec.Msg, rec.Addr}:
				default:
				}
			}
		}
	}()
	go func() {
		<-scanned
		p.done <- cmd.Wait()
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
		}
	})
	return p
}

func (p *proc) addr(t *testing.T, msg string) string {
	t.Helper()
	for {
		select {
		case a := <-p.addrs:
			if a[0] == msg {
				return a[1]
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%s never logged %q:\n%s", p.name, msg, p.logText())
		}
	}
}

func (p *proc) logText() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.log.String()
}

// scrape reads a Prometheus text exposition into "name{labels}" -> value.
func scrape(addr string) (map[string]float64, error) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err == nil {
			out[line[:i]] = v
		}
	}
	return out, sc.Err()
}

func waitFor(t *testing.T, what string, timeout time.Duration, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

const (
	servePageTokens = 16
	servePageBytes  = 4096
	servePool       = 512
	serveMaxTokens  = 8
)

type served struct {
	code int
	body string
	id   uint64
	text string
}

func post(client *http.Client, api string, tokens int) (served, error) {
	// tokens counts BOS, which the router puts before the text.
	body, _ := json.Marshal(map[string]any{"prompt": strings.Repeat("p", tokens-1), "max_tokens": serveMaxTokens})
	resp, err := client.Post("http://"+api+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return served{}, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	s := served{code: resp.StatusCode, body: string(b)}
	var out struct {
		ID      string `json:"id"`
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	if json.Unmarshal(b, &out) == nil && len(out.Choices) == 1 {
		s.id, _ = strconv.ParseUint(strings.TrimPrefix(out.ID, "cmpl-"), 16, 64)
		s.text = out.Choices[0].Text
	}
	return s, nil
}

// verified says a 200's text is the digest of its own request's KV, as the
// decode node of a model-less deployment answers.
func verified(s served, tokens int) bool {
	h := sha256.New()
	page := make([]byte, servePageBytes)
	for i := range protocol.PagesFor(uint32(tokens), servePageTokens) {
		transfer.GenerateKV(protocol.RequestID(s.id), i, servePageTokens, page)
		h.Write(page)
	}
	sum := h.Sum(nil)
	toks := make([]int, serveMaxTokens)
	for i := range toks {
		toks[i] = int(sum[i%len(sum)])
	}
	wj, _ := json.Marshal(llama.Decode(llama.Bytes{}, toks, 'p'))
	var want string
	json.Unmarshal(wj, &want)
	return s.text == want
}

// One router, two prefill and two decode serve processes over the socket
// provider on loopback, registered through a real etcd: 500 requests from
// concurrent clients verified end to end; then one prefill process is
// SIGKILLed mid-transfer: every request ends (an explicit error or a
// verified answer, none past its timeout), the decode nodes' pages all come
// back after the cut, and new requests flow through the survivors. Then
// SIGTERM stops every process cleanly.
func TestServeProcessesSurviveAPrefillKill(t *testing.T) {
	if testing.Short() {
		t.Skip("starts five processes and an etcd; run without -short")
	}
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
	common := func(name string) []string {
		return []string{"--etcd", etcd, "--lease", "2s", "--timeout", "10s", "--grace", "5s", "--model", "none",
			"--tls-cert", filepath.Join(dir, pki.CertFile(name)), "--tls-key", filepath.Join(dir, pki.KeyFile(name)), "--tls-ca", filepath.Join(dir, pki.CAFile)}
	}
	pool := []string{"--pool-pages", strconv.Itoa(servePool), "--page-tokens", strconv.Itoa(servePageTokens), "--page-bytes", strconv.Itoa(servePageBytes)}
	procs := map[string]*proc{}
	metrics := map[string]string{}
	for _, n := range names[1:] {
		procs[n] = startServe(t, n, append(append(common(n), pool...), "--role", strings.TrimRight(n, "-01"), "--metrics", "127.0.0.1:0")...)
		metrics[n] = procs[n].addr(t, "serve: metrics")
	}
	procs["router"] = startServe(t, "router", append(common("router"), "--role", "router", "--listen", "127.0.0.1:0")...)
	api := procs["router"].addr(t, "serve: router client API")
	metrics["router"] = api
	waitFor(t, "the router to know four nodes and the queue pairs to come up", 30*time.Second, func() bool {
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
	client := &http.Client{Timeout: 20 * time.Second} // past the router's 10 s: a hang is a client error here

	// 500 requests, 16 clients, 1 to 50 pages each.
	var wg sync.WaitGroup
	errs := make(chan error, 500)
	next := make(chan int, 500)
	for i := range 500 {
		next <- i
	}
	close(next)
	for range 16 {
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

	// Load on both prefill nodes, then SIGKILL prefill-0 in the middle of it.
	stop := make(chan struct{})
	type outcome struct {
		s      served
		tokens int
		err    error
		took   time.Duration
	}
	outcomes := make(chan outcome, 100000)
	var load sync.WaitGroup
	for c := range 16 {
		load.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				tokens := 400 + (c*97+i*131)%1600 // 25 to 125 pages
				start := time.Now()
				s, err := post(client, api, tokens)
				outcomes <- outcome{s, tokens, err, time.Since(start)}
			}
		})
	}
	waitFor(t, "transfers through prefill-0", 20*time.Second, func() bool {
		m, err := scrape(metrics["prefill-0"])
		return err == nil && m[`kvhandoff_handoffs_total{outcome="success",role="prefill"}`] > 60
	})
	if err := procs["prefill-0"].cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-procs["prefill-0"].done
	killed := time.Now()
	waitFor(t, "the router to lose prefill-0 (its lease)", 15*time.Second, func() bool {
		m, err := scrape(api)
		return err == nil && m[`kvhandoff_nodes{role="prefill"}`] == 1
	})
	time.Sleep(500 * time.Millisecond) // requests that start after the loss, on the survivor
	close(stop)
	load.Wait()
	close(outcomes)
	var ok, failed, failedOnKilled int
	for o := range outcomes {
		switch {
		case o.err != nil:
			t.Errorf("a request did not end with an answer (hang or broken connection) after %v: %v", o.took, o.err)
		case o.s.code == 200:
			if !verified(o.s, o.tokens) {
				t.Errorf("a 200 whose text is not its own KV's digest: %s", o.s.body)
			}
			ok++
		case o.s.code == 503 && strings.Contains(o.s.body, "handoff_failed"):
			failed++
			if strings.Contains(o.s.body, "prefill-0") {
				failedOnKilled++
			}
		default:
			t.Errorf("an answer neither verified nor an explicit handoff failure: %d %s", o.s.code, o.s.body)
		}
	}
	t.Logf("around the kill: %d verified, %d failed explicitly (%d naming prefill-0); the router lost prefill-0 %v after the kill", ok, failed, failedOnKilled, time.Since(killed).Round(time.Millisecond))
	if failedOnKilled == 0 {
		t.Error("no request on prefill-0 failed: the kill did not land mid-transfer")
	}
	// The decode nodes' pages all come back: the quarantined ones once the
	// queue pair to the dead node is cut.
	for _, d := range []string{"decode-0", "decode-1"} {
		waitFor(t, d+"'s pages to come back", 20*time.Second, func() bool {
			m, err := scrape(metrics[d])
			return err == nil && m[`kvhandoff_pages{role="decode",state="free"}`] == servePool &&
				m[`kvhandoff_queue_pairs{role="decode",state="live"}`] == 1 && m[`kvhandoff_queue_pairs{role="decode",state="draining"}`] == 0
		})
	}
	// New requests flow through the survivors.
	for i := range 40 {
		tokens := 2 + i*37
		s, err := post(client, api, tokens)
		if err != nil || s.code != 200 || !verified(s, tokens) {
			t.Fatalf("after the kill, request %d: %+v %v", i, s, err)
		}
	}
	// The metrics families a scrape of every process shows.
	for name, addr := range metrics {
		m, err := scrape(addr)
		if err != nil {
			continue // prefill-0 is dead
		}
		var fams []string
		for _, f := range []string{"kvhandoff_handoffs_total", "kvhandoff_handoff_failures_total", "kvhandoff_handoff_duration_seconds_bucket"} {
			found := false
			for k := range m {
				found = found || strings.HasPrefix(k, f+"{")
			}
			if !found {
				fams = append(fams, f)
			}
		}
		if name != "router" {
			for _, f := range []string{`kvhandoff_pages{`, `kvhandoff_queue_pairs{`, `kvhandoff_credits{`, `kvhandoff_transfer_bytes_total{`} {
				found := false
				for k := range m {
					found = found || strings.HasPrefix(k, f)
				}
				if !found {
					fams = append(fams, f)
				}
			}
		}
		if len(fams) > 0 {
			t.Errorf("%s's /metrics lacks %v", name, fams)
		}
	}
	// SIGTERM: each survivor stops cleanly.
	for _, n := range []string{"router", "prefill-1", "decode-0", "decode-1"} {
		procs[n].cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, n := range []string{"router", "prefill-1", "decode-0", "decode-1"} {
		select {
		case err := <-procs[n].done:
			if err != nil || !strings.Contains(procs[n].logText(), "serve: stopped cleanly") {
				t.Errorf("%s after SIGTERM: %v\n%s", n, err, procs[n].logText())
			}
		case <-time.After(30 * time.Second):
			t.Errorf("%s did not stop after SIGTERM", n)
		}
	}
}

// kvhandoff serve checks the registry before it joins: a prefill node whose
// page size differs from a registered decode node's exits 1 naming the
// mismatch and leaves no record; so does one whose pool is smaller than the
// context it advertises.
func TestServeRefusesToJoinADeploymentItWouldBreak(t *testing.T) {
	etcd := startEtcd(t)
	reg, err := node.NewEtcd([]string{etcd}, "/kvhandoff/nodes/", 2*time.Second, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Close()
	regCtx, deregister := context.WithCancel(context.Background())
	defer deregister()
	if _, err := reg.Register(regCtx, node.Member{Name: "decode-0", Role: node.RoleDecode, Control: "127.0.0.1:1", Transfer: "127.0.0.1:2",
		PoolPages: 64, PageTokens: 16, PageBytes: 4096, ContextTokens: 512, Model: "kvhandoff-generated"}); err != nil {
		t.Fatal(err)
	}
	args := func(extra ...string) []string {
		return append([]string{"serve", "--role", "prefill", "--name", "prefill-0", "--insecure", "--etcd", etcd, "--lease", "2s",
			"--model", "none", "--pool-pages", "64", "--context-tokens", "512", "--log-level", "error"}, extra...)
	}
	var out, errb bytes.Buffer
	if rc := run(args("--page-tokens", "32"), &out, &errb); rc != 1 {
		t.Fatalf("serve with another page size: exit %d, want 1; stderr: %s", rc, errb.String())
	}
	if msg := errb.String(); !strings.Contains(msg, "refusing to join") || !strings.Contains(msg, "page size differs: decode-0 has pages of 16 tokens") {
		t.Fatalf("the refusal does not name the mismatch: %s", msg)
	}
	members, err := node.Registered(context.Background(), reg)
	if err != nil || len(members) != 1 || members[0].Name != "decode-0" {
		t.Fatalf("after the refusal the registry holds %+v (%v), want decode-0 alone", members, err)
	}
	errb.Reset()
	if rc := run(args("--pool-pages", "16"), &out, &errb); rc != 1 || !strings.Contains(errb.String(), "prefill pool of prefill-0 holds 256 tokens, fewer than the context length of 512") {
		t.Fatalf("serve with a short pool: exit %d, want 1 naming the short pool; stderr: %s", rc, errb.String())
	}
}

// The per-scope cap is a decode node's, with its prefix cache: a negative
// cap, or one without --prefix-cache or on another role, is bad usage.
func TestServeRefusesAScopeCapWithoutAPrefixCache(t *testing.T) {
	for _, args := range [][]string{
		{"--role", "decode", "--prefix-cache-scope-pages", "8"},
		{"--role", "decode", "--prefix-cache", "--prefix-cache-scope-pages", "-1"},
		{"--role", "prefill", "--prefix-cache", "--prefix-cache-scope-pages", "8"},
	} {
		var out, errb bytes.Buffer
		if rc := run(append([]string{"serve", "--insecure"}, args...), &out, &errb); rc != 2 || !strings.Contains(errb.String(), "--prefix-cache-scope-pages") {
			t.Errorf("serve %v: exit %d, want 2 naming the flag; stderr: %s", args, rc, errb.String())
		}
	}
}

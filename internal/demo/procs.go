package demo

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Procs is the deployment as separate kvhandoff serve processes on
// loopback, over the socket provider, with mutual TLS from kvhandoff certs:
// what an operator runs, started by the demo.
type Procs struct {
	bin, dir string
	d        Deployment
	api      string
	client   *http.Client
	logs     io.Writer

	mu      sync.Mutex
	procs   map[string]*proc
	args    map[string][]string
	metrics map[string]string // node -> its /metrics address
}

// StartProcs starts d as processes of bin (the kvhandoff binary) in dir;
// the nodes' logs go to logs. With etcd (host:port,... of a running
// cluster) the nodes register there, under a prefix of this run's own,
// instead of finding each other through static --peers. Research switches
// are not available across processes (serve takes none).
func StartProcs(bin, dir string, d Deployment, etcd string, logs io.Writer) (*Procs, error) {
	if d.Research.Any() || d.AdvertiseContext > 0 {
		return nil, errors.New("demo: --bug and --incident run in process only (kvhandoff serve has no research switches)")
	}
	if logs == nil {
		logs = io.Discard
	}
	p := &Procs{bin: bin, dir: dir, d: d, logs: logs, procs: map[string]*proc{}, args: map[string][]string{}, metrics: map[string]string{},
		client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}}
	var names []string
	for i := range d.Prefills {
		names = append(names, fmt.Sprintf("prefill-%d", i))
	}
	for i := range d.Decodes {
		names = append(names, fmt.Sprintf("decode-%d", i))
	}
	certs := exec.Command(bin, "certs", "--dir", dir, "--nodes", "router,"+strings.Join(names, ","))
	if out, err := certs.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("demo: kvhandoff certs: %v: %s", err, out)
	}
	tls := func(name string) []string {
		return []string{"--tls-ca", filepath.Join(dir, "ca.pem"), "--tls-cert", filepath.Join(dir, name+".pem"), "--tls-key", filepath.Join(dir, name+"-key.pem")}
	}
	common := []string{"--model", "builtin", "--seed", strconv.FormatUint(d.Seed, 10), "--page-tokens", strconv.Itoa(d.PageTokens),
		"--log-format", "json", "--timeout", d.Timeout.String(), "--grace", "2s"}
	if d.ContextTokens > 0 {
		common = append(common, "--context-tokens", strconv.Itoa(d.ContextTokens))
	}
	ports := newPortPicker()
	var portErr error
	addr := func() string {
		a, err := ports.addr()
		if err != nil && portErr == nil {
			portErr = err
		}
		return a
	}
	var decodePeers, prefillPeers, allPeers []string
	prefillCtl := map[string]string{}
	for i := range d.Prefills {
		name := fmt.Sprintf("prefill-%d", i)
		prefillCtl[name] = addr()
		prefillPeers = append(prefillPeers, name+"="+prefillCtl[name])
	}
	for i := range d.Decodes {
		name := fmt.Sprintf("decode-%d", i)
		ctl, met := addr(), addr()
		p.metrics[name] = met
		decodePeers = append(decodePeers, name+"="+ctl)
		// A decode node accepts queue pairs only from the prefill nodes it lists.
		p.args[name] = append(append([]string{"serve", "--role", "decode", "--name", name, "--control", ctl, "--transfer", addr(), "--rdma", addr(),
			"--metrics", met, "--pool-pages", strconv.Itoa(d.DecodePages), "--peers", strings.Join(prefillPeers, ",")}, common...), tls(name)...)
		if d.PrefixCache {
			p.args[name] = append(p.args[name], "--prefix-cache")
		}
	}
	allPeers = append(allPeers, decodePeers...)
	for i := range d.Prefills {
		name := fmt.Sprintf("prefill-%d", i)
		ctl, met := prefillCtl[name], addr()
		p.metrics[name] = met
		allPeers = append(allPeers, name+"="+ctl)
		p.args[name] = append(append([]string{"serve", "--role", "prefill", "--name", name, "--control", ctl, "--rdma", addr(),
			"--metrics", met, "--pool-pages", strconv.Itoa(d.PrefillPages), "--peers", strings.Join(decodePeers, ",")}, common...), tls(name)...)
	}
	p.api = addr()
	p.args["router"] = append(append([]string{"serve", "--role", "router", "--name", "router", "--listen", p.api, "--peers", strings.Join(allPeers, ",")},
		common...), tls("router")...)
	if portErr != nil {
		return nil, portErr
	}
	// The demo's traffic is the router's front proxy: it names each request's tenant.
	p.args["router"] = append(p.args["router"], "--trust-tenant-header")
	for _, pp := range d.publicPrefixes() {
		p.args["router"] = append(p.args["router"], "--public-prefix", pp.Name+"="+pp.Text)
	}
	if d.Trace != "" {
		for name := range p.args {
			if err := freshTrace(d.Trace + "." + name); err != nil {
				return nil, err
			}
			p.args[name] = append(p.args[name], "--trace", d.Trace+"."+name)
		}
	}
	if etcd != "" {
		// The same processes, registered in etcd: every static --peers
		// gives way to the cluster, under a prefix no other run shares.
		reg := []string{"--etcd", etcd, "--etcd-prefix", "/kvhandoff/" + filepath.Base(dir) + "/", "--lease", "2s"}
		for name, args := range p.args {
			var kept []string
			for i := 0; i < len(args); i++ {
				if args[i] == "--peers" {
					i++
					continue
				}
				kept = append(kept, args[i])
			}
			p.args[name] = append(kept, reg...)
		}
	}
	for _, name := range append(names, "router") {
		if err := p.start(name); err != nil {
			p.Stop()
			return nil, err
		}
	}
	if err := p.waitReady(30 * time.Second); err != nil {
		p.Stop()
		return nil, err
	}
	return p, nil
}

// proc is one serve process: done is closed once it has exited, and err
// and out then say how it ended.
type proc struct {
	cmd  *exec.Cmd
	out  *tail
	done chan struct{}
	err  error // cmd.Wait's
}

func (p *Procs) start(name string) error {
	cmd := exec.Command(p.bin, p.args[name]...)
	out := &tail{}
	w := io.MultiWriter(p.logs, out)
	cmd.Stdout, cmd.Stderr = w, w
	cmd.WaitDelay = 5 * time.Second // a pipe held open past the node's exit does not hold Wait
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("demo: starting %s: %w", name, err)
	}
	pr := &proc{cmd: cmd, out: out, done: make(chan struct{})}
	go func() {
		pr.err = cmd.Wait()
		close(pr.done)
	}()
	p.mu.Lock()
	p.procs[name] = pr
	p.mu.Unlock()
	return nil
}

// exited names a process that has ended, with the end of its output (a
// node that could not listen, or refused to join, says why there), or
// returns nil.
func (p *Procs) exited() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	names := make([]string, 0, len(p.procs))
	for name := range p.procs {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		pr := p.procs[name]
		select {
		case <-pr.done:
			return pr.exit(name)
		default:
		}
	}
	return nil
}

// waitReady waits until the router answers a completion and every prefill
// node has its queue pairs; a process that exits meanwhile ends the wait
// at once, with its reason.
func (p *Procs) waitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		if err := p.exited(); err != nil {
			return fmt.Errorf("demo: the deployment's processes did not come up: %w", err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, _, err := p.Complete(ctx, Request{Prompt: "ready? ", MaxTokens: 1})
		cancel()
		if err == nil {
			err = p.queuePairsDown()
		}
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("demo: the deployment's processes did not come up within %v: %w", timeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// exit says how the exited process name ended, with the end of its output.
func (pr *proc) exit(name string) error {
	status := "exit status 0"
	if pr.err != nil {
		status = pr.err.Error()
	}
	return fmt.Errorf("%s exited (%s); the end of its output:\n%s", name, status, pr.out.lastLines(10))
}

// tail keeps the last tailBytes written to it: a process's output, for the
// error that says why it exited.
type tail struct {
	mu  sync.Mutex
	buf []byte
	cut bool // bytes were dropped from the front: the first line kept may be partial
}

const tailBytes = 8 << 10

func (t *tail) Write(b []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, b...)
	if over := len(t.buf) - tailBytes; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
		t.cut = true
	}
	return len(b), nil
}

// lastLines is the last n whole lines kept.
func (t *tail) lastLines(n int) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	lines := strings.Split(strings.TrimRight(string(t.buf), "\n"), "\n")
	if t.cut && len(lines) > 1 {
		lines = lines[1:] // the first may be partial
	}
	return strings.Join(lines[max(len(lines)-n, 0):], "\n")
}

// queuePairsDown says which prefill node lacks a live queue pair to some
// decode node (its kvhandoff_queue_pairs gauge), or returns nil.
func (p *Procs) queuePairsDown() error {
	for i := range p.d.Prefills {
		name := fmt.Sprintf("prefill-%d", i)
		n, err := p.scrape(p.metrics[name], "kvhandoff_queue_pairs{", `state="live"`)
		if err != nil {
			return fmt.Errorf("%s's metrics: %w", name, err)
		}
		if n < p.d.Decodes {
			return fmt.Errorf("%s has %d live queue pairs of %d", name, n, p.d.Decodes)
		}
	}
	return nil
}

// httpError is a non-200 answer of the client API.
type httpError struct {
	status int
	code   string
	msg    string
}

func (e *httpError) Error() string { return fmt.Sprintf("HTTP %d %s: %s", e.status, e.code, e.msg) }

// Complete implements Client over the router's HTTP API. The built-in
// model's vocabulary is bytes, so the answer's tokens are its text's bytes.
func (p *Procs) Complete(ctx context.Context, r Request) ([]int, string, error) {
	tokens, text, _, err := p.CompleteCached(ctx, r)
	return tokens, text, err
}

// CompleteCached implements CachedClient: usage's cached_tokens.
func (p *Procs) CompleteCached(ctx context.Context, r Request) ([]int, string, int, error) {
	fields := map[string]any{"prompt": r.Prompt, "max_tokens": r.MaxTokens}
	if r.BodyScope != "" {
		fields["cache_salt"] = r.BodyScope
	}
	body, _ := json.Marshal(fields)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+p.api+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return nil, "", 0, err
	}
	req.Header.Set("X-Tenant", fmt.Sprintf("tenant-%d", r.Tenant))
	resp, err := p.client.Do(req)
	if err != nil {
		return nil, "", 0, err
	}
	defer resp.Body.Close()
	var out struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
		Error struct {
			Message string `json:"message"`
			Code    string `json:"code"`
		} `json:"error"`
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&out); err != nil {
		return nil, "", 0, fmt.Errorf("demo: HTTP %d with a body that is not JSON: %w", resp.StatusCode, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, "", 0, &httpError{resp.StatusCode, out.Error.Code, out.Error.Message}
	}
	if len(out.Choices) != 1 {
		return nil, "", 0, fmt.Errorf("demo: HTTP 200 with %d choices", len(out.Choices))
	}
	text := out.Choices[0].Text
	tokens := make([]int, len(text))
	for i := range len(text) {
		tokens[i] = int(text[i])
	}
	return tokens, text, out.Usage.Details.Cached, nil
}

// ClassifyHTTP names an outcome from the client API's answer: 400 over the
// limit is rejected, 503 handoff_failed_REASON failed for REASON.
func ClassifyHTTP(err error) (Kind, string) {
	var h *httpError
	switch {
	case errors.As(err, &h) && h.status == http.StatusBadRequest:
		return Rejected, "rejected"
	case errors.As(err, &h) && strings.HasPrefix(h.code, "handoff_failed_"):
		reason := strings.TrimPrefix(h.code, "handoff_failed_")
		if reason == "cancelled" {
			return Cancelled, reason
		}
		return Failed, reason
	case errors.As(err, &h):
		return Failed, h.code
	case errors.Is(err, context.Canceled):
		return Cancelled, "cancelled"
	}
	return Failed, "other"
}

// Crash kills node name (SIGKILL: no goodbye), and Restart starts it
// again with the same flags.
func (p *Procs) Crash(name string) error {
	pr, err := p.running(name)
	if err != nil {
		return err
	}
	pr.cmd.Process.Kill()
	<-pr.done
	p.mu.Lock()
	delete(p.procs, name) // killed by the demo: not a node that died by itself
	p.mu.Unlock()
	return nil
}

// StopNode stops node name as an operator does (SIGTERM: it announces its
// stop, takes no new request, and drains what it holds) and waits for it
// to exit, which it must do with status 0 within wait.
func (p *Procs) StopNode(name string, wait time.Duration) error {
	pr, err := p.running(name)
	if err != nil {
		return err
	}
	pr.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-pr.done:
	case <-time.After(wait):
		pr.cmd.Process.Kill()
		<-pr.done
		return fmt.Errorf("demo: %s did not stop within %v of its SIGTERM; the end of its output:\n%s", name, wait, pr.out.lastLines(10))
	}
	p.mu.Lock()
	delete(p.procs, name)
	p.mu.Unlock()
	if pr.err != nil {
		return fmt.Errorf("demo: stopped, %w", pr.exit(name))
	}
	return nil
}

// running is node name's process, or why it is not running: not started,
// or ended by itself (a finding, not the demo's fault).
func (p *Procs) running(name string) (*proc, error) {
	p.mu.Lock()
	pr := p.procs[name]
	p.mu.Unlock()
	if pr == nil {
		return nil, fmt.Errorf("demo: no %s", name)
	}
	select {
	case <-pr.done: // it died by itself first: that is the finding, not the demo's signal
		return nil, fmt.Errorf("demo: before the demo stopped it, %w", pr.exit(name))
	default:
	}
	return pr, nil
}

// Restart starts node name again after Crash or StopNode.
func (p *Procs) Restart(name string) error { return p.start(name) }

// Rejoined waits until node name, restarted, is back in the deployment: a
// decode node has every prefill node's queue pair again, a prefill node
// its own to every decode node (their kvhandoff_queue_pairs gauges).
func (p *Procs) Rejoined(name string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		if err := p.exited(); err != nil {
			return fmt.Errorf("demo: waiting for %s to rejoin: %w", name, err)
		}
		err := p.queuePairsDown()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("demo: %s did not rejoin within %v: %w", name, timeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// PagesLeft scrapes every node's kvhandoff_pages gauge until no page is
// owned or quarantined, or wait has passed.
func (p *Procs) PagesLeft(wait time.Duration) map[string]int {
	deadline := time.Now().Add(wait)
	for {
		left, total := map[string]int{}, 0
		for name, addr := range p.metrics {
			n, err := p.scrapePages(addr)
			if err != nil {
				n = -1 // unknown counts as leaked: the check must not pass on a node it could not read
			}
			if n != 0 {
				total++
			}
			left[name] = max(n, 0)
			if n < 0 {
				left[name+" (unreadable)"] = 1
			}
		}
		if total == 0 || time.Now().After(deadline) {
			return left
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (p *Procs) scrapePages(addr string) (int, error) {
	owned, err := p.scrape(addr, "kvhandoff_pages{", `state="owned"`)
	if err != nil {
		return 0, err
	}
	quarantined, err := p.scrape(addr, "kvhandoff_pages{", `state="quarantined"`)
	return owned + quarantined, err
}

// scrape sums the samples of a metric (its name and "{") whose labels
// contain label, from the /metrics at addr.
func (p *Procs) scrape(addr, metric, label string) (int, error) {
	resp, err := p.client.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	n, found := 0, false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, metric) {
			continue
		}
		found = true
		if !strings.Contains(line, label) {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			return 0, err
		}
		n += int(v)
	}
	if !found {
		return 0, fmt.Errorf("no %s} at %s", metric, addr)
	}
	return n, sc.Err()
}

// Stop ends every process gracefully (SIGTERM), then waits.
func (p *Procs) Stop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pr := range p.procs {
		pr.cmd.Process.Signal(syscall.SIGTERM) // one that has exited: an error, ignored
	}
	for _, pr := range p.procs {
		select {
		case <-pr.done:
		case <-time.After(15 * time.Second):
			pr.cmd.Process.Kill()
			<-pr.done
		}
	}
}

// RunProcs is RunInProcess over processes: the same workload and checks;
// the faults a process deployment can take from outside (a prefill node
// killed and restarted, or a rolling restart of every node but the
// router).
func RunProcs(ctx context.Context, bin string, cfg Config, logs io.Writer) (*Result, error) {
	d := cfg.Deployment
	w, ref, err := prepare(&cfg)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "kvhandoff-demo-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	p, err := StartProcs(bin, dir, d, cfg.Etcd, logs)
	if err != nil {
		return nil, err
	}
	defer p.Stop()
	concurrency := max(cfg.Concurrency, 1)
	var injected []string
	var did Faults
	var fw sync.WaitGroup
	runCtx, stopFaults := context.WithCancel(ctx)
	third, tenth := make(chan struct{}), make(chan struct{})
	var finished sync.Mutex
	count := 0
	progress := func() {
		finished.Lock()
		count++
		if count == max(1, len(w.Requests)/10) {
			close(tenth)
		}
		if count == len(w.Requests)/3 {
			close(third)
		}
		finished.Unlock()
		if cfg.Progress != nil {
			cfg.Progress()
		}
	}
	if cfg.Faults.Crash {
		fw.Go(func() {
			select {
			case <-runCtx.Done():
				return
			case <-third:
			}
			did.Crash = true // a failed kill may have half happened
			name := fmt.Sprintf("prefill-%d", 1%d.Prefills)
			if err := p.Crash(name); err != nil {
				injected = append(injected, err.Error())
				return
			}
			injected = append(injected, "killed "+name)
			if err := p.Restart(name); err != nil {
				injected = append(injected, err.Error())
				return
			}
			injected = append(injected, "restarted "+name)
		})
	}
	// The rolling restart: each decode node, then each prefill node,
	// stopped and restarted in turn from a tenth of the workload on (four
	// nodes' restarts took about a quarter of 600 requests here, the
	// traffic going on throughout). A node that does not stop cleanly, or does not
	// rejoin, fails the run.
	var rollErr error
	if cfg.Faults.Rolling {
		did.Rolling = true
		fw.Go(func() {
			select {
			case <-runCtx.Done():
				return
			case <-tenth:
			}
			at := func() int { finished.Lock(); defer finished.Unlock(); return count }
			for _, name := range rollingOrder(d) {
				if runCtx.Err() != nil {
					return
				}
				if rollErr = p.StopNode(name, 30*time.Second); rollErr != nil {
					return
				}
				injected = append(injected, fmt.Sprintf("stopped %s (SIGTERM) after %d requests", name, at()))
				if rollErr = p.Restart(name); rollErr != nil {
					return
				}
				if rollErr = p.Rejoined(name, 30*time.Second); rollErr != nil {
					return
				}
				injected = append(injected, fmt.Sprintf("restarted %s, back after %d requests", name, at()))
			}
		})
	}
	start := time.Now()
	outs := Run(ctx, w, p, ClassifyHTTP, concurrency, progress)
	elapsed := time.Since(start)
	stopFaults()
	fw.Wait()
	if ctx.Err() != nil {
		return nil, ctx.Err() // interrupted: the nodes got the signal too
	}
	if rollErr != nil {
		return nil, fmt.Errorf("demo: the rolling restart: %w", rollErr)
	}
	if err := p.exited(); err != nil {
		// Only the demo's own kill ends a node, and it restarts it: a node
		// that ended by itself is a crash the run must name.
		return nil, fmt.Errorf("demo: a node died during the run: %w", err)
	}
	left := p.PagesLeft(10 * time.Second)
	rep, err := Check(w, outs, ref, did, left, elapsed)
	if err != nil {
		return nil, err
	}
	return &Result{Report: rep, Workload: w, Faults: injected}, nil
}

// rollingOrder is the order a rolling restart stops d's nodes in: the
// decode nodes, then the prefill nodes.
func rollingOrder(d Deployment) []string {
	var names []string
	for i := range d.Decodes {
		names = append(names, fmt.Sprintf("decode-%d", i))
	}
	for i := range d.Prefills {
		names = append(names, fmt.Sprintf("prefill-%d", i))
	}
	return names
}

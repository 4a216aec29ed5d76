package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/kvhandoff/kvhandoff/internal/demo"
	"github.com/kvhandoff/kvhandoff/internal/research"
)

const demoUsage = `usage: kvhandoff demo [flags]

Starts a deployment in this process (a router, 2 prefill and 2 decode nodes of
the built-in model, over the in-process provider), runs a multi-tenant workload
through it with faults (queue-pair cuts, late placements, payload corruption, a
prefill node crashing and coming back), and checks every answer: a success must
equal a colocated run of the same model token for token and carry no other
tenant's canary; every other outcome must be an explicit error; at the end no
page may be owned on any node. Exit 0 iff no leak, no incoherent success, no
page leaked (1 otherwise, 2 bad usage).

--incident sets up the 2026 incident's deployment (prefill pools smaller than
the context the router checks); with --bug admit-finished,no-token-check,no-tag-check
it reproduces the incident: successes carrying another tenant's canary.

`

// runDemo is kvhandoff demo.
func runDemo(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("demo", demoUsage, stderr)
	requests := fs.Int("requests", 1000, "requests in the workload")
	tenants := fs.Int("tenants", 8, "tenants, each with its canary")
	seed := fs.Uint64("seed", 1, "the workload's and the faults' seed")
	concurrency := fs.Int("concurrency", 16, "clients sending at once")
	bugs := fs.String("bug", "", "switches of the bug catalogue to turn on, comma-separated (docs/spec.md)")
	incident := fs.Bool("incident", false, "the incident's deployment: prefill pools smaller than the advertised context")
	noFaults := fs.Bool("no-faults", false, "inject no faults")
	disconnects := fs.Float64("disconnects", 0.05, "the fraction of clients that go away 0.1 ms to 1 s after sending (log-uniform; 0 for none)")
	procs := fs.Bool("procs", false, "run the nodes as separate kvhandoff serve processes over the socket provider (faults: a prefill node killed and restarted)")
	rolling := fs.Bool("rolling", false, "with --procs: instead of the default faults, a rolling restart under traffic (each decode node, then each prefill node, stopped with SIGTERM and restarted in turn): a graceful stop fails no request, so any failure fails the run")
	etcd := fs.String("etcd", "", "with --procs: the nodes register in this running etcd cluster (host:port,...) instead of static peers")
	decodePages := fs.Int("decode-pages", 0, "each decode node's pool in pages (default: the deployment's)")
	asJSON := fs.Bool("json", false, "one JSON object on stdout instead of the table")
	verbose := fs.Bool("v", false, "list the faults injected")
	traceFile := fs.String("trace", "", "write the nodes' protocol events for kvhandoff trace check: in process all in this file, with --procs each node's in FILE.NODE (docs/trace.md)")
	logLevel := fs.String("log", "", "the nodes' logs on stderr at this level: debug, info, warn, error (default none)")
	if rc := parseFlags(fs, args, stderr); rc >= 0 {
		return rc
	}
	sw, err := research.Parse(*bugs)
	if err != nil {
		fmt.Fprintf(stderr, "kvhandoff demo: %v\n", err)
		return 2
	}
	if *requests < 1 || *tenants < 2 || *concurrency < 1 {
		fmt.Fprintln(stderr, "kvhandoff demo: --requests and --concurrency must be positive, --tenants at least 2")
		return 2
	}
	if !(*disconnects >= 0 && *disconnects <= 1) {
		fmt.Fprintf(stderr, "kvhandoff demo: --disconnects %v: want a fraction from 0 to 1\n", *disconnects)
		return 2
	}
	if *rolling && !*procs {
		fmt.Fprintln(stderr, "kvhandoff demo: --rolling needs --procs (it stops and restarts serve processes)")
		return 2
	}
	if *etcd != "" && !*procs {
		fmt.Fprintln(stderr, "kvhandoff demo: --etcd needs --procs (the in-process deployment uses its own registry)")
		return 2
	}
	cfg := demo.Config{Deployment: demo.Default(), Faults: demo.DefaultFaults(), Concurrency: *concurrency, Etcd: *etcd,
		Workload: demo.Spec{Seed: *seed, Requests: *requests, Tenants: *tenants, Disconnect: *disconnects}}
	if *disconnects == 0 {
		cfg.Workload.Disconnect = -1 // the Spec's zero is its default
	}
	if *incident {
		cfg.Deployment = demo.Incident()
		// The incident's traffic: calm (no disconnects, no faults, whose
		// half-written pages the checksums would catch first), a warm-up
		// that leaves every decode page holding some tenant's KV, then
		// more over-long prompts.
		// Answers of 24 tokens: a leaked prompt's start ("Key is ", the
		// tag and the canary) shows whole.
		cfg.Workload.OverLimit, cfg.Workload.Disconnect, cfg.Workload.WarmUp = 0.15, -1, min(*requests/5, 50)
		cfg.Workload.MaxTokens = 24
		*noFaults = true
	}
	cfg.Deployment.Research = sw
	if *decodePages != 0 {
		cfg.Deployment.DecodePages = *decodePages
	}
	cfg.Deployment.Trace = *traceFile
	if *logLevel != "" {
		var lv slog.Level
		if err := lv.UnmarshalText([]byte(*logLevel)); err != nil {
			fmt.Fprintf(stderr, "kvhandoff demo: --log: %v\n", err)
			return 2
		}
		cfg.Log = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: lv}))
	}
	if *noFaults {
		cfg.Faults = demo.Faults{}
	}
	if *rolling {
		cfg.Faults = demo.Faults{Rolling: true} // alone: no other fault explains a failure
	}
	var bar *progressbar.ProgressBar
	if f, ok := stderr.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		bar = progressbar.NewOptions(*requests, progressbar.OptionSetWriter(stderr), progressbar.OptionSetDescription("requests"),
			progressbar.OptionShowCount(), progressbar.OptionClearOnFinish(), progressbar.OptionThrottle(100*time.Millisecond))
		cfg.Progress = func() { bar.Add(1) }
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	var res *demo.Result
	if *procs {
		bin, berr := os.Executable()
		if berr != nil {
			fmt.Fprintf(stderr, "kvhandoff demo: %v\n", berr)
			return 1
		}
		var logs io.Writer
		if *logLevel != "" {
			logs = stderr
		}
		res, err = demo.RunProcs(ctx, bin, cfg, logs)
	} else {
		res, err = demo.RunInProcess(ctx, cfg)
	}
	if bar != nil {
		bar.Finish()
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvhandoff demo: %v\n", err)
		return 1
	}
	rep := res.Report
	if *asJSON {
		if err := rep.WriteJSON(stdout); err != nil {
			fmt.Fprintf(stderr, "kvhandoff demo: %v\n", err)
			return 1
		}
	} else {
		d := cfg.Deployment
		where := "in process"
		if *procs {
			where = "as serve processes over the socket provider"
			if *etcd != "" {
				where += ", registered in etcd"
			}
		}
		fmt.Fprintf(stdout, "deployment: router, %d prefill and %d decode nodes %s (built-in model, pages of %d tokens), nodes taking %d tokens",
			d.Prefills, d.Decodes, where, d.PageTokens, d.Limit())
		if d.AdvertiseContext > d.Limit() {
			fmt.Fprintf(stdout, " but advertising %d (the incident's deployment)", d.AdvertiseContext)
		}
		fmt.Fprintf(stdout, "; bugs: %s\n", sw)
		fmt.Fprintf(stdout, "workload: %d requests of %d tenants, seed %d; %d faults injected\n", rep.Requests, len(res.Workload.Tenants), *seed, len(res.Faults))
		if *verbose {
			for _, f := range res.Faults {
				fmt.Fprintf(stdout, "  fault: %s\n", f)
			}
		}
		rep.WriteTable(stdout)
	}
	if !rep.Passed() {
		return 1
	}
	return 0
}

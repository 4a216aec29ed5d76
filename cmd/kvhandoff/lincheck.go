package main

import (
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/linearizability"
)

const lincheckUsage = `usage: kvhandoff lincheck [flags]

Records histories of the concurrent APIs (protocol.SharedReceiver, then
protocol.SharedSender) from real runs of many goroutines, with --ops operations
each, and checks them for linearizability with porcupine (docs/linearizability.md). Exit status 0 iff the history is linearizable; 1 if it
is illegal (the path of an HTML visualization is printed) or the check ran past
--timeout (unknown); 2 on bad usage.

flags:
`

func runLincheck(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("lincheck", lincheckUsage, stderr)
	clients := fs.Int("clients", 16, "goroutines: one transport poller, the rest decode workers")
	ops := fs.Int("ops", 100000, "operations to record")
	faults := fs.Bool("faults", false, "queue-pair cuts and fire-and-forget cancels (outcome unknown)")
	bug := fs.String("bug", "", "a concurrency switch to turn on: stale-status or split-acquire")
	seed := fs.Uint64("seed", 1, "the workload's choices (the interleaving is the scheduler's)")
	dir := fs.String("dir", "", "where to write the visualization (default: the temporary directory)")
	timeout := fs.Duration("timeout", time.Minute, "how long each side's check may run before it is reported unknown (exit 1): a check starved of CPU needs more")
	jsonOut := fs.Bool("json", false, "print exactly one JSON object on stdout")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if *clients < 2 || *ops < 1 || *timeout <= 0 {
		fmt.Fprintln(stderr, "kvhandoff lincheck: --clients must be at least 2, --ops at least 1 and --timeout positive")
		return 2
	}
	sw, err := research.Parse(*bug)
	if err != nil {
		fmt.Fprintf(stderr, "kvhandoff lincheck: %v\n", err)
		return 2
	}
	cfg := linearizability.Config{Clients: *clients, Ops: *ops, Faults: *faults, Bugs: sw, Seed: *seed, Dir: *dir, Timeout: *timeout}
	r, err := linearizability.Run(cfg) // the receiver: its switches apply here
	if err != nil {
		fmt.Fprintf(stderr, "kvhandoff lincheck: %v\n", err)
		return 2
	}
	if r.Result == "ok" {
		s, err := linearizability.RunSender(cfg)
		if err != nil {
			fmt.Fprintf(stderr, "kvhandoff lincheck: %v\n", err)
			return 2
		}
		r = &linearizability.Result{Ops: r.Ops + s.Ops, Partitions: r.Partitions + s.Partitions, Result: s.Result,
			Seconds: r.Seconds + s.Seconds, Visualization: s.Visualization}
	}
	code := 0
	if r.Result != "ok" {
		code = 1
	}
	if *jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(struct {
			Ops           int     `json:"ops"`
			Partitions    int     `json:"partitions"`
			Result        string  `json:"result"`
			Seconds       float64 `json:"seconds"`
			Visualization string  `json:"visualization"`
		}{r.Ops, r.Partitions, r.Result, r.Seconds, r.Visualization}); err != nil {
			fmt.Fprintf(stderr, "kvhandoff lincheck: %v\n", err)
			return 2
		}
		return code
	}
	fmt.Fprintf(stdout, "%s: %d operations in %d partitions, %.2fs\n", r.Result, r.Ops, r.Partitions, r.Seconds)
	if r.Visualization != "" {
		fmt.Fprintf(stdout, "visualization: %s\n", r.Visualization)
	}
	return code
}

package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/rdma/inproc"
	"github.com/kvhandoff/kvhandoff/rdma/socket"
	"github.com/kvhandoff/kvhandoff/rdma/throughput"
)

const benchUsage = `usage: kvhandoff bench transfer [flags]
       kvhandoff bench handoff [flags]  (end-to-end handoffs through endpoints; kvhandoff bench handoff -h)
       kvhandoff bench engine [flags]   (the bundled engine; kvhandoff bench engine -h)

Measures a provider's WRITE throughput for page sizes from 4 KiB to 4 MiB, next to
a baseline measured in the same run, and prints the ratio. Throughput is in
Gbit/s (10^9 bits per second), best of --reps rounds.

Providers and their baselines:
  inproc   in-process provider     against a plain memory copy of the same bytes
  socket   socket provider (TCP on loopback, two devices)   against memory copy
  verbs    libibverbs (build tag verbs; needs an RDMA device)   against perftest's
           ib_write_bw on the same device, run by this command (ib_write_bw must be
           on PATH); rdma/verbs/vmtest/run.sh runs it on Soft-RoCE

flags:
`

// benchRow is one line of the result.
type benchRow struct {
	Provider     string  `json:"provider"`
	PageBytes    int     `json:"page_bytes"`
	Gbps         float64 `json:"gbps"`
	Baseline     string  `json:"baseline"`
	BaselineGbps float64 `json:"baseline_gbps"`
	Ratio        float64 `json:"ratio"`
}

// benchProvider measures one provider at one page size: its own throughput and
// its baseline's, in bytes per second.
type benchProvider func(pageBytes, total, reps int) (provider, baseline float64, baselineName string, err error)

// benchProviders maps --provider names to measurements; bench_verbs.go adds
// verbs under the build tag.
var benchProviders = map[string]benchProvider{
	"inproc": func(size, total, reps int) (float64, float64, string, error) {
		f := inproc.NewFabric("bench")
		p, m, err := throughput.Write(f.Device("a"), f.Device("b"), size, total, reps)
		return p, m, "memcpy", err
	},
	"socket": func(size, total, reps int) (float64, float64, string, error) {
		// Over TLS 1.3, as a deployment runs it, with a throwaway authority.
		ca, err := pki.NewCA("bench")
		if err != nil {
			return 0, 0, "", err
		}
		listen := func(name string) (*socket.Device, error) {
			tc, err := ca.Config(name)
			if err != nil {
				return nil, err
			}
			return socket.Listen("tcp", "127.0.0.1:0", socket.Config{TLS: tc})
		}
		a, err := listen("a")
		if err != nil {
			return 0, 0, "", err
		}
		defer a.Close()
		b, err := listen("b")
		if err != nil {
			return 0, 0, "", err
		}
		defer b.Close()
		p, m, err := throughput.Write(a, b, size, total, reps)
		return p, m, "memcpy", err
	},
}

func runBench(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "engine" {
		return runBenchEngine(args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "handoff" {
		return runBenchHandoff(args[1:], stdout, stderr)
	}
	if len(args) == 0 || args[0] != "transfer" {
		fmt.Fprint(stderr, benchUsage)
		return 2
	}
	fs := newFlags("bench transfer", benchUsage, stderr)
	providers := fs.String("provider", "inproc,socket", "comma-separated providers: inproc, socket, verbs")
	total := fs.Int("bytes", 64<<20, "bytes moved per round and page size")
	reps := fs.Int("reps", 3, "rounds; the best one counts")
	jsonOut := fs.Bool("json", false, "print exactly one JSON object on stdout")
	if code := parseFlags(fs, args[1:], stderr); code >= 0 {
		return code
	}
	if *total < 4<<10 || *reps < 1 {
		fmt.Fprintln(stderr, "kvhandoff bench transfer: --bytes must be at least 4096 and --reps at least 1")
		return 2
	}
	var names []string
	for _, name := range strings.Split(*providers, ",") {
		if _, ok := benchProviders[name]; !ok {
			if name == "verbs" {
				fmt.Fprintln(stderr, "kvhandoff bench transfer: provider verbs needs a build with -tags verbs")
			} else {
				fmt.Fprintf(stderr, "kvhandoff bench transfer: unknown provider %q\n", name)
			}
			return 2
		}
		names = append(names, name)
	}
	var rows []benchRow
	for _, name := range names {
		for size := 4 << 10; size <= 4<<20; size *= 4 {
			p, base, baseName, err := benchProviders[name](size, *total, *reps)
			if err != nil {
				fmt.Fprintf(stderr, "kvhandoff bench transfer: %s, %d-byte pages: %v\n", name, size, err)
				return 1
			}
			if !(base > 0) || !(p > 0) {
				// A ratio against nothing is not a measurement (and +Inf is not JSON).
				fmt.Fprintf(stderr, "kvhandoff bench transfer: %s, %d-byte pages: measured %g B/s against a baseline (%s) of %g B/s\n", name, size, p, baseName, base)
				return 1
			}
			rows = append(rows, benchRow{name, size, p * 8 / 1e9, baseName, base * 8 / 1e9, p / base})
		}
	}
	if *jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(struct {
			Rows []benchRow `json:"rows"`
		}{rows}); err != nil {
			fmt.Fprintf(stderr, "kvhandoff bench transfer: %v\n", err)
			return 2
		}
		return 0
	}
	tw := tabwriter.NewWriter(stdout, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "provider\tpage\tGbit/s\tbaseline\tbaseline Gbit/s\tratio\t")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%d KiB\t%.2f\t%s\t%.2f\t%.2f\t\n", r.Provider, r.PageBytes>>10, r.Gbps, r.Baseline, r.BaselineGbps, r.Ratio)
	}
	tw.Flush()
	return 0
}

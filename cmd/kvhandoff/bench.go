package main

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/kvhandoff/kvhandoff/rdma/inproc"
)

const benchUsage = `usage: kvhandoff bench transfer [flags]

Measures the transport's WRITE throughput for page sizes from 4 KiB to 4 MiB, next
to a plain memory copy of the same bytes measured in the same run, and prints the
ratio. Throughput is in Gbit/s, best of --reps rounds. (The verbs provider against
perftest's ib_write_bw runs inside the Soft-RoCE VM; it is not built yet.)

flags:
`

func runBench(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] != "transfer" {
		fmt.Fprint(stderr, benchUsage)
		return 2
	}
	fs := newFlags("bench transfer", benchUsage, stderr)
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
	type row struct {
		Provider     string  `json:"provider"`
		PageBytes    int     `json:"page_bytes"`
		Gbps         float64 `json:"gbps"`
		Baseline     string  `json:"baseline"`
		BaselineGbps float64 `json:"baseline_gbps"`
		Ratio        float64 `json:"ratio"`
	}
	var rows []row
	for size := 4 << 10; size <= 4<<20; size *= 4 {
		p, m, err := inproc.Throughput(size, *total, *reps)
		if err != nil {
			fmt.Fprintf(stderr, "kvhandoff bench transfer: %v\n", err)
			return 1
		}
		rows = append(rows, row{"inproc", size, p * 8 / 1e9, "memcpy", m * 8 / 1e9, p / m})
	}
	if *jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(struct {
			Rows []row `json:"rows"`
		}{rows}); err != nil {
			fmt.Fprintf(stderr, "kvhandoff bench transfer: %v\n", err)
			return 2
		}
		return 0
	}
	tw := tabwriter.NewWriter(stdout, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "provider\tpage\tGbit/s\tmemcpy Gbit/s\tratio\t")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%d KiB\t%.1f\t%.1f\t%.2f\t\n", r.Provider, r.PageBytes>>10, r.Gbps, r.BaselineGbps, r.Ratio)
	}
	tw.Flush()
	return 0
}

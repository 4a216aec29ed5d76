package main

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/model"
)

const simUsage = `usage: kvhandoff sim [flags]

Deterministic simulation of the protocol implementation (docs/protocol.md): each
seed is a workload of concurrent requests (some over-long) on two prefill nodes
and a decode node over in-memory queue pairs, with cancels, crashes, timeouts,
cuts, late placements and corruption, checking the spec's properties after every
step. Runs seeds --seed .. --seed+--seeds-1. Exit status 0 iff no run violated a
property; 1 on a violation (the seed and its event trace are printed; rerun with
--seed S --seeds 1 to replay it exactly); 2 on bad usage.

flags:
`

func runSim(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("sim", simUsage, stderr)
	seeds := fs.Int("seeds", 1000, "number of seeds to run")
	seed := fs.Uint64("seed", 1, "first seed")
	bugs := fs.String("bug", "", "implementation switches to turn on, comma-separated")
	requests := fs.Int("requests", 24, "requests per seed")
	jsonOut := fs.Bool("json", false, "print exactly one JSON object on stdout")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if *seeds < 1 || *requests < 1 || *requests > 10000 {
		fmt.Fprintln(stderr, "kvhandoff sim: --seeds must be at least 1 and --requests 1..10000")
		return 2
	}
	sw, err := research.Parse(*bugs)
	if err != nil {
		fmt.Fprintf(stderr, "kvhandoff sim: %v\n", err)
		return 2
	}
	s := model.RunSeeds(model.SimConfig{Requests: *requests, Bugs: sw}, *seed, *seeds)
	code := 0
	if s.Violations > 0 {
		code = 1
	}
	if *jsonOut {
		type first struct {
			Seed     uint64 `json:"seed"`
			Property string `json:"property"`
		}
		out := struct {
			Seeds          int            `json:"seeds"`
			Requests       int            `json:"requests"`
			Outcomes       map[string]int `json:"outcomes"`
			Violations     int            `json:"violations"`
			FirstViolation *first         `json:"first_violation"`
			PagesLeaked    int            `json:"pages_leaked"`
			Seconds        float64        `json:"seconds"`
		}{s.Seeds, s.Requests, s.Outcomes, s.Violations, nil, s.PagesLeaked, s.Elapsed.Seconds()}
		if v := s.FirstViolation; v != nil {
			out.FirstViolation = &first{v.Seed, v.Violation.Property}
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(out); err != nil {
			fmt.Fprintf(stderr, "kvhandoff sim: %v\n", err)
			return 2
		}
		return code
	}
	if v := s.FirstViolation; v != nil {
		fmt.Fprintf(stdout, "VIOLATION of %s in seed %d at step %d (bugs: %s): %s\n", v.Violation.Property, v.Seed, v.Violation.Step, sw, v.Violation.Detail)
		fmt.Fprintf(stdout, "event trace:\n%s\n", strings.Join(v.Trace, "\n"))
		replay := fmt.Sprintf("kvhandoff sim --seed %d --seeds 1", v.Seed)
		if *bugs != "" {
			replay += " --bug " + *bugs
		}
		if *requests != 24 {
			replay += fmt.Sprintf(" --requests %d", *requests)
		}
		fmt.Fprintf(stdout, "replay: %s\n", replay)
	}
	var why []string
	for _, k := range slices.Sorted(maps.Keys(s.FailedBy)) {
		why = append(why, fmt.Sprintf("%s %d", k, s.FailedBy[k]))
	}
	fmt.Fprintf(stdout, "%d seeds, %d requests (ok %d, rejected %d, cancelled %d, failed %d), %d violations, %d pages leaked, %.2fs\n",
		s.Seeds, s.Requests, s.Outcomes[model.OutcomeOK], s.Outcomes[model.OutcomeRejected], s.Outcomes[model.OutcomeCancelled],
		s.Outcomes[model.OutcomeFailed], s.Violations, s.PagesLeaked, s.Elapsed.Seconds())
	if len(why) > 0 {
		fmt.Fprintf(stdout, "failed by: %s\n", strings.Join(why, ", "))
	}
	return code
}

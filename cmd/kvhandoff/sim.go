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
seed is a workload of concurrent requests (some over-long) through the router to
--prefills prefill nodes and --decodes decode nodes over in-memory queue pairs,
with cancels, crashes, restarts under a new incarnation, timeouts, cuts, late
placements and corruption (and with --decode-restarts, decode nodes that crash and
come back at once under a new incarnation; with --prefix-cache, decode nodes that
reuse cached prompt prefixes, prompts sharing them within and across tenant
scopes), checking
the spec's properties after every step. Runs seeds --seed .. --seed+--seeds-1. Exit status 0 iff no run violated a
property; 1 on a violation (the smallest failing seed and its event trace are
printed; rerun with --seed S --seeds 1 to replay it exactly); 2 on bad usage.

Results are folded in as each seed completes: only the smallest failing seed
keeps its trace and at most 100 failing seeds are listed, so memory does not
grow with --seeds. --each prints every seed's result as it completes (in
completion order; with --json, one JSON object per line before the summary).

flags:
`

func runSim(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("sim", simUsage, stderr)
	seeds := fs.Int("seeds", 1000, "number of seeds to run")
	seed := fs.Uint64("seed", 1, "first seed")
	bugs := fs.String("bug", "", "implementation switches to turn on, comma-separated")
	requests := fs.Int("requests", 24, "requests per seed")
	prefills := fs.Int("prefills", 2, "prefill nodes")
	decodes := fs.Int("decodes", 1, "decode nodes")
	jsonOut := fs.Bool("json", false, "print exactly one JSON object on stdout (with --each, one per seed first)")
	each := fs.Bool("each", false, "print every seed's result as it completes")
	decodeRestarts := fs.Bool("decode-restarts", false, "a fault restarts a decode node under a new incarnation (a fresh pool, epochs from zero, over pages never zeroed)")
	prefixCache := fs.Bool("prefix-cache", false, "decode nodes keep a prefix cache, and prompts share prefixes within and across scopes (docs/protocol.md, Prefix reuse)")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if *seeds < 1 || *requests < 1 || *requests > 10000 || *prefills < 1 || *prefills > 64 || *decodes < 1 || *decodes > 64 {
		fmt.Fprintln(stderr, "kvhandoff sim: --seeds must be at least 1, --requests 1..10000, --prefills and --decodes 1..64")
		return 2
	}
	sw, err := research.Parse(*bugs)
	if err != nil {
		fmt.Fprintf(stderr, "kvhandoff sim: %v\n", err)
		return 2
	}
	var onResult func(*model.SimResult)
	var streamErr error
	if *each {
		enc := json.NewEncoder(stdout)
		onResult = func(r *model.SimResult) {
			if *jsonOut {
				type line struct {
					Seed      uint64           `json:"seed"`
					Requests  int              `json:"requests"`
					Outcomes  map[string]int   `json:"outcomes"`
					Violation *model.Violation `json:"violation"`
				}
				if err := enc.Encode(line{r.Seed, r.Requests, r.Outcomes, r.Violation}); err != nil && streamErr == nil {
					streamErr = err
				}
				return
			}
			if v := r.Violation; v != nil {
				fmt.Fprintf(stdout, "seed %d: VIOLATION of %s at step %d: %s\n", r.Seed, v.Property, v.Step, v.Detail)
				return
			}
			fmt.Fprintf(stdout, "seed %d: ok (ok %d, rejected %d, cancelled %d, failed %d)\n", r.Seed, r.Outcomes[model.OutcomeOK],
				r.Outcomes[model.OutcomeRejected], r.Outcomes[model.OutcomeCancelled], r.Outcomes[model.OutcomeFailed])
		}
	}
	s := model.RunSeeds(model.SimConfig{Requests: *requests, Senders: *prefills, Decoders: *decodes, DecodeRestarts: *decodeRestarts, PrefixCache: *prefixCache, Bugs: sw},
		*seed, *seeds, onResult)
	if streamErr != nil {
		fmt.Fprintf(stderr, "kvhandoff sim: %v\n", streamErr)
		return 2
	}
	code := 0
	if s.Violations > 0 {
		code = 1
	}
	if *jsonOut {
		type first struct {
			Seed     uint64 `json:"seed"`
			Property string `json:"property"`
		}
		type failure struct {
			Seed     uint64 `json:"seed"`
			Property string `json:"property"`
			Step     int    `json:"step"`
		}
		failures := []failure{}
		for _, f := range s.Failures {
			failures = append(failures, failure{f.Seed, f.Violation.Property, f.Violation.Step})
		}
		out := struct {
			Seeds          int            `json:"seeds"`
			Requests       int            `json:"requests"`
			Outcomes       map[string]int `json:"outcomes"`
			Violations     int            `json:"violations"`
			FirstViolation *first         `json:"first_violation"`
			Failures       []failure      `json:"failures"` // the smallest failing seeds, at most 100
			PagesLeaked    int            `json:"pages_leaked"`
			Seconds        float64        `json:"seconds"`
		}{s.Seeds, s.Requests, s.Outcomes, s.Violations, nil, failures, s.PagesLeaked, s.Elapsed.Seconds()}
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
		if *prefills != 2 || *decodes != 1 {
			replay += fmt.Sprintf(" --prefills %d --decodes %d", *prefills, *decodes)
		}
		if *decodeRestarts {
			replay += " --decode-restarts"
		}
		if *prefixCache {
			replay += " --prefix-cache"
		}
		fmt.Fprintf(stdout, "replay: %s\n", replay)
		if len(s.Failures) > 1 {
			var seeds []string
			for _, f := range s.Failures {
				seeds = append(seeds, fmt.Sprint(f.Seed))
			}
			more := ""
			if s.Violations > len(s.Failures) {
				more = fmt.Sprintf(" (and %d more)", s.Violations-len(s.Failures))
			}
			fmt.Fprintf(stdout, "failing seeds: %s%s\n", strings.Join(seeds, " "), more)
		}
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
	if *decodeRestarts {
		fmt.Fprintf(stdout, "decode restarts: %d, requests served by a restarted decode node: %d\n", s.DecodeRestarts, s.ServedByRestartedDecode)
	}
	if *prefixCache {
		fmt.Fprintf(stdout, "prefix cache: %d hits, %d pages reused\n", s.PrefixHits, s.PrefixHitPages)
	}
	return code
}

package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/kvhandoff/kvhandoff/spec/checker"
	"github.com/kvhandoff/kvhandoff/spec/explore"
)

// jsonBitstate is a bitstate run's bit array and coverage estimate.
type jsonBitstate struct {
	Bits           uint64  `json:"bits"`
	Hashes         int     `json:"hashes"`
	BitsSet        uint64  `json:"bits_set"`
	ExpectedMissed float64 `json:"expected_missed"` // states taken for visited ones by a collision, expected
	Coverage       float64 `json:"coverage"`        // states / (states + expected_missed)
	Seed           uint64  `json:"seed"`
}

// jsonSwarm names a swarm member.
type jsonSwarm struct {
	Index int `json:"index"`
	Count int `json:"count"`
}

// bitstateOptions sets the bitstate and swarm options from the flags: the bit
// array takes half of --max-memory (the frontier and the runtime the rest).
func (f *checkFlags) bitstateOptions(opt *explore.Options) error {
	if f.swarmCount != 0 || f.swarmIndex != 0 {
		switch {
		case !f.bitstate:
			return errors.New("--swarm-index and --swarm-count need --bitstate")
		case f.swarmCount < 1 || f.swarmIndex < 0 || f.swarmIndex >= f.swarmCount:
			return fmt.Errorf("--swarm-index must be 0..%d (--swarm-count minus 1), got %d", f.swarmCount-1, f.swarmIndex)
		}
	}
	if !f.bitstate {
		return nil
	}
	switch {
	case f.needAll:
		return errors.New("--bitstate does not combine with --need-all")
	case f.hashes < 1 || f.hashes > 8:
		return fmt.Errorf("--hashes must be 1..8, got %d", f.hashes)
	case opt.MaxMemory == 0 && f.bitstateSize == "":
		return errors.New("--bitstate needs --max-memory (the machine's memory could not be read)")
	}
	opt.Bitstate, opt.Hashes = opt.MaxMemory/2, f.hashes
	if f.bitstateSize != "" {
		size, err := maxMemory(f.bitstateSize)
		if err != nil {
			return fmt.Errorf("--bitstate-size: %q is not a size", f.bitstateSize)
		}
		opt.Bitstate = size
	}
	opt.Seed = f.seed + uint64(f.swarmIndex)
	opt.Shuffle = uint64(f.swarmIndex) // member 0 keeps the natural order
	return nil
}

func (f *checkFlags) setBitstate(out *jsonReport, s checker.Stats) {
	b := s.Bitstate
	if b.Bits == 0 {
		return
	}
	out.Bitstate = &jsonBitstate{Bits: b.Bits, Hashes: b.Hashes, BitsSet: b.BitsSet, ExpectedMissed: b.ExpectedMissed,
		Coverage: s.Coverage(), Seed: f.seed + uint64(f.swarmIndex)}
	if f.swarmCount > 0 {
		out.Swarm = &jsonSwarm{Index: f.swarmIndex, Count: f.swarmCount}
	}
	if cfg, err := f.config(); err == nil {
		out.Bounds = describeConfig(cfg)
	}
}

// bitstateSummary is the text report's note on a bitstate run.
func bitstateSummary(s checker.Stats) string {
	b := s.Bitstate
	size := fmt.Sprintf("%d MiB", b.Bits>>23)
	if b.Bits < 8<<20 {
		size = fmt.Sprintf("%d KiB", b.Bits>>13)
	}
	return fmt.Sprintf("bitstate: %s of bits, %d per state, %.2f%% set; expected states missed %.3g, coverage estimate %.6f; liveness not checked",
		size, b.Hashes, 100*float64(b.BitsSet)/float64(b.Bits), b.ExpectedMissed, s.Coverage())
}

const mergeUsage = `usage: kvhandoff check merge [--json] REPORT.json...

Combines the --json reports of a bitstate swarm (kvhandoff check --bitstate
--swarm-index i --swarm-count n --json, one per member) into one: a violation
if any member found one (the shortest trace), and the coverage estimate of the
union, 1 - the product of each member's estimated miss rate (their hashes and
search orders are independent). Exit 0 when every member ran and none found a
violation, 1 on a violation, 2 on bad input, 3 when a member is missing or
incomplete.

flags:
`

// mergedReport is check merge's --json object.
type mergedReport struct {
	Result   string `json:"result"` // ok, violation, incomplete
	Bounds   string `json:"bounds"`
	Count    int    `json:"count"`
	Members  []int  `json:"members"` // the indices merged
	Missing  []int  `json:"missing"`
	Property string `json:"property"`
	// States is the largest member's; the union's is unknown (bitstate keeps no states).
	States   int        `json:"states"`
	Coverage float64    `json:"coverage"` // the union's estimate
	Trace    []jsonStep `json:"trace"`
	From     int        `json:"from"` // the member whose trace this is, -1 if none
}

func runCheckMerge(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("check merge", mergeUsage, stderr)
	jsonOut := fs.Bool("json", false, "print one JSON object")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	m, err := mergeReports(fs.Args())
	if err != nil {
		fmt.Fprintf(stderr, "kvhandoff check merge: %v\n", err)
		return 2
	}
	code := map[string]int{"ok": 0, "violation": 1, "incomplete": 3}[m.Result]
	if *jsonOut {
		if !printJSON(stdout, stderr, m) {
			return 2
		}
		return code
	}
	fmt.Fprintf(stdout, "swarm of %d over %s\n", m.Count, m.Bounds)
	fmt.Fprintf(stdout, "members merged: %d of %d", len(m.Members), m.Count)
	if len(m.Missing) > 0 {
		fmt.Fprintf(stdout, " (missing or incomplete: %v)", m.Missing)
	}
	fmt.Fprintf(stdout, "; largest member %d states; union coverage estimate %.6f\n", m.States, m.Coverage)
	switch m.Result {
	case "violation":
		fmt.Fprintf(stdout, "VIOLATION of %s, shortest from member %d, %d steps:\n", m.Property, m.From, len(m.Trace))
		for _, st := range m.Trace {
			fmt.Fprintf(stdout, "%3d. %s  %s\n", st.Step, st.Action, st.Detail)
		}
	case "ok":
		fmt.Fprintln(stdout, "ok: no member found a safety violation or a deadlock")
	}
	return code
}

// mergeReports reads and combines swarm members' reports.
func mergeReports(files []string) (*mergedReport, error) {
	if len(files) == 0 {
		return nil, errors.New("no report files")
	}
	m := &mergedReport{Result: "ok", From: -1, Trace: []jsonStep{}, Missing: []int{}}
	seen := map[int]bool{}
	miss := 1.0
	for _, name := range files {
		b, err := os.ReadFile(name)
		if err != nil {
			return nil, err
		}
		var r jsonReport
		if err := json.Unmarshal(b, &r); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		if r.Swarm == nil || r.Bitstate == nil {
			return nil, fmt.Errorf("%s: not a swarm member's report (run with --bitstate --swarm-count N --json)", name)
		}
		switch {
		case m.Count == 0:
			m.Count, m.Bounds = r.Swarm.Count, r.Bounds
		case r.Swarm.Count != m.Count || r.Bounds != m.Bounds:
			return nil, fmt.Errorf("%s: member of another swarm (%d members over %q, not %d over %q)", name, r.Swarm.Count, r.Bounds, m.Count, m.Bounds)
		}
		if r.Swarm.Index < 0 || r.Swarm.Index >= m.Count || seen[r.Swarm.Index] {
			return nil, fmt.Errorf("%s: member %d twice or out of range", name, r.Swarm.Index)
		}
		seen[r.Swarm.Index] = true
		switch r.Result {
		case "ok", "violation":
		default: // an incomplete or failed member covers what it covered, but is not counted as run
			continue
		}
		m.Members = append(m.Members, r.Swarm.Index)
		m.States = max(m.States, r.States)
		miss *= 1 - r.Bitstate.Coverage
		if r.Result == "violation" && (m.From < 0 || len(r.Trace) < len(m.Trace) || len(r.Trace) == len(m.Trace) && r.Swarm.Index < m.From) {
			m.Result, m.Property, m.Trace, m.From = "violation", r.Property, r.Trace, r.Swarm.Index
		}
	}
	slices.Sort(m.Members)
	for i := range m.Count {
		if !slices.Contains(m.Members, i) {
			m.Missing = append(m.Missing, i)
		}
	}
	m.Coverage = 1 - miss
	if m.Result == "ok" && len(m.Missing) > 0 {
		m.Result = "incomplete"
	}
	if strings.TrimSpace(m.Bounds) == "" {
		return nil, errors.New("the reports name no bounds")
	}
	return m, nil
}

package main

import (
	"fmt"
	"io"
	"time"

	"github.com/kvhandoff/kvhandoff/spec/checker"
)

// jsonPhases is checker.Phases in --json: seconds.
type jsonPhases struct {
	Workers int `json:"workers"`
	// The parallel phases, each its wall time and its workers' busy time.
	Expand   jsonPhase `json:"expand"`
	Dedup    jsonPhase `json:"dedup"`
	Commit   jsonPhase `json:"commit"`
	Liveness jsonPhase `json:"liveness"`
	// The serial parts.
	NumberSeconds  float64 `json:"number_seconds"`
	GrowSeconds    float64 `json:"grow_seconds"`
	CollectSeconds float64 `json:"collect_seconds"`
	ReverseSeconds float64 `json:"reverse_seconds"`
	// OtherSeconds is the wall time no phase accounts for (Phases.Other).
	OtherSeconds float64 `json:"other_seconds"`
	// IdleCoreSeconds is the core time the workers spent waiting
	// (Phases.Idle): the parallel phases' tails, and every core but one
	// during the serial parts and the rest.
	IdleCoreSeconds float64 `json:"idle_core_seconds"`
}

type jsonPhase struct {
	WallSeconds float64 `json:"wall_seconds"`
	BusySeconds float64 `json:"busy_seconds"`
}

func newJSONPhases(s checker.Stats) *jsonPhases {
	p := s.Phases
	ph := func(x checker.Phase) jsonPhase { return jsonPhase{x.Wall.Seconds(), x.Busy.Seconds()} }
	return &jsonPhases{Workers: p.Workers, Expand: ph(p.Expand), Dedup: ph(p.Dedup), Commit: ph(p.Commit), Liveness: ph(p.Liveness),
		NumberSeconds: p.Number.Seconds(), GrowSeconds: p.Grow.Seconds(), CollectSeconds: p.Collect.Seconds(), ReverseSeconds: p.Reverse.Seconds(),
		OtherSeconds: p.Other(s.Elapsed).Seconds(), IdleCoreSeconds: p.Idle(s.Elapsed).Seconds()}
}

// hasPhases says whether s carries phases: an exploration that ran a wave
// (not a simulation, nor a run stopped before its first wave).
func hasPhases(s checker.Stats) bool { return s.Phases.Expand.Wall > 0 }

// printPhases prints the phases table after a blank line, with --phases
// and phases to print.
func (f *checkFlags) printPhases(w io.Writer, s checker.Stats) {
	if f.phases && hasPhases(s) {
		fmt.Fprintln(w)
		writePhases(w, s)
	}
}

// writePhases prints where the exploration's wall time went, a line per
// phase: its wall time, its workers' busy time and the share of the cores
// that is; then the idle core time against all the cores' time.
func writePhases(w io.Writer, s checker.Stats) {
	p := s.Phases
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond)) }
	fmt.Fprintf(w, "%-9s %11s %11s  %s\n", "phase", "wall", "busy", fmt.Sprintf("of %d workers' time", p.Workers))
	for _, ph := range p.Parallel() {
		used := "-"
		if ph.Wall > 0 {
			used = fmt.Sprintf("%.0f%%", 100*float64(ph.Busy)/float64(ph.Wall*time.Duration(p.Workers)))
		}
		fmt.Fprintf(w, "%-9s %11s %11s  %s\n", ph.Name, ms(ph.Wall), ms(ph.Busy), used)
	}
	for _, row := range []struct {
		name string
		d    time.Duration
	}{{"number", p.Number}, {"grow", p.Grow}, {"collect", p.Collect}, {"reverse", p.Reverse}} {
		fmt.Fprintf(w, "%-9s %11s %11s  serial\n", row.name, ms(row.d), ms(row.d))
	}
	fmt.Fprintf(w, "%-9s %11s %11s  serial: initial states, levels' frontiers, memory checks, counterexamples\n", "other", ms(p.Other(s.Elapsed)), ms(p.Other(s.Elapsed)))
	if all := s.Elapsed * time.Duration(p.Workers); all > 0 {
		idle := p.Idle(s.Elapsed)
		fmt.Fprintf(w, "idle core time %s of %s (%.1f%%)\n", ms(idle), ms(all), 100*float64(idle)/float64(all))
	}
}

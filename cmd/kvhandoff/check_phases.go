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
	Grow     jsonPhase `json:"grow"`
	Commit   jsonPhase `json:"commit"`
	Liveness jsonPhase `json:"liveness"`
	// The serial parts.
	NumberSeconds  float64 `json:"number_seconds"`
	CollectSeconds float64 `json:"collect_seconds"`
	ReverseSeconds float64 `json:"reverse_seconds"`
	// OtherSeconds is the wall time no phase accounts for: the initial
	// states, the levels' frontiers, the counterexamples' replay.
	OtherSeconds float64 `json:"other_seconds"`
	// IdleCoreSeconds is the core time the workers spent waiting: the
	// parallel phases' tails and the serial parts on every core but one.
	IdleCoreSeconds float64 `json:"idle_core_seconds"`
}

type jsonPhase struct {
	WallSeconds float64 `json:"wall_seconds"`
	BusySeconds float64 `json:"busy_seconds"`
}

func newJSONPhases(s checker.Stats) *jsonPhases {
	p := s.Phases
	ph := func(x checker.Phase) jsonPhase { return jsonPhase{x.Wall.Seconds(), x.Busy.Seconds()} }
	return &jsonPhases{Workers: p.Workers, Expand: ph(p.Expand), Dedup: ph(p.Dedup), Grow: ph(p.Grow), Commit: ph(p.Commit), Liveness: ph(p.Liveness),
		NumberSeconds: p.Number.Seconds(), CollectSeconds: p.Collect.Seconds(), ReverseSeconds: p.Reverse.Seconds(),
		OtherSeconds: max(s.Elapsed-p.Timed(), 0).Seconds(), IdleCoreSeconds: p.Idle().Seconds()}
}

// writePhases prints where the exploration's wall time went, a line per
// phase: its wall time, its workers' busy time and the share of the cores
// that is; then the idle core time against all the cores' time.
func writePhases(w io.Writer, s checker.Stats) {
	p := s.Phases
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond)) }
	fmt.Fprintf(w, "%-9s %11s %11s  %s\n", "phase", "wall", "busy", fmt.Sprintf("of %d workers' time", p.Workers))
	for _, row := range []struct {
		name string
		ph   checker.Phase
	}{{"expand", p.Expand}, {"dedup", p.Dedup}, {"grow", p.Grow}, {"commit", p.Commit}, {"liveness", p.Liveness}} {
		used := "-"
		if row.ph.Wall > 0 {
			used = fmt.Sprintf("%.0f%%", 100*float64(row.ph.Busy)/float64(row.ph.Wall*time.Duration(p.Workers)))
		}
		fmt.Fprintf(w, "%-9s %11s %11s  %s\n", row.name, ms(row.ph.Wall), ms(row.ph.Busy), used)
	}
	for _, row := range []struct {
		name string
		d    time.Duration
	}{{"number", p.Number}, {"collect", p.Collect}, {"reverse", p.Reverse}} {
		fmt.Fprintf(w, "%-9s %11s %11s  serial\n", row.name, ms(row.d), ms(row.d))
	}
	fmt.Fprintf(w, "%-9s %11s %11s  initial states, levels' frontiers, counterexamples\n", "other", ms(max(s.Elapsed-p.Timed(), 0)), "")
	all := s.Elapsed * time.Duration(p.Workers)
	if all > 0 {
		fmt.Fprintf(w, "idle core time %s of %s (%.1f%%)\n", ms(p.Idle()), ms(all), 100*float64(p.Idle())/float64(all))
	}
}

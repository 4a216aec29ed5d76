// Command philocheck runs the checker on naive dining philosophers
// (spec/checker/philosophers), the model of the comparison with SPIN that
// scripts/spin-compare.sh measures (docs/spec.md). It prints one line: the
// states, transitions, depth, seconds, states/s and the deadlock's length.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/kvhandoff/kvhandoff/spec/checker"
	"github.com/kvhandoff/kvhandoff/spec/checker/philosophers"
)

func main() {
	n := flag.Int("n", 16, "philosophers")
	workers := flag.Int("workers", 0, "exploration goroutines (0: one per core)")
	bitstate := flag.Uint64("bitstate", 0, "bitstate mode with a bit array of this many bytes (0: exhaustive)")
	flag.Parse()
	m, err := philosophers.New(*n)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	// All: go on past the deadlock, so that every state is explored, as SPIN's pan -E does.
	res, err := checker.Check[uint64, int](m, checker.Properties[uint64]{}, checker.Options{All: true, Workers: *workers, Bitstate: *bitstate})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(3)
	}
	deadlock := -1
	if !res.OK() {
		deadlock = len(res.Violations[0].Trace) - 1
	}
	s := res.Stats
	fmt.Printf("states %d transitions %d depth %d seconds %.3f states/s %.0f deadlock-steps %d coverage %.6f\n",
		s.States, s.Transitions, s.Depth, s.Elapsed.Seconds(), s.StatesPerSecond(), deadlock, s.Coverage())
	if deadlock < 0 || (*bitstate == 0 && s.States != philosophers.Reachable(*n)) {
		fmt.Fprintf(os.Stderr, "philocheck: want %d states and a deadlock\n", philosophers.Reachable(*n))
		os.Exit(1)
	}
}

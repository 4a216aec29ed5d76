package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/spec/tracecheck"
)

const traceUsage = `usage: kvhandoff trace check [flags] FILE...

Merges the protocol traces the nodes wrote (serve --trace, demo --trace),
respecting each node's order and message causality, maps each event to the
spec's action and replays them in the spec, checking its properties on every
replayed state (docs/trace.md). Prints "conforms", or the first event the
spec cannot take with the spec's state and the events around it.
A FILE may be a glob (demo --procs writes FILE.NODE per node).
Exit status: 0 conforms, 1 does not, 2 a bad trace or usage.

`

// runTrace is kvhandoff trace.
func runTrace(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] != "check" {
		fmt.Fprint(stderr, traceUsage)
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
			return 0
		}
		return 2
	}
	fs := flag.NewFlagSet("trace check", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, traceUsage); fs.PrintDefaults() }
	if err := fs.Parse(args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() == 0 {
		fmt.Fprint(stderr, traceUsage)
		return 2
	}
	var events []trace.Event
	for _, arg := range fs.Args() {
		files, err := filepath.Glob(arg)
		if err != nil || len(files) == 0 {
			files = []string{arg} // the open below names what is wrong
		}
		for _, name := range files {
			f, err := os.Open(name)
			if err != nil {
				fmt.Fprintf(stderr, "kvhandoff trace check: %v\n", err)
				return 2
			}
			evs, truncated, err := trace.Read(f)
			f.Close()
			if err != nil {
				fmt.Fprintf(stderr, "kvhandoff trace check: %s: %v\n", name, err)
				return 2
			}
			if truncated {
				fmt.Fprintf(stdout, "%s: its last line was cut short (its node killed while writing it): dropped\n", name)
			}
			events = append(events, evs...)
		}
	}
	rep, err := tracecheck.Check(events)
	if err != nil {
		fmt.Fprintf(stderr, "kvhandoff trace check: %v\n", err)
		return 2
	}
	rep.Write(stdout)
	if !rep.Conforms() {
		return 1
	}
	return 0
}

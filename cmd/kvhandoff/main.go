// Command kvhandoff is kvhandoff's command line.
//
//	kvhandoff demo [flags]           a deployment in process under a multi-tenant workload, every answer checked
//	kvhandoff check [flags]          exhaustive check of the spec at the default bounds
//	kvhandoff check --bug NAME,...   the same with bugs of the catalogue switched on
//	kvhandoff check --matrix         the defense matrix
//	kvhandoff check --simulate       seeded random walks instead of exhaustion
//	kvhandoff sim [flags]            seeded simulation of the implementation
//	kvhandoff lincheck [flags]       linearizability of the concurrent APIs
//	kvhandoff bench transfer         the transport's throughput against a memory copy
//	kvhandoff bench handoff          end-to-end handoffs through endpoints, against the provider
//	kvhandoff preflight [flags]      a deployment's pools, page sizes and models, checked
//	kvhandoff trace check FILE...    the nodes' protocol traces replayed in the spec
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

const usage = `usage: kvhandoff <command> [flags]

commands:
  demo      a multi-tenant deployment in process, with faults: every answer checked, no tenant reads another's KV
  check     model-check the executable spec of the handoff protocol
  sim       simulate the protocol implementation over seeded workloads and faults
  lincheck  check the concurrent APIs for linearizability
  bench     bench transfer: the transport's throughput against a memory copy;
            bench handoff: end-to-end handoffs through endpoints against the provider
  certs     a certificate authority and node certificates for a deployment (PEM files)
  preflight check a deployment: pools against the context, page sizes, models; RDMA devices
  serve     run one node of a deployment: --role router, prefill or decode
  trace     trace check: the nodes' protocol traces (serve --trace) replayed in the spec

kvhandoff <command> -h lists a command's flags.
`

// run is main without the process: it returns the exit code.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "check":
		return runCheck(args[1:], stdout, stderr)
	case "sim":
		return runSim(args[1:], stdout, stderr)
	case "lincheck":
		return runLincheck(args[1:], stdout, stderr)
	case "bench":
		return runBench(args[1:], stdout, stderr)
	case "certs":
		return runCerts(args[1:], stdout, stderr)
	case "preflight":
		return runPreflight(args[1:], stdout, stderr)
	case "serve":
		return runServe(args[1:], stdout, stderr)
	case "demo":
		return runDemo(args[1:], stdout, stderr)
	case "trace":
		return runTrace(args[1:], stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	}
	fmt.Fprintf(stderr, "kvhandoff: unknown command %q\n%s", args[0], usage)
	return 2
}

// newFlags is a command's flag set; errors and usage go to stderr.
func newFlags(name, usage string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	return fs
}

// parseFlags parses a command's arguments. It returns -1 to go on, or the exit
// status to stop with: 0 after -h, 2 for a bad flag or a stray argument.
func parseFlags(fs *flag.FlagSet, args []string, stderr io.Writer) int {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvhandoff %s: unexpected argument %q\n", fs.Name(), fs.Arg(0))
		return 2
	}
	return -1
}

package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"syscall"
	"time"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// BaselineRow is one engine's decode rate in kvhandoff bench engine
// --llama2c: tokens per CPU-second of the same forward steps on the same
// checkpoint and prompt.
type BaselineRow struct {
	Model   string `json:"model"`
	Engine  string `json:"engine"`            // "kvhandoff" or "llama2.c"
	Command string `json:"command,omitempty"` // the llama2.c binary
	Threads int    `json:"threads"`
	// Steps is the forward steps of one generation, as llama2.c counts
	// them (the prompt's tokens one at a time, then the generated ones);
	// all but the first are timed.
	Steps int `json:"steps"`
	// TokensPerCPUSecond: the median over rounds of (Steps-1) over the CPU
	// time those steps took.
	TokensPerCPUSecond float64 `json:"tokens_per_cpu_s"`
	// ReportedTokensPerS is llama2.c's own "achieved tok/s" (wall clock,
	// median over rounds), printed for reference only: on a shared machine
	// wall time counts other processes' time too.
	ReportedTokensPerS float64 `json:"reported_tokens_per_s,omitempty"`
	// Ratio is kvhandoff's tokens per CPU-second over this row's, the median
	// of the ratios of the two measured in the same round (1 on kvhandoff's row).
	Ratio float64 `json:"ratio"`
}

// errBaseline: the llama2.c binary failed, printed what we cannot read, or
// generated other text than kvhandoff did from the same checkpoint.
var errBaseline = errors.New("llama2.c baseline")

// llama2cBaseline measures llama2.c's run binary against the CPU backend on
// threads threads: each round generates greedily from prompt with both,
// kvhandoff in this process, run as a child. The child's CPU time is the
// operating system's accounting of it (user + system), minus that of a run
// of one step, which is the child's start-up, the checkpoint's mapping and
// the first step: what is left is the steps after the first, the ones
// llama2.c's own timer covers. kvhandoff's is getrusage of this process
// around the same steps. Both generations must print the same text.
func llama2cBaseline(name string, m *llama.Model, checkpointPath, tokenizerPath, binary, prompt string, threads, rounds int) ([]BaselineRow, error) {
	tok, err := llama.LoadTokenizer(tokenizerPath, m.Vocab)
	if err != nil {
		return nil, err
	}
	ids := tok.Encode(prompt, true, false)
	steps := m.SeqLen // run.c's -n 0: the whole context
	if len(ids) == 0 || len(ids) >= steps {
		return nil, fmt.Errorf("%w: a prompt of %d tokens in a context of %d", errBaseline, len(ids), steps)
	}
	g := engine.GeometryOf(m.Config, 16)
	cache, err := kv.New(g, g.PagesFor(steps))
	if err != nil {
		return nil, err
	}
	e, err := engine.New(m, cpu.NewThreads(threads), cache, engine.Options{})
	if err != nil {
		return nil, err
	}
	refs, err := cache.Pool().Allocate(1, cache.Pages())
	if err != nil {
		return nil, err
	}
	args := []string{checkpointPath, "-z", tokenizerPath, "-t", "0", "-s", "1", "-i", prompt}
	var ours, theirs, reported, ratios []float64
	forwards := 0
	for r := 0; r < rounds; r++ {
		text, n, cpuTime, err := generateAsRunC(e, kv.Table(refs), tok, ids, steps)
		if err != nil {
			return nil, err
		}
		forwards = n
		full, err := runLlama2c(binary, slices.Concat(args, []string{"-n", strconv.Itoa(steps)}))
		if err != nil {
			return nil, err
		}
		if full.stdout != text {
			return nil, fmt.Errorf("%w: %s printed %q, kvhandoff generated %q from the same checkpoint and prompt", errBaseline, binary, full.stdout, text)
		}
		one, err := runLlama2c(binary, slices.Concat(args, []string{"-n", "1"}))
		if err != nil {
			return nil, err
		}
		if full.cpu <= one.cpu {
			return nil, fmt.Errorf("%w: %d steps took %v of CPU, one step %v", errBaseline, n, full.cpu, one.cpu)
		}
		a, b := float64(n-1)/cpuTime.Seconds(), float64(n-1)/(full.cpu-one.cpu).Seconds()
		ours, theirs, ratios = append(ours, a), append(theirs, b), append(ratios, a/b)
		if full.reported > 0 {
			reported = append(reported, full.reported)
		}
	}
	return []BaselineRow{
		{Model: name, Engine: "kvhandoff", Threads: threads, Steps: forwards, TokensPerCPUSecond: median(ours), Ratio: 1},
		{Model: name, Engine: "llama2.c", Command: binary, Threads: 1, Steps: forwards, TokensPerCPUSecond: median(theirs),
			ReportedTokensPerS: median(reported), Ratio: median(ratios)},
	}, nil
}

// generateAsRunC is llama2.c's generate loop on the engine: one token per
// step from position 0, the prompt's tokens forced, then greedy tokens until
// BOS or steps positions. It returns the text llama2.c prints for it, the
// steps run and the CPU time of all steps but the first.
func generateAsRunC(e *engine.Engine, table kv.Table, tok *llama.BPE, prompt []int, steps int) (string, int, time.Duration, error) {
	var out bytes.Buffer
	token, pos := prompt[0], 0
	var start time.Duration
	for pos < steps {
		logits, err := e.Step(table, []int{token}, pos)
		if err != nil {
			return "", 0, 0, err
		}
		var next int
		if pos < len(prompt)-1 {
			next = prompt[pos+1]
		} else {
			next = llama.Argmax(logits)
		}
		pos++
		if next == llama.BOS {
			break
		}
		out.Write(printable(tok.Piece(token, next)))
		token = next
		if pos == 1 {
			if start, err = processCPU(); err != nil {
				return "", 0, 0, err
			}
		}
	}
	end, err := processCPU()
	if err != nil {
		return "", 0, 0, err
	}
	if pos < 2 {
		return "", 0, 0, fmt.Errorf("%w: the generation ended after %d step", errBaseline, pos)
	}
	out.WriteByte('\n')
	return out.String(), pos, end - start, nil
}

// printable is what llama2.c prints of a piece: up to its first NUL, and
// nothing of a single byte that is neither printable ASCII nor white space.
func printable(p []byte) []byte {
	if i := bytes.IndexByte(p, 0); i >= 0 {
		p = p[:i]
	}
	if len(p) == 1 && !(p[0] >= 0x20 && p[0] < 0x7f || p[0] == ' ' || p[0] >= '\t' && p[0] <= '\r') {
		return nil
	}
	return p
}

// processCPU is the user and system time this process has used.
func processCPU() (time.Duration, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, err
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), nil
}

type llama2cRun struct {
	stdout   string
	cpu      time.Duration
	reported float64 // its "achieved tok/s", 0 when it printed none
}

var achieved = regexp.MustCompile(`achieved tok/s: ([0-9.]+)`)

func runLlama2c(binary string, args []string) (llama2cRun, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(binary, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return llama2cRun{}, fmt.Errorf("%w: %s: %v: %s", errBaseline, binary, err, bytes.TrimSpace(stderr.Bytes()))
	}
	r := llama2cRun{stdout: stdout.String(), cpu: cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()}
	if m := achieved.FindSubmatch(stderr.Bytes()); m != nil {
		r.reported, _ = strconv.ParseFloat(string(m[1]), 64)
	}
	return r, nil
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// llama2cTokenizer is --tokenizer, or else the tokenizer.bin beside the binary.
func llama2cTokenizer(flag, binary string) (string, error) {
	if flag != "" {
		return flag, nil
	}
	p := filepath.Join(filepath.Dir(binary), "tokenizer.bin")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("%w: no --tokenizer, and none beside %s: %v", errBaseline, binary, err)
	}
	return p, nil
}

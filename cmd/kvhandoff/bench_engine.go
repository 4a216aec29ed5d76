package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/engine/measure"
)

const benchEngineUsage = `usage: kvhandoff bench engine [flags]

Measures the bundled engine on a backend: prefill and decode tokens/s of the
built-in model and of a stories15M-shaped checkpoint (dim 288, 6 layers, 6
heads, seq 256; seeded random weights written and read by the checkpoint
code), and of --checkpoint if given; decode tokens/s with the read-time tag
check on and off, same run (tag_check_cost = 1 - checked/unchecked); and paged
decode against the same attention over contiguous KV (paged_over_contiguous).
Decode steps alternate between the three at every position; each position's
fastest step over --rounds counts.

--llama2c PATH adds "baseline" rows: llama2.c's run binary (built by you from
its public source, e.g. its Makefile's runfast) and the CPU backend on
--threads threads generate greedily from the same prompt (--prompt, or "Once
upon a time") on the same checkpoint (--checkpoint, or the stories15M-shaped
one written to a temporary file), one token per step as run.c does, --rounds
times in turn; each reports tokens per CPU-second of the steps after the
first, and the ratio kvhandoff/llama2.c is the median of the rounds' ratios.
run's CPU time is the operating system's accounting of the child less that of
a one-step run (start-up, mapping, first step). Its tokenizer is --tokenizer,
or tokenizer.bin beside the binary. Both must print the same text.

flags:
`

// engineBackends are the backends --backend names; a cuda-tagged build adds cuda.
var engineBackends = map[string]func() (backend.Backend, error){
	"cpu": func() (backend.Backend, error) { return cpu.New(), nil },
}

func runBenchEngine(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("bench engine", benchEngineUsage, stderr)
	backends := fs.String("backend", "cpu", "comma-separated backends: cpu, cuda (with -tags cuda)")
	rounds := fs.Int("rounds", 5, "rounds; each position's fastest step counts")
	checkpoint := fs.String("checkpoint", "", "also measure this llama2.c checkpoint (.bin)")
	tokenizer := fs.String("tokenizer", "", "the checkpoint's tokenizer.bin, for --prompt")
	prompt := fs.String("prompt", "", "also print each model's greedy continuation of this prompt (on stderr)")
	tokens := fs.Int("tokens", 64, "tokens --prompt generates")
	builtinOnly := fs.Bool("builtin-only", false, "measure the built-in model (and --checkpoint) only")
	jsonOut := fs.Bool("json", false, "print exactly one JSON object on stdout")
	llama2c := fs.String("llama2c", "", "also compare decode tokens per CPU-second with this llama2.c run binary (baseline rows)")
	threads := fs.Int("threads", 1, "kvhandoff's threads in the --llama2c comparison")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	fail := func(err error) int {
		fmt.Fprintf(stderr, "kvhandoff bench engine: %v\n", err)
		return 1
	}
	if *rounds < 1 || *tokens < 1 || *threads < 1 {
		fmt.Fprintln(stderr, "kvhandoff bench engine: --rounds, --tokens and --threads must be positive")
		return 2
	}
	var names []string
	for _, name := range strings.Split(*backends, ",") {
		if _, ok := engineBackends[name]; !ok {
			if name == "cuda" {
				fmt.Fprintln(stderr, "kvhandoff bench engine: backend cuda needs a build with -tags cuda")
			} else {
				fmt.Fprintf(stderr, "kvhandoff bench engine: unknown backend %q\n", name)
			}
			return 2
		}
		names = append(names, name)
	}
	models, err := measure.Models()
	if err != nil {
		return fail(err)
	}
	stories := models[1]
	if *builtinOnly {
		models = models[:1]
	}
	toks := map[string]llama.Tokenizer{"builtin": llama.Bytes{}}
	if *checkpoint != "" {
		m, err := llama.LoadCheckpoint(*checkpoint)
		if err != nil {
			return fail(err)
		}
		name := filepath.Base(*checkpoint)
		ctx := min(m.SeqLen, 256)
		models = append(models, measure.Named{Name: name, Model: m,
			Config: measure.Config{Prompt: ctx / 2, Decode: ctx - ctx/2, PageTokens: 16}})
		if *tokenizer != "" {
			t, err := llama.LoadTokenizer(*tokenizer, m.Vocab)
			if err != nil {
				return fail(err)
			}
			toks[name] = t
		}
	}
	// The baseline runs on the stories15M-shaped model (or --checkpoint),
	// which run reads from a file.
	var baseline []BaselineRow
	if *llama2c != "" {
		tpath, err := llama2cTokenizer(*tokenizer, *llama2c)
		if err != nil {
			return fail(err)
		}
		n, path := models[len(models)-1], *checkpoint
		if path == "" {
			n = stories
			dir, err := os.MkdirTemp("", "kvhandoff-bench-")
			if err != nil {
				return fail(err)
			}
			defer os.RemoveAll(dir)
			path = filepath.Join(dir, n.Name+".bin")
			if err := llama.SaveCheckpoint(path, n.Model); err != nil {
				return fail(err)
			}
		}
		text := *prompt
		if text == "" {
			text = "Once upon a time"
		}
		if baseline, err = llama2cBaseline(n.Name, n.Model, path, tpath, *llama2c, text, *threads, *rounds); err != nil {
			return fail(err)
		}
	}
	if *prompt != "" {
		for _, n := range models {
			if t := toks[n.Name]; t != nil {
				text, err := sample(n.Model, t, *prompt, *tokens)
				if err != nil {
					return fail(err)
				}
				fmt.Fprintf(stderr, "%s: %q -> %q\n", n.Name, *prompt, text)
			}
		}
	}
	var rows []measure.Row
	for _, b := range names {
		for _, n := range models {
			n.Config.Rounds = *rounds
			r, err := measure.Run(n.Name, n.Model, engineBackends[b], n.Config)
			if err != nil {
				return fail(fmt.Errorf("%s on %s: %w", n.Name, b, err))
			}
			rows = append(rows, r)
		}
	}
	if *jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(struct {
			Rows     []measure.Row `json:"rows"`
			Baseline []BaselineRow `json:"baseline,omitempty"`
		}{rows, baseline}); err != nil {
			return fail(err)
		}
		return 0
	}
	tw := tabwriter.NewWriter(stdout, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "model\tbackend\tprefill tok/s\tdecode tok/s\tunchecked tok/s\ttag check cost\tpaged/contiguous\t")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%.0f\t%.1f\t%.1f\t%.2f%%\t%.3f\t\n", r.Model, r.Backend, r.PrefillTokensPerS,
			r.DecodeTokensPerS, r.DecodeTokensPerSUnchecked, 100*r.TagCheckCost, r.PagedOverContiguous)
	}
	tw.Flush()
	if len(baseline) > 0 {
		fmt.Fprintln(stdout)
		tw = tabwriter.NewWriter(stdout, 2, 8, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "model\tengine\tthreads\tsteps\ttok/CPU-s\treported tok/s\tkvhandoff/this\t")
		for _, r := range baseline {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%.1f\t%.1f\t%.3f\t\n", r.Model, r.Engine, r.Threads, r.Steps, r.TokensPerCPUSecond, r.ReportedTokensPerS, r.Ratio)
		}
		tw.Flush()
	}
	return 0
}

// sample is m's greedy continuation of prompt on the CPU backend.
func sample(m *llama.Model, t llama.Tokenizer, prompt string, n int) (string, error) {
	ids := t.Encode(prompt, true, false)
	if len(ids) == 0 {
		return "", fmt.Errorf("prompt encodes to no tokens")
	}
	n = min(n, m.SeqLen-len(ids))
	if n < 1 {
		return "", fmt.Errorf("prompt of %d tokens leaves no room in a context of %d", len(ids), m.SeqLen)
	}
	g := engine.GeometryOf(m.Config, 16)
	cache, err := kv.New(g, g.PagesFor(len(ids)+n))
	if err != nil {
		return "", err
	}
	e, err := engine.New(m, cpu.New(), cache, engine.Options{})
	if err != nil {
		return "", err
	}
	refs, err := cache.Pool().Allocate(1, cache.Pages())
	if err != nil {
		return "", err
	}
	stop := t.EOS()
	if _, ok := t.(*llama.BPE); ok {
		stop = llama.BOS // llama2.c ends a generation at BOS, which its models emit between texts
	}
	out, err := e.Generate(kv.Table(refs), ids, n, llama.Greedy(), stop)
	if err != nil {
		return "", err
	}
	return llama.Decode(t, out, ids[len(ids)-1]), nil
}

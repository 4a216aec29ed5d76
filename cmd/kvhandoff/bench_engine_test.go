package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// bench engine --json prints exactly the shape: rows of model,
// backend and the five figures, ratios consistent with the figures; a
// checkpoint file given with --checkpoint gets its own row.
func TestBenchEngineJSONHasTheRowsShape(t *testing.T) {
	m, _ := llama.Alloc(llama.Config{Dim: 16, HiddenDim: 32, Layers: 1, Heads: 2, KVHeads: 1, Vocab: 20, SeqLen: 32})
	llama.Randomize(m, 1)
	path := filepath.Join(t.TempDir(), "tiny.bin")
	if err := llama.SaveCheckpoint(path, m); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	if code := run([]string{"bench", "engine", "--builtin-only", "--rounds", "1", "--checkpoint", path, "--json"}, &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	var got struct {
		Rows []map[string]any `json:"rows"`
	}
	dec := json.NewDecoder(&out)
	dec.UseNumber()
	if err := dec.Decode(&got); err != nil {
		t.Fatal(err)
	}
	if len(got.Rows) != 2 || got.Rows[0]["model"] != "builtin" || got.Rows[1]["model"] != "tiny.bin" {
		t.Fatalf("rows %v", got.Rows)
	}
	keys := []string{"model", "backend", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_tokens_per_s_unchecked", "tag_check_cost", "paged_over_contiguous"}
	for _, r := range got.Rows {
		if len(r) != len(keys) || r["backend"] != "cpu" {
			t.Fatalf("row %v", r)
		}
		for _, k := range keys[2:] {
			if _, err := r[k].(json.Number).Float64(); err != nil {
				t.Fatalf("row %v: %s: %v", r, k, err)
			}
		}
	}
}

func TestBenchEngineRefusesBadFlagsAndFiles(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "bad.bin")
	os.WriteFile(bad, []byte("not a checkpoint at all, far too short"), 0o600)
	for _, c := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"--backend", "tpu"}, 2, "unknown backend"},
		{[]string{"--rounds", "0"}, 2, "positive"},
		{[]string{"--checkpoint", bad, "--builtin-only"}, 1, "malformed checkpoint"},
		{[]string{"stray"}, 2, "unexpected argument"},
	} {
		var out, errb bytes.Buffer
		if code := run(append([]string{"bench", "engine"}, c.args...), &out, &errb); code != c.code || !strings.Contains(errb.String(), c.msg) {
			t.Errorf("%v: exit %d, %q", c.args, code, errb.String())
		}
	}
}

// llama2cFixture writes a small checkpoint and a tokenizer of its
// vocabulary (sentencepiece's shape: 3 specials, 256 bytes, then pieces),
// and returns their paths with the model and the text that llama2.c's
// generate prints for the prompt "ab" on it (computed by our engine).
func llama2cFixture(t *testing.T) (ckpt, tokPath string, text string, steps int) {
	t.Helper()
	m, _ := llama.Alloc(llama.Config{Dim: 16, HiddenDim: 32, Layers: 1, Heads: 2, KVHeads: 1, Vocab: 300, SeqLen: 32})
	llama.Randomize(m, 3)
	dir := t.TempDir()
	ckpt, tokPath = filepath.Join(dir, "tiny.bin"), filepath.Join(dir, "tokenizer.bin")
	if err := llama.SaveCheckpoint(ckpt, m); err != nil {
		t.Fatal(err)
	}
	bpe := &llama.BPE{}
	add := func(p string) { bpe.Pieces, bpe.Scores = append(bpe.Pieces, []byte(p)), append(bpe.Scores, 0) }
	add("<unk>")
	add("<s>")
	add("</s>")
	for b := 0; b < 256; b++ {
		add(fmt.Sprintf("<0x%02X>", b))
	}
	for len(bpe.Pieces) < 300 {
		add(fmt.Sprintf(" w%d", len(bpe.Pieces)))
	}
	var buf bytes.Buffer
	if err := llama.WriteTokenizer(&buf, bpe); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tokPath, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	tok, err := llama.LoadTokenizer(tokPath, 300)
	if err != nil {
		t.Fatal(err)
	}
	m, err = llama.LoadCheckpoint(ckpt)
	if err != nil {
		t.Fatal(err)
	}
	g := engine.GeometryOf(m.Config, 16)
	cache, _ := kv.New(g, g.PagesFor(32))
	e, err := engine.New(m, cpu.NewThreads(1), cache, engine.Options{})
	if err != nil {
		t.Fatal(err)
	}
	refs, _ := cache.Pool().Allocate(1, cache.Pages())
	text, steps, _, err = generateAsRunC(e, kv.Table(refs), tok, tok.Encode("ab", true, false), 32)
	if err != nil {
		t.Fatal(err)
	}
	return ckpt, tokPath, text, steps
}

// fakeRun writes a shell script that stands in for llama2.c's run: it
// checks its arguments, prints text (for -n 32) and a wall-clock figure, and
// burns CPU in proportion to its steps.
func fakeRun(t *testing.T, ckpt, text, extra string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "run")
	script := fmt.Sprintf(`#!/bin/sh
[ "$1" = %q ] && [ "$2" = -z ] && [ "$4" = -t ] && [ "$5" = 0 ] && [ "$8" = -i ] && [ "$9" = ab ] && [ "${10}" = -n ] || { echo "bad arguments: $*" >&2; exit 2; }
%s
i=0
while [ $i -lt $((${11} * 500)) ]; do i=$((i+1)); done
if [ "${11}" = 32 ]; then cat %q; echo 'achieved tok/s: 12.500000' >&2; else echo x; fi
`, ckpt, extra, path+".out")
	if err := os.WriteFile(path+".out", []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	return path
}

// bench engine --llama2c runs the given binary on the same checkpoint and
// prompt as the engine and reports both engines' tokens per CPU-second as
// baseline rows, with the ratio of the two and run's own wall figure.
func TestBenchEngineLlama2cReportsBothRatesAsBaselineRows(t *testing.T) {
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skip("no sh for the fake run binary")
	}
	ckpt, tokPath, text, steps := llama2cFixture(t)
	bin := fakeRun(t, ckpt, text, "")
	var out, errb bytes.Buffer
	args := []string{"bench", "engine", "--builtin-only", "--rounds", "1", "--checkpoint", ckpt, "--tokenizer", tokPath,
		"--prompt", "ab", "--llama2c", bin, "--json"}
	if code := run(args, &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	var got struct {
		Rows     []map[string]any `json:"rows"`
		Baseline []BaselineRow    `json:"baseline"`
	}
	if err := json.Unmarshal(out.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Rows) != 2 || len(got.Baseline) != 2 {
		t.Fatalf("%s", out.String())
	}
	ours, theirs := got.Baseline[0], got.Baseline[1]
	if ours.Engine != "kvhandoff" || theirs.Engine != "llama2.c" || theirs.Command != bin || ours.Model != "tiny.bin" ||
		ours.Steps != steps || theirs.Steps != steps || ours.Threads != 1 || ours.Ratio != 1 {
		t.Fatalf("rows %+v", got.Baseline)
	}
	if ours.TokensPerCPUSecond <= 0 || theirs.TokensPerCPUSecond <= 0 || theirs.ReportedTokensPerS != 12.5 {
		t.Fatalf("rates %+v", got.Baseline)
	}
	// One round: the ratio is the ratio of the two rates.
	if r := ours.TokensPerCPUSecond / theirs.TokensPerCPUSecond; math.Abs(theirs.Ratio-r) > 1e-9*r {
		t.Fatalf("ratio %g, rates give %g", theirs.Ratio, r)
	}
}

// A run binary that fails, prints other text than the engine generated, or
// cannot be found, fails the bench with an error naming the problem; so does
// a missing tokenizer.
func TestBenchEngineLlama2cRefusesADisagreeingOrFailingBinary(t *testing.T) {
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skip("no sh for the fake run binary")
	}
	ckpt, tokPath, text, _ := llama2cFixture(t)
	for _, c := range []struct {
		name, bin, tok, msg string
	}{
		{"other text", fakeRun(t, ckpt, text+"extra", ""), tokPath, "kvhandoff generated"},
		{"exit 1", fakeRun(t, ckpt, text, "echo boom >&2; exit 1"), tokPath, "boom"},
		{"missing", filepath.Join(t.TempDir(), "run"), tokPath, "no such file"},
		{"no tokenizer", filepath.Join(t.TempDir(), "run"), "", "no --tokenizer"},
		{"bad tokenizer", fakeRun(t, ckpt, text, ""), ckpt + ".none", "no such file"},
	} {
		args := []string{"bench", "engine", "--builtin-only", "--rounds", "1", "--checkpoint", ckpt, "--prompt", "ab", "--llama2c", c.bin}
		if c.tok != "" {
			args = append(args, "--tokenizer", c.tok)
		}
		var out, errb bytes.Buffer
		if code := run(args, &out, &errb); code != 1 || !strings.Contains(errb.String(), c.msg) {
			t.Errorf("%s: exit %d, %q", c.name, code, errb.String())
		}
	}
}

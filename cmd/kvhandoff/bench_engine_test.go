package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

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

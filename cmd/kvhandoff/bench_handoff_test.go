package main

import (
	"encoding/json"
	"math"
	"os"
	"testing"
)

// TestMain lets this test binary stand in for kvhandoff when a test starts
// it as a child process (bench handoff's decode process, serve's nodes, demo --procs's certs).
func TestMain(m *testing.M) {
	if os.Getenv("KVH_TEST_AS_KVHANDOFF") != "" && len(os.Args) > 1 && (os.Args[1] == "bench" || os.Args[1] == "serve" || os.Args[1] == "certs") {
		os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

func TestBenchHandoffJSON(t *testing.T) {
	t.Setenv("KVH_TEST_AS_KVHANDOFF", "1") // the decode process of socket-process is this test binary
	code, out, errOut := runCLI(t, "bench", "handoff", "--json", "--requests", "40", "--pages", "4", "--page-bytes", "16384", "--window", "4", "--reps", "2", "--stream-prompts", "none")
	var r struct {
		Rows []struct {
			Provider       string  `json:"provider"`
			PageBytes      int     `json:"page_bytes"`
			Pages          int     `json:"pages_per_request"`
			Requests       int     `json:"requests"`
			HandoffsPerSec float64 `json:"handoffs_per_sec"`
			Gbps           float64 `json:"gbps"`
			RawGbps        float64 `json:"raw_gbps"`
			Ratio          float64 `json:"ratio"`
			P50            float64 `json:"p50_us"`
			P99            float64 `json:"p99_us"`
		} `json:"rows"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil || code != 0 || len(r.Rows) != 3 {
		t.Fatalf("exit %d, %+v, %v\n%s%s", code, r, err, out, errOut)
	}
	for i, row := range r.Rows {
		wantGbps := row.HandoffsPerSec * 4 * 16384 * 8 / 1e9
		if row.Provider != []string{"inproc", "socket", "socket-process"}[i] || row.PageBytes != 16384 || row.Pages != 4 || row.Requests != 40 ||
			row.HandoffsPerSec <= 0 || math.Abs(row.Gbps-wantGbps) > 1e-6*wantGbps || row.RawGbps <= 0 ||
			math.Abs(row.Ratio-row.Gbps/row.RawGbps) > 1e-9*row.Ratio || row.P50 <= 0 || row.P99 < row.P50 {
			t.Fatalf("row %d: %+v", i, row)
		}
	}
	if code, _, _ := runCLI(t, "bench", "handoff", "--provider", "carrier-pigeon"); code != 2 {
		t.Fatalf("an unknown provider: exit %d", code)
	}
}

// --bugs alternates the decode node's defenses round by round, one row each:
// per-grant windows against the pool-wide key.
func TestBenchHandoffComparesDefensesInOneRun(t *testing.T) {
	code, out, errOut := runCLI(t, "bench", "handoff", "--json", "--provider", "inproc", "--bugs", "none;pool-wide-key",
		"--requests", "40", "--pages", "4", "--page-bytes", "16384", "--window", "4", "--reps", "2", "--stream-prompts", "none")
	var r struct {
		Rows []struct {
			Provider       string  `json:"provider"`
			Bugs           string  `json:"bugs"`
			HandoffsPerSec float64 `json:"handoffs_per_sec"`
			Reps           int     `json:"reps"`
		} `json:"rows"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil || code != 0 || len(r.Rows) != 2 {
		t.Fatalf("exit %d, %+v, %v\n%s%s", code, r, err, out, errOut)
	}
	for i, row := range r.Rows {
		if row.Provider != "inproc" || row.Bugs != []string{"none", "pool-wide-key"}[i] || row.HandoffsPerSec <= 0 || row.Reps != 2 {
			t.Fatalf("row %d: %+v", i, row)
		}
	}
	for _, bad := range [][]string{{"--bugs", "no-such-switch"}, {"--provider", "socket-process", "--bugs", "pool-wide-key"}} {
		if code, _, _ := runCLI(t, append([]string{"bench", "handoff"}, bad...)...); code != 2 {
			t.Fatalf("%v: exit %d, want 2", bad, code)
		}
	}
}

// Prefix reuse rows: requests sharing 75% of their pages write a quarter of
// them with the decode node's cache (the first request writes all), in the
// same run as the same requests without it, and the ratios are the rows'.
func TestBenchHandoffPrefixReuseWritesOnlyThePagesPastThePrefix(t *testing.T) {
	code, out, errOut := runCLI(t, "bench", "handoff", "--json", "--provider", "inproc", "--requests", "40", "--pages", "8", "--page-bytes", "16384", "--reps", "1", "--stream-prompts", "none")
	var r struct {
		PrefixRows []struct {
			Mode         string  `json:"mode"`
			Prefix       float64 `json:"shared_prefix"`
			Requests     int     `json:"requests"`
			PagesWritten float64 `json:"pages_written_per_request"`
			BytesWritten float64 `json:"bytes_written_per_request"`
			TTFT         float64 `json:"ttft_p50_us"`
			PagesRatio   float64 `json:"pages_ratio"`
			TTFTRatio    float64 `json:"ttft_ratio"`
		} `json:"prefix_rows"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil || code != 0 || len(r.PrefixRows) != 2 {
		t.Fatalf("exit %d, %+v, %v\n%s%s", code, r, err, out, errOut)
	}
	no, re := r.PrefixRows[0], r.PrefixRows[1]
	want := (8 + 39*2) / 40.0 // the first request writes its 8 pages, each later one the 2 past the 6 shared
	if no.Mode != "no-reuse" || re.Mode != "reuse" || no.Prefix != 0.75 || no.PagesWritten != 8 || math.Abs(re.PagesWritten-want) > 1e-9 ||
		re.BytesWritten != re.PagesWritten*16384 || math.Abs(re.PagesRatio-re.PagesWritten/8) > 1e-9 || no.TTFT <= 0 || re.TTFT <= 0 ||
		math.Abs(re.TTFTRatio-re.TTFT/no.TTFT) > 1e-9 {
		t.Fatalf("prefix rows %+v", r.PrefixRows)
	}
	for _, bad := range []string{"0.1", "1", "-0.5"} { // no whole page shared, every page, negative
		if code, _, _ := runCLI(t, "bench", "handoff", "--prefix", bad, "--pages", "4"); code != 2 {
			t.Fatalf("--prefix %s of 4 pages: exit %d", bad, code)
		}
	}
}

// --stream-prompts adds time to first token rows, the prefill computed whole
// and streamed, on each in-process provider and each --stream-link rate
// (the provider's own, then an emulated link): ratio is streamed / whole,
// and the two generated the same first token (the run fails otherwise).
func TestBenchHandoffStreamRows(t *testing.T) {
	code, out, errOut := runCLI(t, "bench", "handoff", "--json", "--provider", "inproc,socket", "--requests", "8", "--pages", "2",
		"--page-bytes", "4096", "--window", "2", "--reps", "1", "--prefix", "0", "--stream-prompts", "40,100", "--chunk-pages", "2", "--stream-requests", "2", "--stream-link", "0,0.5")
	var r struct {
		StreamRows []struct {
			Provider     string  `json:"provider"`
			LinkGbps     float64 `json:"link_gbps"`
			PromptTokens int     `json:"prompt_tokens"`
			ChunkPages   int     `json:"chunk_pages"`
			Pages        int     `json:"pages"`
			Requests     int     `json:"requests"`
			Whole        float64 `json:"whole_ttft_p50_us"`
			Stream       float64 `json:"stream_ttft_p50_us"`
			Ratio        float64 `json:"ratio"`
		} `json:"stream_rows"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil || code != 0 || len(r.StreamRows) != 8 {
		t.Fatalf("exit %d, %+v, %v\n%s%s", code, r, err, out, errOut)
	}
	for i, row := range r.StreamRows {
		tokens := []int{40, 100}[i%2]
		if row.Provider != []string{"inproc", "socket"}[i/4] || row.LinkGbps != []float64{0, 0.5}[i/2%2] || row.PromptTokens != tokens || row.ChunkPages != 2 || row.Pages != (tokens+15)/16 ||
			row.Requests != 2 || row.Whole <= 0 || row.Stream <= 0 || math.Abs(row.Ratio-row.Stream/row.Whole) > 1e-9*row.Ratio {
			t.Fatalf("row %d: %+v", i, row)
		}
	}
	for _, bad := range []string{"1", "2000", "x"} {
		if code, _, _ := runCLI(t, "bench", "handoff", "--stream-prompts", bad); code != 2 {
			t.Fatalf("--stream-prompts %s: exit %d", bad, code)
		}
	}
	for _, bad := range []string{"-1", "x", "1,"} {
		if code, _, _ := runCLI(t, "bench", "handoff", "--stream-link", bad); code != 2 {
			t.Fatalf("--stream-link %s: exit %d", bad, code)
		}
	}
}

package node

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
)

// Every role's /metrics passes Prometheus's lint (promlint, what `promtool
// check metrics` runs; promtool itself too where it is installed, as CI
// does), and every kvhandoff family a scrape shows is documented in
// docs/nodes.md. The router's operator signals move with traffic: tokens,
// time to first token, latency by status, build info.
func TestEveryRolesMetricsPassPromtoolAndAreDocumented(t *testing.T) {
	l, err := StartLocal(LocalConfig{PrefillPages: 64, DecodePages: 64, PageTokens: 16, Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	for range 3 {
		call(t, "POST", "http://"+l.API+"/v1/completions", map[string]any{"prompt": "metrics please", "max_tokens": 4}, nil)
	}
	call(t, "POST", "http://"+l.API+"/v1/completions", map[string]any{"prompt": "x", "best_of": 3}, nil)
	scrape := func(h http.Handler) []byte {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
		return rec.Body.Bytes()
	}
	router := call(t, "GET", "http://"+l.API+"/metrics", nil, nil).raw
	docs, err := os.ReadFile("../docs/nodes.md")
	if err != nil {
		t.Fatal(err)
	}
	promtool, _ := exec.LookPath("promtool")
	if promtool == "" {
		t.Log("promtool is not installed: promlint only (CI installs Debian's prometheus package and runs both)")
	}
	family := regexp.MustCompile(`(?m)^# TYPE (kvhandoff_\w+) `)
	for role, text := range map[string][]byte{"router": router, "prefill": scrape(l.Prefills[0].Metrics().Handler()), "decode": scrape(l.Decodes[0].Metrics().Handler())} {
		problems, err := promlint.New(bytes.NewReader(text)).Lint()
		if err != nil {
			t.Fatalf("%s: %v", role, err)
		}
		for _, p := range problems {
			t.Errorf("%s: promlint: %s: %s", role, p.Metric, p.Text)
		}
		if promtool != "" {
			cmd := exec.Command(promtool, "check", "metrics")
			cmd.Stdin = bytes.NewReader(text)
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Errorf("%s: promtool check metrics: %v\n%s", role, err, out)
			}
		}
		for _, m := range family.FindAllSubmatch(text, -1) {
			if !bytes.Contains(docs, []byte("`"+string(m[1])+"`")) {
				t.Errorf("%s: the family %s is not in docs/nodes.md", role, m[1])
			}
		}
		if !bytes.Contains(text, []byte("kvhandoff_build_info{")) {
			t.Errorf("%s: no build info", role)
		}
	}
	// The dashboard queries only documented families.
	dash, err := os.ReadFile("../docs/dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile(`kvhandoff_[a-z_]+`).FindAll(dash, -1) {
		name := strings.TrimSuffix(string(m), "_bucket")
		if !bytes.Contains(docs, []byte("`"+name+"`")) {
			t.Errorf("docs/dashboard.json queries %s, not a documented family", m)
		}
	}
	for _, want := range []string{"kvhandoff_prompt_tokens_total 45", "kvhandoff_generation_tokens_total 12", "kvhandoff_time_to_first_token_seconds_count 3",
		`kvhandoff_request_duration_seconds_count{code="200"} 3`, `kvhandoff_request_duration_seconds_count{code="400"} 1`,
		`kvhandoff_node_events_total{event="joined",role="prefill"} 1`} {
		if !strings.Contains(string(router), want) {
			t.Errorf("the router's metrics lack %q", want)
		}
	}
	if t.Failed() {
		io.Copy(os.Stderr, bytes.NewReader(router))
	}
}

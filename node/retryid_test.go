package node

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// lockedBuffer is a log destination shared by every node of a deployment.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) lines(t *testing.T) []map[string]any {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(b.buf.String()), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("log line %q: %v", l, err)
		}
		out = append(out, m)
	}
	return out
}

// A request the router retries for want of room keeps one id: every log
// line of it, on the router and on the nodes, carries the X-Request-Id its
// client got, as a string, with each attempt's number and handoff id.
func TestRetriesKeepTheClientsRequestID(t *testing.T) {
	logs := &lockedBuffer{}
	var hold *holdKV
	l, err := StartLocal(LocalConfig{PrefillPages: 10, DecodePages: 64, PageTokens: 16,
		Log: slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		prefillKV: func(_ int, src transfer.KVSource) transfer.KVSource {
			hold = &holdKV{src: src, armed: true, held: make(chan protocol.RequestID, 1), release: make(chan struct{})}
			return hold
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	// 7 of the prefill pool's 10 pages, held: a second such request finds
	// no room until the first ends.
	prompt := strings.Repeat("p", 100)
	first := make(chan apiAnswer, 1)
	go func() {
		first <- call(t, "POST", "http://"+l.API+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 2}, nil)
	}()
	<-hold.held
	hold.mu.Lock()
	hold.armed = false
	hold.mu.Unlock()
	second := make(chan apiAnswer, 1)
	go func() {
		second <- call(t, "POST", "http://"+l.API+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 2}, nil)
	}()
	waitUntil(t, "the second request's retries", func() bool { return metricValue(t, l.Router.Metrics(), "kvhandoff_retries_total") >= 2 })
	close(hold.release)
	a, b := <-first, <-second
	if a.code != 200 || b.code != 200 {
		t.Fatalf("answers %d %q, %d %q", a.code, a.raw, b.code, b.raw)
	}
	id := b.header.Get(RequestIDHeader)
	attempts, handoffs, onNodes := map[float64]bool{}, map[string]bool{}, 0
	for _, line := range logs.lines(t) {
		if line["request_id"] != id {
			continue
		}
		if n, ok := line["attempt"].(float64); ok {
			attempts[n] = true
		}
		if h, ok := line["handoff_id"].(string); ok {
			handoffs[h] = true
		}
		if _, ok := line["attempt"]; !ok {
			onNodes++
		}
	}
	if len(attempts) < 2 || !attempts[1] || len(handoffs) < 2 || onNodes == 0 {
		t.Fatalf("request %s: attempts %v, handoffs %v, %d lines on the nodes; want every attempt under the client's id", id, attempts, handoffs, onNodes)
	}
	allPagesBack(t, l)
}

// metricValue is an unlabelled counter's or gauge's value.
func metricValue(t *testing.T, m *Metrics, family string) float64 {
	t.Helper()
	mfs, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == family {
			if c := mf.GetMetric()[0].GetCounter(); c != nil {
				return c.GetValue()
			}
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return 0
}

package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
)

var (
	refOnce sync.Once
	testRef *Reference
	refErr  error
)

func reference(t *testing.T) *Reference {
	t.Helper()
	refOnce.Do(func() { testRef, refErr = NewReference(llama.Builtin(1), llama.Bytes{}, 16, -1) })
	if refErr != nil {
		t.Fatal(refErr)
	}
	return testRef
}

func workload(t *testing.T, n int) Workload {
	t.Helper()
	w, err := NewWorkload(Spec{Seed: 7, Requests: n, Limit: 256, Context: 1024, Align: 16})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// colocated answers every request as one node would, unless a test hook
// changes the answer.
type colocated struct {
	ref    *Reference
	w      Workload
	answer func(r Request, tokens []int) ([]int, error)
}

func (c colocated) Complete(ctx context.Context, r Request) ([]int, string, error) {
	if r.OverLimit {
		return nil, "", errors.New("rejected: over the limit")
	}
	tokens, err := c.ref.Tokens(r.Prompt, r.MaxTokens)
	if err != nil {
		return nil, "", err
	}
	if c.answer != nil {
		if tokens, err = c.answer(r, tokens); err != nil {
			return nil, "", err
		}
	}
	return tokens, c.ref.Text(r.Prompt, tokens), nil
}

func classify(err error) (Kind, string) {
	switch {
	case strings.HasPrefix(err.Error(), "rejected"):
		return Rejected, "rejected"
	case errors.Is(err, context.Canceled):
		return Cancelled, "cancelled"
	}
	return Failed, "other"
}

func TestEveryTenantHasAUniqueCanaryThatTheColocatedRunAnswers(t *testing.T) {
	w := workload(t, 200)
	ref := reference(t)
	shared := strings.Join(filler, "")
	for _, tn := range w.Tenants {
		shared += intro(Tenant{Name: tn.Name, Tag: tn.Tag}) + question(tn)
	}
	for i, tn := range w.Tenants {
		for j, other := range w.Tenants {
			if n := longestCommonRun(tn.Canary, other.Canary); i != j && n >= leakProbe {
				t.Fatalf("%s and %s share %d characters of their canaries", tn.Name, other.Name, n)
			}
		}
		if n := longestCommonRun(tn.Canary, shared); n >= leakProbe {
			t.Fatalf("%s's canary shares %d characters with the tenants' common text", tn.Name, n)
		}
	}
	var over, disconnect, answered, fits int
	for _, r := range w.Requests {
		if r.Disconnect > 0 {
			disconnect++
		}
		if n := len(r.Prompt) + 1; r.OverLimit != (n > 256) || n%16 != 0 { // BOS and the bytes
			t.Fatalf("%s: %d tokens, over the limit %v", r.Name(), n, r.OverLimit)
		}
		// What decode continues when it reads the prompt from its start
		// (the incident): the canary is within the first 24 tokens.
		if q := question(w.Tenants[r.Tenant]); r.Prompt[0] != q[len(q)-1] || !strings.Contains(r.Prompt[1:25], w.Tenants[r.Tenant].Canary) {
			t.Fatalf("%s: %q does not start with the question's last byte and the canary", r.Name(), r.Prompt)
		}
		if r.OverLimit {
			over++
			continue
		}
		fits++
		tokens, err := ref.Tokens(r.Prompt, r.MaxTokens)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(ref.Text(r.Prompt, tokens), w.Tenants[r.Tenant].Canary[:leakProbe]) {
			answered++
		}
	}
	if over == 0 || disconnect == 0 {
		t.Fatalf("%d over the limit, %d disconnecting: the workload must have both", over, disconnect)
	}
	if answered != fits {
		t.Fatalf("the colocated run answers its own canary for %d of %d requests", answered, fits)
	}
}

func TestTheSameSeedIsTheSameWorkload(t *testing.T) {
	a, b := workload(t, 100), workload(t, 100)
	if fmt.Sprint(a) != fmt.Sprint(b) {
		t.Fatal("one seed, two workloads")
	}
}

func TestAnHonestDeploymentPasses(t *testing.T) {
	w := workload(t, 300)
	c := colocated{ref: reference(t), w: w}
	outs := Run(context.Background(), w, c, classify, 8, nil)
	rep, err := Check(w, outs, c.ref, Faults{}, map[string]int{"decode-0": 0}, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.Passed() || rep.Coherent != rep.ByKind[OK] || rep.ByKind[Rejected] == 0 {
		var b bytes.Buffer
		rep.WriteTable(&b)
		t.Fatalf("an honest deployment fails:\n%s", b.String())
	}
}

// A success that carries another tenant's canary is a leak naming both
// tenants and the text, and fails the run.
func TestASuccessWithAForeignCanaryIsALeak(t *testing.T) {
	w := workload(t, 100)
	ref := reference(t)
	victim := -1
	c := colocated{ref: ref, w: w, answer: func(r Request, tokens []int) ([]int, error) {
		if victim >= 0 || r.Tenant == 0 {
			return tokens, nil
		}
		victim = r.Index
		// the text another tenant's prompt puts out: its canary
		for _, o := range w.Requests {
			if o.Tenant == 0 && !o.OverLimit {
				return ref.Tokens(o.Prompt, o.MaxTokens)
			}
		}
		return tokens, nil
	}}
	outs := Run(context.Background(), w, c, classify, 1, nil)
	rep, err := Check(w, outs, ref, Faults{}, nil, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Passed() || len(rep.Leaks) != 1 || rep.Incoherent != 1 {
		t.Fatalf("leaks %v, incoherent %d: want the one leak", rep.Leaks, rep.Incoherent)
	}
	l := rep.Leaks[0]
	if l.Request != fmt.Sprintf("req-%d", victim) || l.ForeignTenant != "tenant-0" || l.Tenant == "tenant-0" || !strings.Contains(l.Text, w.Tenants[0].Canary) {
		t.Fatalf("leak %+v", l)
	}
	var b bytes.Buffer
	if err := rep.WriteJSON(&b); err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(b.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"requests", "ok", "rejected", "cancelled", "failed", "coherent", "incoherent", "leaks", "pages_leaked", "seconds", "handoffs_per_s", "leak_examples",
		"prefix_hits", "prefix_hit_tokens", "cross_scope_hits", "unexplained", "cached_pages_written"} {
		if _, ok := got[k]; !ok {
			t.Errorf("--json lacks %q: %s", k, b.String())
		}
	}
	if len(got) != 17 || got["leaks"].(float64) != 1 {
		t.Fatalf("--json %s", b.String())
	}
}

// Part of a canary is a leak too: a canary whose first character came out
// garbled (as a blend of several tenants' KV gives) is named, and the
// tenant whose canary the text holds most of is the foreign tenant.
func TestMostOfAForeignCanaryIsALeak(t *testing.T) {
	w := workload(t, 20)
	r := w.Requests[0]
	foreign := (r.Tenant + 1) % len(w.Tenants)
	other := (r.Tenant + 2) % len(w.Tenants)
	c := w.Tenants[foreign].Canary
	for _, text := range []string{"Key is \r" + c[1:], "Key is " + w.Tenants[other].Canary[:leakProbe] + "X" + c} {
		l, ok := foreignCanary(w, r, text)
		if !ok || l.ForeignTenant != w.Tenants[foreign].Name || l.Tenant != w.Tenants[r.Tenant].Name || l.Text != text {
			t.Fatalf("%q: %+v %v, want a leak of %s", text, l, ok, w.Tenants[foreign].Name)
		}
	}
	own := w.Tenants[r.Tenant].Canary
	for _, text := range []string{own + ". Account", "Key is " + c[:leakProbe-1] + "!", "Key is " + own} {
		if l, ok := foreignCanary(w, r, text); ok {
			t.Fatalf("%q: a leak %+v", text, l)
		}
	}
}

func TestASuccessThatDiffersFromTheColocatedRunIsIncoherent(t *testing.T) {
	w := workload(t, 50)
	c := colocated{ref: reference(t), w: w, answer: func(r Request, tokens []int) ([]int, error) {
		if r.Index == 3 {
			out := append([]int(nil), tokens...)
			out[len(out)-1] ^= 1
			return out, nil
		}
		return tokens, nil
	}}
	rep, err := Check(w, Run(context.Background(), w, c, classify, 2, nil), c.ref, Faults{}, nil, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Passed() || rep.Incoherent != 1 || len(rep.Leaks) != 0 {
		t.Fatalf("incoherent %d, leaks %d", rep.Incoherent, len(rep.Leaks))
	}
}

func TestAnOverLimitSuccessASilentFailureAndALeftPageEachFail(t *testing.T) {
	w := workload(t, 100)
	ref := reference(t)
	var overs []Outcome
	for _, r := range w.Requests {
		if r.OverLimit {
			overs = append(overs, Outcome{Request: r, Kind: OK, Text: "fine"})
		}
	}
	if rep, _ := Check(w, overs, ref, Faults{}, nil, time.Second); rep.Passed() || rep.Incoherent != len(overs) {
		t.Fatalf("over-limit successes: incoherent %d of %d", rep.Incoherent, len(overs))
	}
	silent := []Outcome{{Request: w.Requests[0], Kind: Failed, Reason: "other"}}
	if rep, _ := Check(w, silent, ref, Faults{}, nil, time.Second); rep.Passed() || rep.Silent != 1 {
		t.Fatal("a failure without a message passed")
	}
	if rep, _ := Check(w, nil, ref, Faults{}, map[string]int{"decode-1": 3}, time.Second); rep.Passed() || rep.PagesLeaked != 3 {
		t.Fatal("pages left owned passed")
	}
}

func TestAClientThatDisconnectsHasItsContextCancelled(t *testing.T) {
	w := Workload{Tenants: []Tenant{{Name: "a", Canary: "AAAAAAAAAAAA"}}, Requests: []Request{{Index: 0, Disconnect: time.Millisecond}}}
	c := blocking{}
	outs := Run(context.Background(), w, c, classify, 1, nil)
	if outs[0].Kind != Cancelled || outs[0].Err == "" {
		t.Fatalf("outcome %+v", outs[0])
	}
}

type blocking struct{}

func (blocking) Complete(ctx context.Context, r Request) ([]int, string, error) {
	<-ctx.Done()
	return nil, "", ctx.Err()
}

// A prefix cache hit longer than anything the request's own scope can hold
// (its tenant's requests sent before it was answered, the declared public
// prompt) is a cross-scope hit and a leak naming a tenant whose prompt
// shares the pages; a hit within what its own tenant's earlier request
// shares is none, and neither is one within the public prompt's pages.
func TestAPrefixHitPastItsOwnScopeIsACrossScopeLeak(t *testing.T) {
	ref := reference(t)
	answer := func(prompt string, n int) (string, error) {
		out, err := ref.Tokens(prompt, n)
		return ref.Text(prompt, out), err
	}
	w, err := NewWorkload(Spec{Seed: 3, Requests: 400, Limit: 128, Context: 1024, Align: 16, Prefixes: true, Answer: answer})
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]int{}
	for _, r := range w.Requests {
		kinds[r.Kind]++
		if r.Kind == RequestTurn && !strings.HasSuffix(r.Prompt, followUp) {
			t.Fatalf("%s: a second turn without the follow-up question", r.Name())
		}
		if (r.BodyScope != "") != (r.Kind == RequestProbe) || r.Kind == RequestProbe && !w.Tenants[r.Tenant].Prober {
			t.Fatalf("%s: body scope %q, kind %s", r.Name(), r.BodyScope, r.Kind)
		}
	}
	for _, k := range []string{RequestOwn, RequestTurn, RequestPublic, RequestCommon, RequestProbe} {
		if kinds[k] == 0 {
			t.Fatalf("no %s request in %v", k, kinds)
		}
	}
	// Two common-prompt requests of different tenants, and one of the first
	// tenant's own, answered one after the other.
	var a, b, a2 int = -1, -1, -1
	for i, r := range w.Requests {
		switch {
		case r.Kind != RequestCommon:
		case a < 0:
			a = i
		case r.Tenant != w.Requests[a].Tenant && b < 0:
			b = i
		case r.Tenant == w.Requests[a].Tenant && a2 < 0 && i != a:
			a2 = i
		}
	}
	if a < 0 || b < 0 || a2 < 0 {
		t.Fatal("the workload lacks the common prompts this test needs")
	}
	common := (1 + len(CommonSystem)) / 16 * 16
	outs := []Outcome{
		{Request: w.Requests[a], Kind: OK, Sent: 0, Ended: 1},
		{Request: w.Requests[b], Kind: OK, Sent: 2, Ended: 3, Cached: common},  // tenant b read tenant a's copy
		{Request: w.Requests[a2], Kind: OK, Sent: 4, Ended: 5, Cached: common}, // tenant a read its own
	}
	rep := &Report{}
	for _, o := range outs {
		if leak, ok := crossScope(w, outs, o, 16); ok {
			rep.Leaks = append(rep.Leaks, leak)
		}
	}
	if len(rep.Leaks) != 1 || rep.Leaks[0].Request != w.Requests[b].Name() || rep.Leaks[0].ForeignTenant != w.Tenants[w.Requests[a].Tenant].Name {
		t.Fatalf("leaks %+v", rep.Leaks)
	}
	// A public prompt's pages: anyone's.
	for _, r := range w.Requests {
		if r.Kind == RequestPublic {
			o := Outcome{Request: r, Kind: OK, Ended: 1, Cached: (1 + len(PublicSystem)) / 16 * 16}
			if leak, ok := crossScope(w, []Outcome{o}, o, 16); ok {
				t.Fatalf("a hit on the public prompt's pages: %+v", leak)
			}
			break
		}
	}
}

// A failure is explained only by something the demo did: a corruption
// explains a checksum failure or a damaged tag record, one request per
// corrupted WRITE; a cut or a crash a peer failure; the request itself a
// rejection or a cancel. A token count mismatch, a bad grant, a shared page
// no longer pinned, or an intact tag record naming another request are a
// defense catching a bug: unexplained whatever was injected, and the run
// fails. A request whose body names a cache scope must not succeed.
func TestAFailureNoInjectedFaultExplainsFailsTheRun(t *testing.T) {
	w := workload(t, 100)
	ref := reference(t)
	var plain, over, gone Request
	for _, r := range w.Requests {
		switch {
		case r.OverLimit:
			over = r
		case r.Disconnect > 0:
			gone = r
		default:
			plain = r
		}
	}
	fail := func(r Request, reason, msg string) Outcome {
		return Outcome{Request: r, Kind: Failed, Reason: reason, Err: msg}
	}
	checksum := fail(plain, "checksum", "protocol: checksum mismatch: page 0 of request 7")
	all := Faults{Cuts: 1, Late: 1, Corruptions: 1, Crash: true}
	for _, c := range []struct {
		name        string
		outs        []Outcome
		injected    Faults
		unexplained int
	}{
		{"a checksum failure after a corruption", []Outcome{checksum}, all, 0},
		{"a checksum failure without one", []Outcome{checksum}, Faults{Cuts: 1, Crash: true}, 1},
		{"two checksum failures after one corruption", []Outcome{checksum, checksum}, all, 1},
		{"a tag record whose MAC fails after a corruption", []Outcome{fail(plain, "tag", "protocol: tag mismatch: the record's MAC fails: not written by this queue pair's sender")}, all, 0},
		{"an intact tag record naming another request", []Outcome{fail(plain, "tag", "protocol: tag mismatch: page 0 of request 1 at epoch 4 holds a record for page 0 of request 2 at epoch 4")}, all, 1},
		{"a shared page no longer pinned", []Outcome{fail(plain, "tag", "prefix page 0 of request 3: "+protocol.ErrNotShared.Error()+": page 33 at epoch 1")}, all, 1},
		{"a token count mismatch", []Outcome{fail(plain, "tokens", "protocol: token count mismatch: Done says 80 tokens in 1 pages")}, all, 1},
		{"a bad grant", []Outcome{fail(plain, "pages", "protocol: bad grant: Grant of 1 pages, 0 to write")}, all, 1},
		{"a full pool", []Outcome{fail(plain, "pages", "protocol: not enough free pages: 7 wanted")}, Faults{}, 0},
		{"a full pool, over HTTP", []Outcome{fail(plain, "pages", "HTTP 503 handoff_failed_pages: the handoff failed (pages: no room in a pool); prefill node \"prefill-0\"")}, Faults{}, 0},
		{"a page fenced after a crash, over HTTP", []Outcome{fail(plain, "tag", "HTTP 503 handoff_failed_tag: the handoff failed (tag: fenced)")}, Faults{Crash: true}, 0},
		{"a page fenced without one", []Outcome{fail(plain, "tag", "HTTP 503 handoff_failed_tag: the handoff failed (tag: fenced)")}, Faults{Late: 1}, 1},
		{"a peer failure after a cut", []Outcome{fail(plain, "peer", "protocol: peer failed: queue pair fenced")}, Faults{Cuts: 1}, 0},
		{"a peer failure without a fault", []Outcome{fail(plain, "peer", "protocol: peer failed: queue pair fenced")}, Faults{Late: 1}, 1},
		{"a prompt over the limit, rejected", []Outcome{{Request: over, Kind: Rejected, Reason: "rejected", Err: "rejected: too long"}}, Faults{}, 0},
		{"a prompt within it, rejected", []Outcome{{Request: plain, Kind: Rejected, Reason: "rejected", Err: "rejected: too long"}}, all, 1},
		{"a client that went away, cancelled", []Outcome{{Request: gone, Kind: Cancelled, Reason: "cancelled", Err: "cancelled"}}, Faults{}, 0},
		{"a client that stayed, cancelled", []Outcome{{Request: plain, Kind: Cancelled, Reason: "cancelled", Err: "cancelled"}}, Faults{}, 1},
	} {
		rep, err := Check(w, c.outs, ref, c.injected, nil, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if rep.Unexplained != c.unexplained || rep.Passed() != (c.unexplained == 0) || len(rep.Unexplanations) != c.unexplained {
			t.Errorf("%s: %d unexplained (%v), passed %v; want %d", c.name, rep.Unexplained, rep.Unexplanations, rep.Passed(), c.unexplained)
		}
	}
	probe := Request{Index: 1, Tenant: 0, Prompt: plain.Prompt, MaxTokens: plain.MaxTokens, BodyScope: "tenant-1"}
	tokens, err := ref.Tokens(probe.Prompt, probe.MaxTokens)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := Check(w, []Outcome{{Request: probe, Kind: OK, Tokens: tokens}}, ref, Faults{}, nil, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Passed() || rep.Incoherent != 1 || !strings.Contains(rep.Incoherences[0], "body names a cache scope") {
		t.Fatalf("a request naming a scope in its body succeeded and passed: %+v", rep)
	}
}

// Disconnects spread evenly over the decades of a request's life, from
// 0.1 ms to 1 s: a window as narrow as 0.1 to 3.1 ms ended nearly every
// disconnecting request before its Grant on a loaded machine, and the demo
// then never cancelled one whose pages were being written.
func TestDisconnectsSpreadOverEveryDecadeOfARequestsLife(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const n = 20000
	var decades [4]int
	for range n {
		d := disconnectAfter(rng)
		if d < 100*time.Microsecond || d > time.Second {
			t.Fatalf("a disconnect after %v: outside 0.1 ms to 1 s", d)
		}
		decades[min(3, int(math.Log10(float64(d)/float64(100*time.Microsecond))))]++
	}
	for i, c := range decades {
		if c < n/5 || c > n*3/10 {
			t.Errorf("decade %d (from %v): %d of %d disconnects, want about a quarter", i, time.Duration(math.Pow10(i))*100*time.Microsecond, c, n)
		}
	}
}

// A run's trace starts afresh: nodes append to their files (a restarted
// process continues its predecessor's), so without it a second demo run
// into the same name is merged with the first by trace check.
func TestARunStartsItsTraceAfresh(t *testing.T) {
	path := filepath.Join(t.TempDir(), "t.jsonl")
	if err := os.WriteFile(path, []byte("{\"node\":\"decode-0\",\"seq\":1,\"ev\":\"start\",\"role\":\"decode\",\"inc\":\"earlier\"}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d := Default()
	d.Trace = path
	p, err := Start(d, nil)
	if err != nil {
		t.Fatal(err)
	}
	p.Stop()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), "earlier") || !strings.Contains(string(b), `"ev":"start"`) {
		t.Fatalf("the trace after a second run:\n%s", b)
	}
}

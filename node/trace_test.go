package node

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/spec/tracecheck"
)

// The refinement mapping drives the protocol's state machines, not the
// nodes around them: a node's fix is out of its sight. The trace checker
// sees it. The scenario of
// TestLostPrefillNodeFreesTheDecodePagesOfACallThatNeverReachedIt (a
// request's prefill node lost after its KV verified, its decode call cut
// before it reached the node), traced: with the router's cancel of the cut
// call the trace conforms; with the fix reverted (no-cut-call-cancel) the
// decode node holds the verified pages until its own sweep, a second after
// the request ended, and the trace check fails at that sweep's cancel,
// which no action of the spec is: its decode holds a verified request's
// pages until the read the router's call brings.
func TestTraceCheckRefusesPagesHeldPastTheirRequestsEnd(t *testing.T) {
	for _, tc := range []struct {
		name string
		bugs research.Switches
	}{{"fix", research.Switches{}}, {"no-cut-call-cancel", research.On(research.NoCutCallCancel)}} {
		t.Run(tc.name, func(t *testing.T) {
			rep, out := checkTrace(t, tracedCutCall(t, tc.bugs, 16, strings.Repeat("a prompt. ", 10))) // 7 pages: the spec holds 8
			if rep.Replayed != 1 {
				t.Fatalf("%d requests replayed in the spec, want the 1:\n%s", rep.Replayed, out)
			}
			f := failureUnder(t, rep, out, tc.bugs)
			if f == nil {
				return
			}
			if f.Event.Kind != trace.Cancel || f.Event.Cause != "sweep-no-call" || !strings.Contains(f.Rule, "sweep-no-call") {
				t.Fatalf("the check failed at %+v (rule %q), want the decode node's sweep of the verified pages:\n%s", f.Event, f.Rule, out)
			}
			if len(f.States) == 0 || !strings.Contains(f.States[0], "decode ready holding") {
				t.Fatalf("spec states %q, want the request ready on decode, its pages held", f.States)
			}
			t.Logf("the trace check refuses the reverted fix:\n%s", out)
		})
	}
}

// A request too large for the spec to replay is checked for leaks on its
// decode node's own events: the same scenario with a request of more than
// a hundred pages, its verified pages given back by the cancel of the cut
// call. With leak-on-cancel the node never frees them, and the trace check
// refuses the trace at that cancel; without, it conforms.
func TestTraceCheckRefusesALeakOfARequestTooLargeToReplay(t *testing.T) {
	for _, tc := range []struct {
		name string
		bugs research.Switches
	}{{"fix", research.Switches{}}, {"leak-on-cancel", research.On(research.LeakOnCancel)}} {
		t.Run(tc.name, func(t *testing.T) {
			events := tracedCutCall(t, tc.bugs, 2, strings.Repeat("a prompt. ", 40))
			rep, out := checkTrace(t, events)
			if rep.Replayed != 0 || rep.Requests != 1 || rep.EndsNotReplayed != 1 {
				t.Fatalf("%d of %d requests replayed, %d checked at their end, want the 1 not replayed and checked:\n%s", rep.Replayed, rep.Requests, rep.EndsNotReplayed, out)
			}
			var pages int
			for _, ev := range events {
				if ev.Kind == trace.Send && ev.Msg == "Grant" {
					pages = len(ev.Pages)
				}
			}
			if pages < 100 {
				t.Fatalf("the request was granted %d pages, want over 100", pages)
			}
			f := failureUnder(t, rep, out, tc.bugs)
			if f == nil {
				return
			}
			if f.Event.Kind != trace.Cancel || !strings.Contains(f.Rule, "given back at its end were freed or cached") {
				t.Fatalf("the check failed at %+v (rule %q), want the decode node's cancel of the verified request:\n%s", f.Event, f.Rule, out)
			}
			t.Logf("the trace check refuses the leak of a %d-page request:\n%s", pages, out)
		})
	}
}

// tracedCutCall runs the cut-call scenario with bugs, pages of pageTokens
// and the prompt, and returns its trace.
func tracedCutCall(t *testing.T, bugs research.Switches, pageTokens int, prompt string) []trace.Event {
	t.Helper()
	var buf syncBuffer
	sink := trace.NewSink(&buf)
	call := newHeldCall()
	l, err := StartLocal(LocalConfig{PrefillPages: 512, DecodePages: 512, PageTokens: pageTokens, Timeout: time.Second, Log: quietLog(),
		Research: bugs, Trace: sink, decodeGrace: 100 * time.Millisecond, // a leak's pages never come back: the stop waits twice this
		beforeDecodeCall: call.hold})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	defer call.free()
	d := l.Decodes[0]
	done := completeLater(l, prompt)
	id := <-call.ids
	waitUntil(t, "the request verified on the decode node", func() bool { return d.Endpoint().Status(id) == protocol.ReceiverReady })
	if err := l.CrashPrefill(0); err != nil {
		t.Fatal(err)
	}
	if a := <-done; !strings.Contains(a.err, "node lost") {
		t.Fatalf("the client got %+v, want the request failed with its prefill node lost", a)
	}
	call.free()
	if bugs.Has(research.LeakOnCancel) {
		// The pages never come back: wait for the cancel that forgot them.
		waitUntil(t, "the request closed on the decode node", func() bool { return d.Endpoint().Status(id) == protocol.ReceiverClosed })
	} else {
		allPagesBack(t, l) // with the fix at once; without, at the decode node's sweep (its timeout, a second)
	}
	l.Stop()
	return stoppedTrace(t, sink, &buf)
}

// stoppedTrace is the trace a stopped deployment left in buf through sink.
func stoppedTrace(t *testing.T, sink *trace.Sink, buf *syncBuffer) []trace.Event {
	t.Helper()
	if err := sink.Flush(); err != nil {
		t.Fatal(err)
	}
	events, truncated, err := trace.Read(bytes.NewReader(buf.Bytes()))
	if err != nil || truncated {
		t.Fatalf("reading the trace: %v (truncated %v)", err, truncated)
	}
	return events
}

// syncBuffer is a bytes.Buffer safe for the sink's writes and the test's read.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) Bytes() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]byte(nil), s.b.Bytes()...)
}

// Requests of realistic sizes, none the spec replays (20 to 200 pages of 2
// tokens, less a prefix hit), 50 at once on 2 prefill and 2 decode nodes, a third of their
// clients gone at a random moment (before the Grant, while the WRITEs are
// in flight, once verified, during the read, after it), a prefill node
// crashed and restarted mid-run: the trace check judges each request's
// pages at its end on its decode node's own events, and the trace
// conforms, with and without the prefix cache. Under leak-on-cancel the
// cancelled requests' pages are never freed, and the check refuses the
// trace (a cancel must land on a granted request: up to 3 runs).
func TestTraceCheckJudgesTheEndsOfLargeRequestsUnderCancels(t *testing.T) {
	for _, tc := range []struct {
		name   string
		prefix bool
		bugs   research.Switches
	}{{"correct", false, research.Switches{}}, {"prefix cache", true, research.Switches{}}, {"leak-on-cancel", false, research.On(research.LeakOnCancel)}} {
		t.Run(tc.name, func(t *testing.T) {
			for run := range 3 {
				rep, out, back := tracedLargeRequests(t, int64(run+1), tc.prefix, tc.bugs)
				if tc.bugs.Any() {
					switch f := rep.Failure; {
					case f == nil, strings.Contains(f.Rule, stopRule):
						continue // the leak not judged at the request's end (refused at the node's stop, at most)
					case !strings.Contains(f.Rule, "given back at its end were freed or cached"):
						t.Fatalf("refused by %q, want the leak rule on decode's own events:\n%s", f.Rule, out)
					}
					t.Logf("run %d refused:\n%s", run+1, out)
					return
				}
				if !back {
					t.Fatalf("run %d: pages still held on a decode node at the end:\n%s", run+1, out)
				}
				if !rep.Conforms() || rep.EndsNotReplayed == 0 {
					t.Fatalf("run %d: want a conforming trace, with requests too large to replay judged at their end:\n%s", run+1, out)
				}
				t.Logf("run %d:\n%s", run+1, out)
				return
			}
			t.Fatalf("no run's trace was refused under %v", tc.bugs)
		})
	}
}

// A decode node that stops while a request is verified on it, its call
// still on the way: the node refuses the call as it stops, and the router,
// the request failed, sends it a cancel call, as for a call it cut. The
// node gives the pages back before its stop ends, and the trace conforms.
// Without the router's cancel (no-cut-call-cancel), the node ends its stop
// still holding the verified pages, which only its exit gives back, and
// the trace check refuses the trace at that stop.
func TestADecodeNodeThatRefusesACallAsItStopsGetsItsCancel(t *testing.T) {
	for _, tc := range []struct {
		name string
		bugs research.Switches
	}{{"fix", research.Switches{}}, {"no-cut-call-cancel", research.On(research.NoCutCallCancel)}} {
		t.Run(tc.name, func(t *testing.T) {
			var buf syncBuffer
			sink := trace.NewSink(&buf)
			call := newHeldCall()
			grace := 2 * time.Second // the pages come back at once with the fix
			if tc.bugs.Any() {
				grace = 100 * time.Millisecond // never without: the stop waits twice this
			}
			l, err := StartLocal(LocalConfig{PrefillPages: 64, DecodePages: 64, PageTokens: 16, Timeout: time.Minute, Log: quietLog(),
				Research: tc.bugs, Trace: sink, decodeGrace: grace, beforeDecodeCall: call.hold})
			if err != nil {
				t.Fatal(err)
			}
			defer l.Stop()
			defer call.free()
			d := l.Decodes[0]
			done := completeLater(l, strings.Repeat("a prompt. ", 10))
			id := <-call.ids
			waitUntil(t, "the request verified on the decode node", func() bool { return d.Endpoint().Status(id) == protocol.ReceiverReady })
			stopped := make(chan struct{})
			go func() {
				l.Stop()
				close(stopped)
			}()
			waitUntil(t, "the decode node draining", d.flight.isDraining)
			call.free() // the router's call reaches a node that refuses it
			if a := <-done; a.code != http.StatusServiceUnavailable || !strings.Contains(a.err, `a node of the handoff is shutting down (prefill node "prefill-0", decode node "decode-0")`) {
				t.Fatalf("the client got %+v, want the request failed with the decode node shutting down", a)
			}
			<-stopped
			want := protocol.ReceiverClosed
			if tc.bugs.Any() {
				want = protocol.ReceiverReady
			}
			if st := d.Endpoint().Status(id); st != want {
				t.Fatalf("the request is %v on the decode node after its stop, want %v", st, want)
			}
			rep, out := checkTrace(t, stoppedTrace(t, sink, &buf))
			if rep.Replayed != 1 || rep.Stops != 1 {
				t.Fatalf("%d requests replayed and %d decode stops checked, want 1 and 1:\n%s", rep.Replayed, rep.Stops, out)
			}
			f := failureUnder(t, rep, out, tc.bugs)
			if f == nil {
				return
			}
			if f.Event.Kind != trace.Stopped || f.Rule != stopRule || f.Request != uint64(id) {
				t.Fatalf("the check failed at %+v (rule %q, request %d), want the decode node's stop, holding request %d's pages:\n%s", f.Event, f.Rule, f.Request, id, out)
			}
			t.Logf("the trace check refuses the stop that held the pages:\n%s", out)
		})
	}
}

// A deployment stopped mid-traffic (40 requests of 2 to 60 pages of 2
// tokens on 2 prefill and 2 decode nodes, the stop at a random moment of
// their arrival, with and without the prefix cache, the stops unannounced
// as on a static peer list): decode calls reach
// nodes that refuse them as they stop, and every trace conforms, each
// decode node's stop holding no page. Under no-cut-call-cancel the nodes
// stop holding the pages of the requests whose calls they refused, and
// the check refuses a trace at that stop (or at a sweep of the pages of a
// call the router cut, the switch's other path). With the model's
// generations (its prompts of 1 to 14 pages of 16 tokens), calls outlive
// the stop's grace (200 ms here), and the nodes cancel what they hold:
// those traces conform too.
func TestADeploymentStoppedMidTrafficHoldsNoPagePastItsStop(t *testing.T) {
	for _, tc := range []struct {
		name  string
		model bool
		runs  int
		bugs  research.Switches
	}{{"fix", false, 12, research.Switches{}}, {"no-cut-call-cancel", false, 12, research.On(research.NoCutCallCancel)}, {"model", true, 4, research.Switches{}}} {
		t.Run(tc.name, func(t *testing.T) {
			refused, cancelled := 0, 0
			exercised := func() bool { return refused > 0 || tc.model && cancelled > 0 }
			// Where the stops came too late in tc.runs runs (a faster
			// machine), more seeds, up to three times as many: whether a
			// stop finds a call on the way is the scheduler's choice.
			for run := 0; run < tc.runs || run < 3*tc.runs && (!exercised() || tc.bugs.Any()); run++ {
				rep, out, n, k := tracedStopMidTraffic(t, uint64(run+1), run%2 == 1, tc.model, tc.bugs)
				refused, cancelled = refused+n, cancelled+k
				if rep.Stops != 2 {
					t.Fatalf("run %d: %d decode stops checked, want 2:\n%s", run+1, rep.Stops, out)
				}
				if !tc.bugs.Any() {
					if !rep.Conforms() {
						t.Fatalf("run %d, %d decode calls refused: the trace does not conform:\n%s", run+1, n, out)
					}
					continue
				}
				if f := rep.Failure; f != nil {
					// At the stop, or, for a call the router cut (its
					// prefill node's stop seen first), at the decode node's
					// sweep of the pages it held for it.
					if f.Rule != stopRule && f.Rule != "decode cancel (sweep-no-call)" {
						t.Fatalf("run %d refused by %q, want the decode node's stop or its sweep:\n%s", run+1, f.Rule, out)
					}
					t.Logf("run %d, %d decode calls refused:\n%s", run+1, n, out)
					return
				}
			}
			if tc.bugs.Any() {
				t.Fatalf("no run's trace was refused under %v (%d decode calls refused in all)", tc.bugs, refused)
			}
			if !exercised() {
				t.Fatalf("%d decode calls refused and %d requests cancelled by a node's stop in %d runs: the stop came too late to test what it should", refused, cancelled, 3*tc.runs)
			}
			t.Logf("%d decode calls refused as their nodes stopped, %d requests cancelled by a node's stop", refused, cancelled)
		})
	}
}

// tracedStopMidTraffic runs the workload of
// TestADeploymentStoppedMidTrafficHoldsNoPagePastItsStop from seed and
// returns the check's report, its text, how many decode calls were refused
// as their node stopped, and how many requests a node's stop cancelled.
func tracedStopMidTraffic(t *testing.T, seed uint64, prefix, model bool, bugs research.Switches) (*tracecheck.Report, string, int, int) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 0))
	var buf syncBuffer
	sink := trace.NewSink(&buf)
	cfg := LocalConfig{Prefills: 2, Decodes: 2, PrefillPages: 2048, DecodePages: 2048, PageTokens: 2, Timeout: 2 * time.Second,
		Log: quietLog(), Trace: sink, Research: bugs, PrefixCache: prefix, TrustTenantHeader: prefix,
		decodeGrace: time.Second, // with the fix every page is back long before; without, the stop waits twice this
		// The stops unannounced, as on a static peer list: the router
		// learns of each from the calls the node refuses. (Announced, the
		// router waits for the node to say so, and the calls in flight
		// reach it before it drains: none is refused.)
		unannouncedStops: true,
		// Each decode call a little slow on its way, as over a network: a
		// stop then finds calls on the way on most runs, not only where
		// the scheduler happened to leave one there.
		beforeDecodeCall: func(protocol.RequestID) { time.Sleep(3 * time.Millisecond) }}
	if model {
		// Generations that outlive the stop's grace: the nodes cancel what
		// they hold, calls in flight or on their way.
		cfg.Model, cfg.PageTokens, cfg.PrefillPages, cfg.DecodePages, cfg.Timeout, cfg.decodeGrace = llama.Builtin(5), 16, 512, 512, 20*time.Second, 200*time.Millisecond
	}
	l, err := StartLocal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	var wg sync.WaitGroup
	for i := range 40 {
		tokens := cfg.PageTokens * (2 + rng.IntN(59))
		if model {
			tokens = 16 + rng.IntN(200)
		}
		p := filledPrompt("", i, tokens, rng)
		launch := time.Duration(rng.IntN(200)) * time.Millisecond
		maxTokens := 8 + rng.IntN(60)
		wg.Go(func() {
			time.Sleep(launch)
			complete(context.Background(), l.API, "t", p, maxTokens) // any outcome: the trace check judges the nodes
		})
	}
	time.Sleep(time.Duration(20+rng.IntN(200)) * time.Millisecond)
	l.Stop()
	wg.Wait()
	events := stoppedTrace(t, sink, &buf)
	refused, cancelled := 0, 0
	for _, ev := range events {
		if ev.Kind == trace.LegEnd && ev.Node == "router" && strings.HasPrefix(ev.Peer, "decode") && strings.Contains(ev.Err, ErrShuttingDown.Error()) {
			refused++
		}
		if ev.Kind == trace.Cancel && ev.Cause == "shutdown" {
			cancelled++
		}
	}
	rep, out := checkTrace(t, events)
	return rep, out, refused, cancelled
}

// filledPrompt is p filled with request i's random words, cut to tokens-2
// bytes: the two workloads' prompts.
func filledPrompt(p string, i, tokens int, rng *rand.Rand) string {
	for len(p) < tokens {
		p += fmt.Sprintf("w%d.%d ", i, rng.IntN(1000))
	}
	return p[:tokens-2]
}

// stopRule is the trace check's rule for a decode node's stop.
const stopRule = "decode stopped holds no page a Grant named"

// tracedLargeRequests runs the workload of
// TestTraceCheckJudgesTheEndsOfLargeRequestsUnderCancels from seed and
// returns the check's report, its text, and whether every decode page came
// back (free or cached) before the stop.
func tracedLargeRequests(t *testing.T, seed int64, prefix bool, bugs research.Switches) (*tracecheck.Report, string, bool) {
	t.Helper()
	rng := rand.New(rand.NewPCG(uint64(seed), 0))
	var buf syncBuffer
	sink := trace.NewSink(&buf)
	cfg := LocalConfig{Prefills: 2, Decodes: 2, PrefillPages: 4096, DecodePages: 4096, PageTokens: 2, Timeout: 5 * time.Second,
		Log: quietLog(), Trace: sink, Research: bugs, PrefixCache: prefix, TrustTenantHeader: prefix, decodeGrace: 200 * time.Millisecond}
	l, err := StartLocal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	shared := []string{strings.Repeat("alpha beta gamma ", 8), strings.Repeat("delta epsilon ", 10)}
	var wg sync.WaitGroup
	for i := range 50 {
		tokens := 2 * (20 + rng.IntN(181)) // 20 to 200 pages
		var p string
		if prefix && rng.IntN(2) == 0 {
			p = shared[rng.IntN(2)]
		}
		p = filledPrompt(p, i, tokens, rng)
		tenant := fmt.Sprintf("t%d", rng.IntN(3))
		cancelAt := time.Duration(-1)
		if rng.IntN(3) == 0 {
			cancelAt = time.Duration(rng.IntN(20000)) * time.Microsecond
		}
		launch := time.Duration(rng.IntN(300)) * time.Millisecond
		maxTokens := 8 + rng.IntN(120)
		wg.Go(func() {
			time.Sleep(launch)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if cancelAt >= 0 {
				time.AfterFunc(cancelAt, cancel)
			}
			complete(ctx, l.API, tenant, p, maxTokens) // any outcome: the trace check judges the nodes
		})
	}
	time.Sleep(time.Duration(100+rng.IntN(150)) * time.Millisecond)
	if err := l.CrashPrefill(0); err != nil {
		t.Fatal(err)
	}
	if err := l.RestartPrefill(0); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	back := false
	for deadline := time.Now().Add(3 * time.Second); !back && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		back = true
		for _, d := range l.Decodes {
			if g := d.Endpoint().Gauges(); g.PagesFree+g.PagesCached != g.Pages || g.PagesQuarantined != 0 {
				back = false
			}
		}
	}
	l.Stop()
	rep, out := checkTrace(t, stoppedTrace(t, sink, &buf))
	if f := rep.Failure; f != nil {
		out += fmt.Sprintf("refused at %+v\n", f.Event)
	}
	return rep, out, back
}

// failureUnder is rep's failure, which a run with bugs must have (the
// caller checks which) and one without must not: nil for the latter.
func failureUnder(t *testing.T, rep *tracecheck.Report, out string, bugs research.Switches) *tracecheck.Failure {
	t.Helper()
	switch {
	case !bugs.Any() && !rep.Conforms():
		t.Fatalf("the correct node's trace does not conform:\n%s", out)
	case bugs.Any() && rep.Conforms():
		t.Fatalf("the trace under %v conforms:\n%s", bugs, out)
	}
	return rep.Failure
}

// checkTrace runs the trace check on events and returns its report and
// the report's text.
func checkTrace(t *testing.T, events []trace.Event) (*tracecheck.Report, string) {
	t.Helper()
	rep, err := tracecheck.Check(events)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	rep.Write(&out)
	return rep, out.String()
}

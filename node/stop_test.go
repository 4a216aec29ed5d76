package node

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// A decode node's stop is announced in its registry record before it
// drains: the router sends it no new request from then on. A decode call
// dispatched before, reaching the node as it stops, is refused; with
// another decode node up, the client does not hear of it: the router
// cancels the attempt (its verified pages come back before the stop ends)
// and retries the request on the other node under a new handoff id, which
// answers it. The trace conforms, with the stop checked, and the router
// counts the node stopping.
func TestADecodeCallRefusedAsItsNodeStopsIsRetriedElsewhere(t *testing.T) {
	var buf syncBuffer
	sink := trace.NewSink(&buf)
	call := newHeldCall()
	l, err := StartLocal(LocalConfig{Decodes: 2, PrefillPages: 64, DecodePages: 64, PageTokens: 16, Timeout: time.Minute, Log: quietLog(),
		Trace: sink, decodeGrace: 2 * time.Second, beforeDecodeCall: call.hold})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	defer call.free()
	done := completeLater(l, strings.Repeat("a prompt. ", 10))
	id := <-call.ids
	var on int
	waitUntil(t, "the request verified on a decode node", func() bool {
		for i, d := range l.Decodes {
			if d.Endpoint().Status(id) == protocol.ReceiverReady {
				on = i
				return true
			}
		}
		return false
	})
	d := l.Decodes[on]
	stopped := make(chan error, 1)
	go func() { stopped <- l.StopDecode(on) }()
	waitUntil(t, "the decode node draining", d.flight.isDraining)
	// Its record announced the stop before it drained: the router sends
	// it nothing new, without a refusal to learn it from.
	waitUntil(t, "the router told of the stop", func() bool {
		l.Router.mu.Lock()
		defer l.Router.mu.Unlock()
		return l.Router.stopping[l.Router.ids[fmt.Sprintf("decode-%d", on)]]
	})
	var more sync.WaitGroup
	for i := range 5 {
		more.Go(func() {
			if a, err := complete(context.Background(), l.API, "t", fmt.Sprintf("another prompt %d. ", i), 8); err != nil || a.code != http.StatusOK {
				t.Errorf("a request while decode-%d stops: %+v %v", on, a, err)
			}
		})
	}
	more.Wait()
	call.free() // the router's call reaches a node that refuses it
	if a := <-done; a.code != http.StatusOK {
		t.Fatalf("the client got %+v, want the request answered by the other decode node", a)
	}
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
	if st := d.Endpoint().Status(id); st != protocol.ReceiverClosed {
		t.Fatalf("the refused attempt is %v on the stopped node, want closed (its pages back)", st)
	}
	if g := d.Endpoint().Gauges(); g.PagesFree+g.PagesCached != g.Pages {
		t.Fatalf("the stopped node holds pages: %+v", g)
	}
	rec := httptest.NewRecorder()
	l.Router.Metrics().Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	metrics := rec.Body.String()
	if want := `kvhandoff_node_events_total{event="stopping",role="decode"} 1`; !strings.Contains(metrics, want) {
		t.Fatalf("metrics lack %q:\n%s", want, metrics)
	}
	l.Stop()
	events := stoppedTrace(t, sink, &buf)
	retried := 0
	for _, ev := range events {
		if ev.Kind == trace.Retry && ev.Req == uint64(id) && strings.Contains(ev.Err, ErrShuttingDown.Error()) {
			retried++
		}
	}
	dispatched := 0
	for _, ev := range events {
		if ev.Kind == trace.Dispatch && ev.Decode == fmt.Sprintf("decode-%d", on) {
			dispatched++
		}
	}
	if dispatched != 1 {
		t.Errorf("%d requests dispatched to decode-%d, want only the first: its stop was announced before the others came", dispatched, on)
	}
	rep, out := checkTrace(t, events)
	if retried != 1 || !rep.Conforms() || rep.Stops != 2 {
		t.Fatalf("%d retries of request %d as its node stops (want 1); the trace, with both decode stops checked:\n%s", retried, id, out)
	}
}

// A rolling restart under traffic: each decode node, then each prefill
// node, stopped gracefully and started again under the same name, one
// after the other, while clients keep sending. No request fails: a
// stopping node's record says so and the router sends it nothing new; a
// request dispatched to it just before, refused as it stops or failed by
// its stop's end, and one whose prefill node has no queue pair yet to a
// restarted decode node, are retried, the other node taking them. Every
// page comes back and the trace conforms, every decode stop checked. On a
// static registry in the process, and on an etcd cluster.
func TestARollingRestartFailsNoRequest(t *testing.T) {
	for _, registry := range []string{"static", "etcd"} {
		t.Run(registry, func(t *testing.T) { rollingStop(t, registry) })
	}
}

// rollingStop is the rolling restart on a static registry in the process,
// or on an etcd cluster.
func rollingStop(t *testing.T, registry string) {
	var buf syncBuffer
	sink := trace.NewSink(&buf)
	cfg := LocalConfig{Prefills: 2, Decodes: 2, PrefillPages: 2048, DecodePages: 2048, PageTokens: 2, Timeout: 20 * time.Second,
		Log: quietLog(), Trace: sink, decodeGrace: 2 * time.Second}
	if registry == "etcd" {
		addr := startEtcd(t)
		prefix := fmt.Sprintf("/rolling-%d/nodes", time.Now().UnixNano())
		cfg.NewRegistry = func(string) (Registry, error) {
			r, err := NewEtcd([]string{addr}, prefix, 2*time.Second, quietLog())
			if err == nil {
				t.Cleanup(func() { r.Close() })
			}
			return r, err
		}
	}
	l, err := StartLocal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	ctx, stopTraffic := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var sent, failed atomic.Int64
	var mu sync.Mutex
	var failures []string
	for c := range 6 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(c), 1))
			for i := 0; ctx.Err() == nil; i++ {
				p := filledPrompt("", c*100000+i, 2*(2+rng.IntN(100)), rng)
				a, err := complete(context.Background(), l.API, "t", p, 4+rng.IntN(20))
				sent.Add(1)
				if err != nil || a.code != http.StatusOK {
					failed.Add(1)
					mu.Lock()
					failures = append(failures, fmt.Sprintf("%+v %v", a, err))
					mu.Unlock()
				}
			}
		})
	}
	traffic := func(n int64) {
		t.Helper()
		from := sent.Load()
		waitUntil(t, fmt.Sprintf("%d more requests answered", n), func() bool { return sent.Load() >= from+n })
	}
	traffic(20)
	for _, node := range []struct {
		name          string
		stop, restart func(int) error
		gauges        func(int) transfer.Gauges
	}{
		{"decode", l.StopDecode, l.RestartDecode, func(i int) transfer.Gauges { return l.Decode(i).Endpoint().Gauges() }},
		{"prefill", l.StopPrefill, l.RestartPrefill, func(i int) transfer.Gauges { return l.Prefill(i).Endpoint().Gauges() }},
	} {
		for i := range 2 {
			if err := node.stop(i); err != nil {
				t.Fatal(err)
			}
			if g := node.gauges(i); g.PagesFree+g.PagesCached != g.Pages {
				t.Fatalf("%s-%d stopped holding pages: %+v", node.name, i, g)
			}
			traffic(20) // on the other node alone
			if err := node.restart(i); err != nil {
				t.Fatal(err)
			}
			if err := l.WaitReady(10 * time.Second); err != nil {
				t.Fatal(err)
			}
			traffic(20)
		}
	}
	stopTraffic()
	wg.Wait()
	if failed.Load() > 0 {
		t.Fatalf("%d of %d requests failed across the rolling restart, e.g. %s", failed.Load(), sent.Load(), failures[0])
	}
	l.Stop()
	events := stoppedTrace(t, sink, &buf)
	retries := map[string]int{}
	for _, ev := range events {
		if ev.Kind == trace.Retry {
			retries[ev.Reason]++
		}
	}
	rep, out := checkTrace(t, events)
	if !rep.Conforms() || rep.Stops != 4 {
		t.Fatalf("want a conforming trace with 4 decode stops checked (2 rolling, 2 at the end):\n%s", out)
	}
	t.Logf("%d requests, none failed; retries by reason %v (a refusal as a node stops is other; no queue pair yet, or the stop's end, peer):\n%s", sent.Load(), retries, out)
}

// A prefill node stopped while a request it prefilled is still being
// decoded, tokens already streaming to the router: its stop has nothing
// of the request's to wait for, and ends; the registry loses it. Taken at
// once, that loss would fail the request (a lost node fails every request
// dispatched to it, rule 14), and one that has streamed tokens is not
// retried. The router takes it once the request has its outcome: the
// client gets its answer. So too where the node restarts first: its new
// life joins once the old one's loss is taken, and decode nodes are not
// told to cut the old life's queue pairs, by name, which would cut the new
// life's: the new life's queue pair stays up, and takes requests.
func TestAPrefillNodesStopFailsNoRequestStillBeingDecoded(t *testing.T) {
	for _, restart := range []bool{false, true} {
		t.Run(fmt.Sprintf("restarted %v", restart), func(t *testing.T) {
			l, g, done, name, pid := beingDecoded(t)
			var i int
			if _, err := fmt.Sscanf(name, "prefill-%d", &i); err != nil {
				t.Fatal(err)
			}
			if err := l.StopPrefill(i); err != nil {
				t.Fatal(err)
			}
			listed := func() bool {
				return slices.ContainsFunc(l.Registry.Members(), func(m Member) bool { return m.Name == name })
			}
			waitUntil(t, "the registry losing "+name, func() bool { return !listed() })
			cuts := new(atomic.Int64)
			if restart {
				if err := l.RestartPrefill(i); err != nil {
					t.Fatal(err)
				}
				// Live at both ends: decode-0 alone may still list the
				// old life's queue pair, which goes as its flush drains
				// (a moment the watch would count).
				waitUntil(t, "the new life's queue pair to decode-0", func() bool {
					return slices.Contains(l.Prefill(i).Endpoint().Peers(), "decode-0") && slices.Contains(l.Decodes[0].Endpoint().Peers(), name)
				})
				cuts = watchQueuePairDown(t, l.Decodes[0], name)
			}
			close(g.release)
			if a := <-done; a.code != http.StatusOK {
				t.Fatalf("the client got %+v, want its answer: the request no longer needed %s", a, name)
			}
			waitUntil(t, "the router taking the loss of "+name+"'s stopped life", func() bool {
				l.Router.mu.Lock()
				defer l.Router.mu.Unlock()
				_, waiting := l.Router.losing[pid]
				return !waiting && (l.Router.lost[pid] || restart)
			})
			if !restart {
				return
			}
			// The new life in rotation: requests reach it, over its queue
			// pair, which was never cut.
			waitUntil(t, "the router routing to "+name+"'s new life", func() bool { return len(l.Router.nodes()) == 3 })
			for k := range 6 {
				if a, err := complete(context.Background(), l.API, "t", fmt.Sprintf("after the restart %d. ", k), 4); err != nil || a.code != http.StatusOK {
					t.Fatalf("a request after the restart: %+v %v", a, err)
				}
			}
			time.Sleep(50 * time.Millisecond)
			if n := cuts.Load(); n > 0 {
				t.Fatalf("decode-0's queue pair to %s's new life was down in %d polls after its loss", name, n)
			}
		})
	}
}

// A node's new life may be registered before the registry has told of the
// old life's loss: a static peer list reads a restart quicker than its
// reads fail, and etcd keeps a lease a crashed stop did not revoke. Where
// the old life announced its stop, the new life then joins as after that
// loss: once the old life's requests still running have their outcomes.
// Taken at once (AddNode under a larger incarnation), the restart would
// fail them, the request being decoded here among them.
func TestANewLifeSeenBeforeTheOldLifesLossFailsNoRequestOfTheOld(t *testing.T) {
	l, g, done, name, pid := beingDecoded(t)
	l.Router.mu.Lock()
	old := l.Router.members[pid]
	l.Router.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The old life's stop, announced; then its next life, before any loss.
	stopping, next := old, old
	stopping.Stopping = true
	next.Incarnation++
	if _, err := l.Registry.Register(ctx, stopping); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the router seeing "+name+" stop", func() bool {
		l.Router.mu.Lock()
		defer l.Router.mu.Unlock()
		return l.Router.stopping[pid]
	})
	if _, err := l.Registry.Register(ctx, next); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the router holding back "+name+"'s new life", func() bool {
		l.Router.mu.Lock()
		defer l.Router.mu.Unlock()
		return l.Router.losing[pid] != nil
	})
	close(g.release)
	if a := <-done; a.code != http.StatusOK {
		t.Fatalf("the client got %+v, want its answer: the request no longer needed %s's old life", a, name)
	}
	waitUntil(t, "the new life joining once the old life's loss is taken", func() bool {
		l.Router.mu.Lock()
		defer l.Router.mu.Unlock()
		_, waiting := l.Router.losing[pid]
		return !waiting && l.Router.members[pid].Incarnation == next.Incarnation && !l.Router.lost[pid]
	})
}

// A rolling restart's next step may come before the router has seen the
// last step's new life (a static list reads each peer 10 times a second;
// etcd's watch is an event away): for a moment every prefill node is
// stopping, or lost with its next life not yet seen. A request then waits
// for a next life, as for room, while a node of the role announced its
// stop and is still stopping; it was refused at once with no_node, and
// failed a rolling restart of serve processes in CI. Once the stops have
// ended with no next life seen, the router cannot tell a restart from a
// node removed, and the client hears at once.
func TestARequestFindingEveryNodeOfARoleStoppingWaitsForANextLife(t *testing.T) {
	l := localBuiltin(t, LocalConfig{Prefills: 2, PrefillPages: 128, DecodePages: 128, Timeout: time.Minute})
	id := func(name string) protocol.NodeID {
		l.Router.mu.Lock()
		defer l.Router.mu.Unlock()
		return l.Router.ids[name]
	}
	p0, p1 := betweenTwoSteps(t, l)
	retried := metricValue(t, l.Router.Metrics(), "kvhandoff_retries_total")
	done := completeLater(l, "a request in between two steps. ")
	waitUntil(t, "the request waiting", func() bool { return metricValue(t, l.Router.Metrics(), "kvhandoff_retries_total") > retried+1 })
	select {
	case a := <-done:
		t.Fatalf("with every prefill node stopping, the client got %+v, want it to wait for a next life", a)
	default:
	}
	if err := l.RestartPrefill(0); err != nil {
		t.Fatal(err)
	}
	if a := <-done; a.code != http.StatusOK {
		t.Fatalf("the client got %+v, want its answer from prefill-0's next life", a)
	}
	noNodeAtOnce := func(why string) {
		t.Helper()
		retried := metricValue(t, l.Router.Metrics(), "kvhandoff_retries_total")
		a, err := complete(context.Background(), l.API, "t", "a request after the stops. ", 4)
		if err != nil || a.code != http.StatusServiceUnavailable || !strings.Contains(a.text+a.err, "no_node") {
			t.Fatalf("%s: %+v %v, want 503 no_node", why, a, err)
		}
		if n := metricValue(t, l.Router.Metrics(), "kvhandoff_retries_total") - retried; n != 0 {
			t.Fatalf("%s: the request was retried %v times, want no_node at once", why, n)
		}
	}
	// prefill-1 still stopping, but no decode node nor a next life of
	// one: nothing to wait for.
	if err := l.StopPrefill(0); err != nil {
		t.Fatal(err)
	}
	if err := l.StopDecode(0); err != nil {
		t.Fatal(err)
	}
	d0 := id("decode-0")
	waitUntil(t, "the router losing prefill-0 and decode-0", func() bool {
		l.Router.mu.Lock()
		defer l.Router.mu.Unlock()
		return l.Router.lost[p0] && l.Router.lost[d0]
	})
	noNodeAtOnce("with no decode node left")
	// A decode node again, and both prefill stops ended, no next life
	// seen.
	l.Registry.Remove("prefill-1")
	if err := l.RestartDecode(0); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the router losing prefill-1, and decode-0 back", func() bool {
		l.Router.mu.Lock()
		defer l.Router.mu.Unlock()
		return l.Router.lost[p1] && !l.Router.lost[d0]
	})
	noNodeAtOnce("with no prefill node left")
}

// betweenTwoSteps puts l's two prefill nodes where a rolling restart's
// next step can find them before the router has seen the last step's new
// life: prefill-1 has announced its stop (the next step) and prefill-0's
// stop (the last step) has ended, its next life not yet seen. It returns
// their ids at the router.
func betweenTwoSteps(t *testing.T, l *Local) (p0, p1 protocol.NodeID) {
	t.Helper()
	l.Router.mu.Lock()
	p0, p1 = l.Router.ids["prefill-0"], l.Router.ids["prefill-1"]
	stopping := l.Router.members[p1]
	l.Router.mu.Unlock()
	stopping.Stopping = true
	if _, err := l.Registry.Register(context.Background(), stopping); err != nil {
		t.Fatal(err)
	}
	if err := l.StopPrefill(0); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the router seeing prefill-1 stop and prefill-0's stop end", func() bool {
		l.Router.mu.Lock()
		defer l.Router.mu.Unlock()
		return l.Router.stopping[p1] && l.Router.lost[p0]
	})
	return p0, p1
}

// A request waiting to retry (here for a next life, as in
// TestARequestFindingEveryNodeOfARoleStoppingWaitsForANextLife; for room
// it is the same wait) ends when the router's stop has waited its grace,
// as the requests in flight are cancelled then: before, it went on
// waiting, past the router's stop, until its own deadline.
func TestARequestWaitingToRetryEndsWithTheRoutersStop(t *testing.T) {
	l := localBuiltin(t, LocalConfig{Prefills: 2, PrefillPages: 128, DecodePages: 128, Timeout: time.Minute, routerGrace: 200 * time.Millisecond})
	betweenTwoSteps(t, l)
	retried := metricValue(t, l.Router.Metrics(), "kvhandoff_retries_total")
	done := make(chan error, 1)
	go func() {
		_, err := l.Router.Complete(context.Background(), Completion{Prompt: "a request as the router stops. ", MaxTokens: 4})
		done <- err
	}()
	waitUntil(t, "the request waiting", func() bool { return metricValue(t, l.Router.Metrics(), "kvhandoff_retries_total") > retried+1 })
	l.Stop() // returns once the router's Run has
	// The request has left the router by then; its answer reaches this
	// goroutine a moment later. (Without the cut it waits out its minute.)
	select {
	case err := <-done:
		// (Or, where its wait ended as the router's stop began, its next
		// attempt refused.)
		if !(errors.Is(err, protocol.ErrNoNode) && strings.Contains(err.Error(), "the router stopped")) && !errors.Is(err, ErrShuttingDown) {
			t.Fatalf("the request ended with %v, want no_node as the router stopped", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the router's stop ended with the request still waiting to retry")
	}
	if n := metricValue(t, l.Router.Metrics(), "kvhandoff_requests_waiting"); n != 0 {
		t.Fatalf("%v requests waiting after the router's stop, want 0", n)
	}
}

// A decode node may begin its answer as the other leg fails: its stop
// ends with the request, and closes the queue pair before the prefill
// node's last WRITE completions come back (they landed: the pages were
// verified), so the prefill leg reports its queue pair flushed. Tokens that
// reached the router reach a streaming client, and are not taken back; a
// client that is not streaming has seen nothing, and the router retries
// the request on another node, as for any failure its stop explains. It
// failed a rolling restart of serve processes (1 run in 12 under load).
// Here the failure is reported on the decode leg, held after its first
// token, with its node's stop announced.
func TestAnAnswerBegunAsTheOtherLegFailsWithTheStopIsRetriedForAClientNotStreaming(t *testing.T) {
	l := localBuiltin(t, LocalConfig{Decodes: 2, PrefillPages: 128, DecodePages: 128, Timeout: time.Minute})
	gates := []*tokenGate{gateDecode(l.Decodes[0]), gateDecode(l.Decodes[1])}
	done := completeLater(l, strings.Repeat("a prompt. ", 10))
	retried := metricValue(t, l.Router.Metrics(), "kvhandoff_retries_total")
	failBegunAttempt(t, l, gates, false)
	if a := <-done; a.code != http.StatusOK {
		t.Fatalf("the client got %+v, want the answer of a retry on the other decode node", a)
	}
	if n := metricValue(t, l.Router.Metrics(), "kvhandoff_retries_total") - retried; n != 1 {
		t.Fatalf("%v retries, want the one", n)
	}
}

// A stop string's search on a request not streaming watches the retry's
// tokens afresh: the failed attempt's first token is not the start of the
// retry's text. Here that token is "Q", and the answer "QX7-zeta…" holds
// no "QQ": a search that kept the failed attempt's "Q" found "QQ" at the
// retry's first token and ended its generation there.
func TestAStopStringsSearchStartsAgainOnARetrysTokens(t *testing.T) {
	l := localBuiltin(t, LocalConfig{Decodes: 2, PrefillPages: 128, DecodePages: 128, Timeout: time.Minute})
	const p = "the secret is QX7-zeta; again, the secret is "
	want := colocated(t, llama.Builtin(1), 16, p, 12)
	if !strings.HasPrefix(want, "QX") || strings.Contains(want, "QQ") {
		t.Fatalf("the built-in model's answer %q is not the one this test is built on", want)
	}
	gates := []*tokenGate{gateDecode(l.Decodes[0]), gateDecode(l.Decodes[1])}
	type reply struct {
		code int
		raw  []byte
		err  error
	}
	done := make(chan reply, 1)
	go func() {
		body, _ := json.Marshal(map[string]any{"prompt": p, "max_tokens": 12, "stop": "QQ"})
		resp, err := http.Post("http://"+l.API+"/v1/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			done <- reply{err: err}
			return
		}
		defer resp.Body.Close()
		raw, err := io.ReadAll(resp.Body)
		done <- reply{code: resp.StatusCode, raw: raw, err: err}
	}()
	on := failBegunAttempt(t, l, gates, true)
	// The retry, on the other node, holds after its first token too; a
	// search that kept the failed attempt's tokens has found "QQ" by now,
	// and its "enough" has reached the node (a few milliseconds).
	<-gates[1-on].held
	time.Sleep(200 * time.Millisecond)
	close(gates[1-on].release)
	r := <-done
	var out completionOut
	if r.err != nil || r.code != http.StatusOK || json.Unmarshal(r.raw, &out) != nil || len(out.Choices) != 1 {
		t.Fatalf("the client got %d %s (%v), want the retry's answer", r.code, r.raw, r.err)
	}
	if c := out.Choices[0]; c.Text != want || c.FinishReason != "length" {
		t.Fatalf("the retry's answer %q (%s), want %q (length): the stop string was searched for in the failed attempt's tokens too", c.Text, c.FinishReason, want)
	}
}

// failBegunAttempt fails a request's attempt as a rolling restart did: its
// decode node (of two, each gated) holds the answer after its first token,
// which reaches the router; that node's stop is announced; and the attempt
// fails as a WRITE completion flushed by the stop (reported on the decode
// leg: the prefill leg has ended in the process). It returns that node's
// index. The other node's gate holds the retry's first token too if
// holdRetry, and is disarmed otherwise.
func failBegunAttempt(t *testing.T, l *Local, gates []*tokenGate, holdRetry bool) int {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	var id protocol.RequestID
	on := 0
	select {
	case id = <-gates[0].held:
	case id = <-gates[1].held:
		on = 1
	}
	if !holdRetry {
		gates[1-on].armed.Store(false)
	}
	t.Cleanup(func() { close(gates[on].release) })
	name := fmt.Sprintf("decode-%d", on)
	l.Router.mu.Lock()
	node := l.Router.ids[name]
	m, q := l.Router.members[node], l.Router.pending[id]
	l.Router.mu.Unlock()
	m.Stopping = true
	if _, err := l.Registry.Register(ctx, m); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the router seeing "+name+" stop, and its first token", func() bool {
		l.Router.mu.Lock()
		defer l.Router.mu.Unlock()
		return l.Router.stopping[node] && len(q.tokens) > 0
	})
	l.Router.legEnded(node, id, fmt.Errorf("%w: WRITE of page 4: rdma: WRITE completion: flushed", protocol.ErrPeerFailed), q)
	return on
}

// beingDecoded starts a deployment of two prefill nodes and sends it a
// request whose decode is held after its first token (g releases it; done
// is its answer), and returns the name and router id of its prefill node.
func beingDecoded(t *testing.T) (l *Local, g *tokenGate, done <-chan answer, name string, pid protocol.NodeID) {
	t.Helper()
	l = localBuiltin(t, LocalConfig{Prefills: 2, PrefillPages: 128, DecodePages: 128, Timeout: time.Minute})
	g = gateDecode(l.Decodes[0])
	done = completeLater(l, strings.Repeat("a prompt. ", 10))
	id := <-g.held // its first token published, the rest held
	l.Router.mu.Lock()
	defer l.Router.mu.Unlock()
	name = l.Router.pending[id].prefill
	return l, g, done, name, l.Router.ids[name]
}

// A crashed prefill node restarted at once shows up at the router as a
// new life with no loss before it, where its registry record outlived the
// crash (a static list reads the restart before its reads fail; etcd keeps
// the crashed life's lease): the router then takes the old life's loss,
// and tells each decode node to cut that life's queue pair. By then the
// new life may have connected. The cut names the lost life, so the new
// life's queue pair, which replaced the old one's, stays, and takes the
// next requests. (Cut by name, it went too, and the new life's first
// requests failed.) The nodes' traces conform to the spec: the spared cut
// is the spec's restart, whose fence of the old life's queue pair came
// first.
func TestACrashAndQuickRestartKeepsTheNewLifesQueuePair(t *testing.T) {
	var buf syncBuffer
	sink := trace.NewSink(&buf)
	static, err := NewStatic()
	if err != nil {
		t.Fatal(err)
	}
	router := &heldRegistry{Registry: static, release: make(chan struct{})}
	logs := &lockedBuffer{}
	l, err := StartLocal(LocalConfig{Prefills: 1, PrefillPages: 64, DecodePages: 64, PageTokens: 16, Timeout: time.Minute,
		Log: slog.New(slog.NewJSONHandler(logs, nil)), unannouncedStops: true, Trace: sink,
		NewRegistry: func(node string) (Registry, error) {
			if node == "router" {
				return router, nil
			}
			return static, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	if a, err := complete(context.Background(), l.API, "t", "before the crash. ", 4); err != nil || a.code != http.StatusOK {
		t.Fatalf("a request before the crash: %+v %v", a, err)
	}
	l.Router.mu.Lock()
	pid := l.Router.ids["prefill-0"]
	old := l.Router.members[pid].Incarnation
	l.Router.mu.Unlock()

	// The crash, as the router sees it: nothing, until the new life's
	// record, which it reads once that life is connected to decode-0.
	router.hold("prefill-0")
	if err := l.StopPrefill(0); err != nil {
		t.Fatal(err)
	}
	if err := l.RestartPrefill(0); err != nil {
		t.Fatal(err)
	}
	// Live at both ends: the dialer goes live as it sends its ready, the
	// decode node once it has read it (a moment the watch would count).
	waitUntil(t, "the new life's queue pair to decode-0", func() bool {
		return slices.Contains(l.Prefill(0).Endpoint().Peers(), "decode-0") && slices.Contains(l.Decodes[0].Endpoint().Peers(), "prefill-0")
	})
	cuts := watchQueuePairDown(t, l.Decodes[0], "prefill-0")
	close(router.release)
	waitUntil(t, "decode-0 hearing of the old life's loss", func() bool {
		return strings.Contains(logs.String(), "its next life's queue pair stays") || strings.Contains(logs.String(), "queue pair cut")
	})
	l.Router.mu.Lock()
	now := l.Router.members[pid].Incarnation
	l.Router.mu.Unlock()
	if now == old {
		t.Fatalf("the router still knows prefill-0's old life %d", old)
	}
	for k := range 6 {
		if a, err := complete(context.Background(), l.API, "t", fmt.Sprintf("after the restart %d. ", k), 4); err != nil || a.code != http.StatusOK {
			t.Fatalf("a request after the restart: %+v %v", a, err)
		}
	}
	if n := cuts.Load(); n > 0 || strings.Contains(logs.String(), "queue pair cut") {
		t.Fatalf("decode-0's queue pair to prefill-0's new life was cut (down in %d polls)", n)
	}
	allPagesBack(t, l)
	l.Stop()
	rep, out := checkTrace(t, stoppedTrace(t, sink, &buf))
	if !rep.Conforms() {
		t.Fatalf("the trace does not conform:\n%s", out)
	}
	t.Logf("trace check:\n%s", out)
}

// heldRegistry is a registry whose watchers do not hear of a held node's
// loss, and hear of its next record only once release is closed: a
// registry whose record of a crashed node outlived the crash, and that
// then reads the node's restart late.
type heldRegistry struct {
	Registry
	mu      sync.Mutex
	held    string
	release chan struct{}
}

func (r *heldRegistry) hold(name string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.held = name
}

func (r *heldRegistry) Watch(ctx context.Context) (<-chan Change, error) {
	in, err := r.Registry.Watch(ctx)
	if err != nil {
		return nil, err
	}
	out := make(chan Change, watchBuffer)
	go func() {
		defer close(out)
		for ch := range in {
			r.mu.Lock()
			held := ch.Member.Name == r.held
			r.mu.Unlock()
			if held && ch.Kind == Lost {
				continue
			}
			if held {
				select {
				case <-r.release:
				case <-ctx.Done():
					return
				}
			}
			out <- ch
		}
	}()
	return out, nil
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// A decode node's new life may register before the old one's loss (etcd
// lets a restart register before the old lease ends): a prefill node then
// cuts the old life's queue pair, and dials the new life. Neither life's
// loss afterwards spares the old life's queue pair (a registry's loss
// names its newest record, and the cut takes that life and every earlier
// one). Kept, the old life's queue pair stood in for the new life, which
// was never dialled.
func TestAPrefillNodeCutsADecodeNodesOldLifeAtItsNewLifesRecord(t *testing.T) {
	l := localBuiltin(t, LocalConfig{Prefills: 1, PrefillPages: 64, DecodePages: 64, Timeout: time.Minute})
	if a, err := complete(context.Background(), l.API, "t", "warm up. ", 4); err != nil || a.code != http.StatusOK {
		t.Fatalf("%+v %v", a, err)
	}
	d := l.Decodes[0]
	d.mu.Lock()
	next := d.self
	d.mu.Unlock()
	next.Incarnation++
	next.Transfer = "127.0.0.1:1" // the new life, elsewhere: nothing answers there
	// As etcd tells it: the new life's record under the name, the old
	// life's lease left to run out.
	l.Registry.mu.Lock()
	l.Registry.notify(Change{Kind: Joined, Member: next})
	l.Registry.mu.Unlock()
	waitUntil(t, "prefill-0 cutting decode-0's old life", func() bool {
		return !slices.Contains(l.Prefill(0).Endpoint().Peers(), "decode-0")
	})
	time.Sleep(300 * time.Millisecond) // the dialer's ticks: it must dial the new life, not the old
	if slices.Contains(l.Prefill(0).Endpoint().Peers(), "decode-0") {
		t.Fatal("prefill-0 has a queue pair to decode-0 again: the new life is not there to answer, so it is the old life's")
	}
}

// A life the router lost may come back: the router suspects a node whose
// control call broke off, tells decode nodes to cut that life's queue
// pair (its fence), and takes the node back in rotation once it answers
// its probe. The same life then connects to decode again, and serves.
// (A decode node that remembered the life as lost refused it for good.)
func TestALifeTheRouterLostAndTookBackConnectsAgain(t *testing.T) {
	l := localBuiltin(t, LocalConfig{Prefills: 1, PrefillPages: 64, DecodePages: 64, Timeout: 10 * time.Second})
	if a, err := complete(context.Background(), l.API, "t", "before. ", 4); err != nil || a.code != http.StatusOK {
		t.Fatalf("before: %+v %v", a, err)
	}
	rt := l.Router
	rt.mu.Lock()
	pid := rt.ids["prefill-0"]
	rt.suspectLocked(pid, ErrUnreachable)
	rt.effectsLocked()
	rt.mu.Unlock()
	connected := func() bool { return slices.Contains(l.Decodes[0].Endpoint().Peers(), "prefill-0") }
	waitUntil(t, "decode-0 cutting prefill-0's queue pair", func() bool { return !connected() })
	waitUntil(t, "prefill-0 back in rotation", func() bool {
		rt.mu.Lock()
		defer rt.mu.Unlock()
		return !rt.suspect[pid] && !rt.lost[pid]
	})
	waitUntil(t, "prefill-0's same life connected to decode-0 again", connected)
	if a, err := complete(context.Background(), l.API, "t", "after. ", 4); err != nil || a.code != http.StatusOK {
		t.Fatalf("after: %+v %v", a, err)
	}
}

// watchQueuePairDown counts, until the test ends, the polls (every 100 µs)
// that find decode node d with no live queue pair to prefill node name.
func watchQueuePairDown(t *testing.T, d *Decode, name string) *atomic.Int64 {
	var down atomic.Int64
	watching := make(chan struct{})
	t.Cleanup(func() { close(watching) })
	go func() {
		for {
			select {
			case <-watching:
				return
			case <-time.After(100 * time.Microsecond):
			}
			if !slices.Contains(d.Endpoint().Peers(), name) {
				down.Add(1)
			}
		}
	}()
	return &down
}

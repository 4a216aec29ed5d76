package model

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/protocol/protocoltest"
)

// SimConfig is one simulated deployment: a protocol.Router, prefill nodes and
// one decode node joined by in-memory queue pairs, a stream of requests, and
// faults.
type SimConfig struct {
	Seed         uint64
	Requests     int     // requests in the run; 0 means 24
	Senders      int     // prefill nodes; 0 means 2
	Decoders     int     // decode nodes; 0 means 1
	DecodePages  int     // per decode node; 0 means 24
	PrefillPages int     // per prefill node; 0 means 12 (its intake limit: PrefillPages*PageTokens)
	PageTokens   int     // 0 means 4
	PageBytes    int     // 0 means 64
	FaultRate    float64 // chance that a step is a fault; 0 means 0.03
	// DecodeRestarts adds a fault: a decode node crashes and comes back at
	// once under a new incarnation (protocoltest.Network.RestartDecode).
	DecodeRestarts bool
	// PrefixCache turns the decode nodes' prefix cache on, and gives the
	// requests prompts that share prefixes (prefixPrompt): within a scope
	// and, with the same tokens, across scopes, some of scope 0.
	PrefixCache bool
	Bugs        research.Switches
}

func (c *SimConfig) defaults() {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.Requests, 24)
	def(&c.Senders, 2)
	def(&c.Decoders, 1)
	def(&c.DecodePages, 24)
	def(&c.PrefillPages, 12)
	def(&c.PageTokens, 4)
	def(&c.PageBytes, 64)
	if c.FaultRate == 0 {
		c.FaultRate = 0.03
	}
}

// Client-visible outcomes, as the router reports them.
const (
	OutcomeOK        = "ok"
	OutcomeRejected  = "rejected"
	OutcomeCancelled = "cancelled"
	OutcomeFailed    = "failed"
)

// Violation is the first property a run broke.
type Violation struct {
	Property string `json:"property"`
	Detail   string `json:"detail"`
	Step     int    `json:"step"`
}

// SimResult is one seed's run.
type SimResult struct {
	Seed        uint64
	Requests    int
	Outcomes    map[string]int // client-visible outcomes
	FailedBy    map[string]int // failed requests by the error that decided them
	Violation   *Violation
	PagesLeaked int // decode and prefill pages not free at the end
	// DecodeRestarts counts the decode nodes' restarts in the run, and
	// ServedByRestartedDecode the requests served ok by a decode node's
	// incarnation after its first.
	DecodeRestarts          int
	ServedByRestartedDecode int
	// PrefixHits and PrefixHitPages are the decode nodes' prefix cache hits
	// (requests that reused cached pages) and the pages reused.
	PrefixHits, PrefixHitPages int
	Trace                      []string // every step, for replaying a failure by eye
}

// routerTimeout fails a request the router has had this long without an
// outcome: past the decode node's timeout, so both paths are exercised.
const routerTimeout = 90 * time.Second

// world is one run: a protocoltest.Network (the router, the nodes, their
// queue pairs, the property checks) and the requests still to submit.
type world struct {
	cfg     SimConfig
	pick    func(n int) int // every choice the world makes: seeded, or drawn by rapid
	n       *protocoltest.Network
	tokens  []int
	step    int
	next    int // next request to submit
	drainAt int // the step from which no more faults happen
	res     *SimResult
	// events' lists, reused: it is called at every step, and each caller
	// is done with a list before the next call.
	proto, faults []event
}

// Simulate runs one seed: a random workload, interleaving and faults, with the
// spec's properties checked after every step, then a fault-free drain that
// checks termination and that every page comes back. The same seed replays
// the same run.
func Simulate(cfg SimConfig) *SimResult { return simulateWorld(cfg).res }

// simulateWorld is Simulate, returning the whole world.
func simulateWorld(cfg SimConfig) *world {
	cfg.defaults()
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x6b76))
	limit := cfg.PrefillPages * cfg.PageTokens
	tokens := make([]int, cfg.Requests)
	for i := range tokens {
		// Mostly short prompts, some long, and about one in ten over the
		// prefill pool (the incident's over-long ones), which decode could hold.
		switch x := rng.IntN(20); {
		case x < 15:
			tokens[i] = 1 + rng.IntN(3*cfg.PageTokens)
		case x < 18:
			tokens[i] = 1 + rng.IntN(limit)
		case x == 18 && rng.IntN(4) == 0:
			// Over every pool: the router's own intake rejects it.
			tokens[i] = cfg.DecodePages*cfg.PageTokens + 1 + rng.IntN(limit)
		default:
			tokens[i] = limit + 1 + rng.IntN(min(limit, cfg.DecodePages*cfg.PageTokens-limit))
		}
	}
	w := newWorld(cfg, tokens, rng.IntN)
	w.run(rng)
	return w
}

// newWorld builds the deployment with one request per entry of tokens: the
// prefill nodes advertise decode's pool, not their own, as the incident's
// did, so the router lets over-long prompts through and each node's own
// intake is exercised.
func newWorld(cfg SimConfig, tokens []int, pick func(int) int) *world {
	nc := protocoltest.Config{RouterTimeout: routerTimeout, Research: cfg.Bugs}
	for range cfg.Senders {
		nc.Prefill = append(nc.Prefill, protocoltest.NodeConfig{Pages: cfg.PrefillPages, PageTokens: cfg.PageTokens,
			PageBytes: cfg.PageBytes, Advertise: cfg.DecodePages, MaxInFlight: 2})
	}
	for range cfg.Decoders {
		nc.Decode = append(nc.Decode, protocoltest.NodeConfig{Pages: cfg.DecodePages, PageTokens: cfg.PageTokens, PageBytes: cfg.PageBytes,
			Timeout: 10 * time.Second, PrefixCache: cfg.PrefixCache})
	}
	n, err := protocoltest.New(nc)
	if err != nil {
		panic(err) // the defaults are valid; a bad config is a programming error here
	}
	n.StreamPages = true // a streaming prefill, a page per chunk: WRITEs interleave with the computation (docs/protocol.md rule 25)
	return &world{cfg: cfg, pick: pick, n: n, tokens: tokens,
		res: &SimResult{Seed: cfg.Seed, Requests: len(tokens), Outcomes: map[string]int{}, FailedBy: map[string]int{}}}
}

// event is one enabled step: a network event, or with submit set the
// world's next submit, request id with tokens tokens (held as values, not
// closures: events are listed at every step).
type event struct {
	ev     protocoltest.Event
	submit bool
	id     protocol.RequestID
	tokens int
}

// name says what the event does, formatted only when asked for (for the
// event taken).
func (e event) name() string {
	if e.submit {
		return fmt.Sprintf("submit: r%d (%d tokens)", e.id, e.tokens)
	}
	return e.ev.Name()
}

func (w *world) run(rng *rand.Rand) {
	const maxSteps = 20000
	for w.step = 0; w.step < maxSteps && w.res.Violation == nil; w.step++ {
		draining := w.next == len(w.tokens) && w.step >= w.drainAt
		protocolEvents, faults := w.events(draining)
		var e event
		switch {
		case len(faults) > 0 && (len(protocolEvents) == 0 || rng.Float64() < w.cfg.FaultRate):
			e = faults[rng.IntN(len(faults))]
		case len(protocolEvents) > 0:
			e = protocolEvents[rng.IntN(len(protocolEvents))]
		default:
			w.finish()
			return
		}
		w.apply(e)
	}
	if w.res.Violation == nil {
		w.violate("Termination", fmt.Sprintf("still running after %d steps", maxSteps))
	}
}

// apply runs one event; the network checks the safety properties after it.
func (w *world) apply(e event) {
	w.res.Trace = append(w.res.Trace, fmt.Sprintf("%4d %s", w.step, e.name()))
	if e.submit {
		w.submit(e.id, e.tokens)
	} else {
		if e.ev.Kind == "decode-restart" {
			w.res.DecodeRestarts++
		}
		e.ev.Do()
	}
	if v := w.n.Violations; len(v) > 0 {
		w.violate(v[0].Property, v[0].Detail)
	}
}

func (w *world) violate(prop, detail string) {
	if w.res.Violation == nil {
		w.res.Violation = &Violation{Property: prop, Detail: detail, Step: w.step}
	}
}

// events lists what can happen now: the next submit and the network's own
// events, and faults unless draining. Prefill node 1 never crashes, so the
// workload can finish; a crashed node may restart under a new incarnation,
// and with DecodeRestarts a decode node may crash and restart at once.
func (w *world) events(draining bool) (proto, faults []event) {
	proto, faults = w.proto[:0], w.faults[:0]
	if w.next < len(w.tokens) {
		id, tokens := protocol.RequestID(w.next+1), w.tokens[w.next]
		proto = append(proto, event{submit: true, id: id, tokens: tokens})
	}
	p, f := w.n.Events(protocoltest.EventOptions{Faults: !draining, Crashable: notTheFirst, Restarts: true,
		DecodeRestarts: w.cfg.DecodeRestarts, TimeJump: time.Minute})
	for _, e := range p {
		proto = append(proto, event{ev: e})
	}
	for _, e := range f {
		faults = append(faults, event{ev: e})
	}
	w.proto, w.faults = proto, faults
	return proto, faults
}

// notTheFirst says which prefill nodes may crash: all but node 0, so that
// the workload can finish.
func notTheFirst(i int) bool { return i > 0 }

func (w *world) submit(id protocol.RequestID, tokens int) {
	w.next++
	if w.next == len(w.tokens) {
		w.drainAt = w.step + w.pick(100) // faults stop at a random point after the last request
	}
	if w.cfg.PrefixCache {
		scope, prompt := prefixPrompt(int(id), tokens, w.cfg.PageTokens)
		w.n.SubmitPrompt(id, tokens, scope, prompt) // a refusal is the client's outcome; the network checks it
		return
	}
	w.n.Submit(id, tokens) // a refusal is the client's outcome; the network checks it
}

// prefixPrompt is request id's scope and prompt with the prefix cache on: a
// function of the request and its length only, so a rapid script replays
// it. Requests fall in two scopes (one in five in scope 0, no reuse) and
// three conversations each; a prompt is the start of its conversation, the
// first two pages of which every conversation shares (a system prompt). The
// two scopes' conversations have the same tokens: only the scope keeps
// their KV apart (SGLang #37160's case).
func prefixPrompt(id, tokens, pageTokens int) (protocol.Scope, []uint32) {
	scope := protocol.Scope(1 + id%2)
	if id%5 == 4 {
		scope = 0
	}
	conv := uint32(id/2) % 3
	prompt := make([]uint32, tokens)
	for i := range prompt {
		prompt[i] = uint32(i)
		if i >= 2*pageTokens {
			prompt[i] = conv<<16 | uint32(i)
		}
	}
	return scope, prompt
}

// failReason names the protocol error behind a failure.
func failReason(err error) string {
	if lost := (*protocol.NodeLostError)(nil); errors.As(err, &lost) && lost.Role == protocol.RoleDecode {
		return "decode node lost" // a decode node lost at its restart
	}
	if errors.Is(err, protocol.ErrNodeLost) || errors.Is(err, protocol.ErrNoNode) {
		return "prefill node lost"
	}
	for _, e := range []error{protocol.ErrNoCapacity, protocol.ErrTimedOut, protocol.ErrPeerFailed, protocol.ErrTokenMismatch,
		protocol.ErrTagMismatch, protocol.ErrTagMalformed, protocol.ErrChecksumMismatch, protocol.ErrFenced} {
		if errors.Is(err, e) {
			return strings.TrimPrefix(e.Error(), "protocol: ")
		}
	}
	return "other"
}

func clientOutcome(err error) string {
	switch {
	case err == nil:
		return OutcomeOK
	case errors.Is(err, protocol.ErrRejected):
		return OutcomeRejected
	case errors.Is(err, protocol.ErrCancelled):
		return OutcomeCancelled
	}
	return OutcomeFailed
}

// finish runs when nothing is left to happen: Termination and NoLeak, and
// the client-visible outcomes counted.
func (w *world) finish() {
	w.res.PagesLeaked = w.n.Quiescent()
	for _, q := range w.n.Requests() {
		if !q.Decided {
			continue // a Termination violation, reported by Quiescent
		}
		o := clientOutcome(q.Outcome)
		w.res.Outcomes[o]++
		if o == OutcomeOK && q.DecodeInc > 0 {
			w.res.ServedByRestartedDecode++
		}
		if o == OutcomeFailed {
			w.res.FailedBy[failReason(q.Outcome)]++
		}
	}
	for _, d := range w.n.Decode {
		st := d.Receiver.Stats()
		w.res.PrefixHits += int(st.PrefixHits)
		w.res.PrefixHitPages += int(st.PrefixHitPages)
	}
	if v := w.n.Violations; len(v) > 0 {
		w.violate(v[0].Property, v[0].Detail)
	}
}

// Package trace is the schema and the writer of kvhandoff's protocol traces:
// every node (router, prefill, decode) can write the protocol events it sees
// as JSON lines, one Event a line, which spec/tracecheck merges and replays
// in the spec (docs/trace.md).
//
// A Writer belongs to one node: it numbers the node's events (Seq, from 1)
// and stamps each with the wall clock, which the merge uses only to pick a
// plausible interleaving among events that causality leaves unordered. A
// Writer records each event before the action takes effect outside the node
// (a SEND is traced when the state machine emits it, before it is posted).
// The Sink buffers lines and writes them out at every event another node
// can see (a SEND; the router's dispatches and cancels), so a node killed
// by SIGKILL leaves a trace whose every receive elsewhere has its send: what
// it loses is a tail of its own events, as if it had died a little earlier.
// Several Writers may share one Sink (the in-process demo's one file). A nil
// *Writer writes nothing, so tracing off costs a nil check.
//
// The package imports only the standard library: transfer and node emit,
// the checker reads.
package trace

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"
)

// The event kinds (Event.Kind).
const (
	// Start opens a node incarnation's events: its Role and, in Inc, an id
	// that tells a restarted process's events from its predecessor's.
	Start = "start"

	// Router.
	Dispatch   = "dispatch"   // a request routed: Peer the prefill node, Decode the decode node, Tokens
	Refuse     = "refuse"     // the router's intake refused a request (Reason): nothing reached a node
	CancelLegs = "cancel"     // the client went away: the router cancels both legs (also a node's Cancel, below)
	CancelLeg  = "cancel-leg" // the router cancels one leg (Peer): the client's cancel, or a failure on the other leg
	CutCall    = "cut-call"   // the router cut a decode leg's call short and sends the node a cancel call (Peer)
	NodeLost   = "node-lost"  // the registry lost a node (Peer), or it registered a new incarnation
	LegEnd     = "leg-end"    // a leg's call answered (Peer its node; Err empty for success)
	ClientEnd  = "client-end" // the client's outcome (Err empty for success)
	Retry      = "retry"      // a leg call retried (not modelled: checked for a known request)

	// Prefill and decode endpoints.
	Submit   = "submit"   // prefill's intake took the request (Tokens; Pages its source pages) or refused it (Err)
	Send     = "send"     // a SEND handed to the queue pair to Peer (Msg and its fields)
	Recv     = "recv"     // a SEND received from Peer, before the state machine sees it
	Computed = "computed" // prefill: the request's first NPages pages hold complete KV, one event a page (the spec's Compute)
	Post     = "post"     // a WRITE handed to the queue pair: Write its id, Index, Pages [target page], Epochs
	Complete = "complete" // a WRITE's completion (Write), Err if it failed
	Verified = "verified" // decode: the request's pages verified
	Outcome  = "outcome"  // the leg's outcome on this node (Err empty for success)
	Acquire  = "acquire"  // decode: the pages handed to the decoder (Pages, Epochs), Err if refused
	Release  = "release"  // decode: Finish, the pages given back (Err if refused)
	Free     = "free"     // decode: pages back on the pool's free list (Pages, Epochs: the tenancies that ended); Req the request that gave them back, 0 for cached pages the pool freed
	Cache    = "cache"    // decode: the request's pages (Pages, Epochs) moved into the prefix cache: the tenancies go on, the cache's
	Pin      = "pin"      // decode: the request pinned cached pages (Pages, Epochs) it reads as its prefix
	Unpin    = "unpin"    // decode: the request dropped those pins
	Cancel   = "cancel"   // a node's Cancel of a request (Cause: decode's call, call-ended, sweep, shutdown, failed; prefill's shutdown or none)
	Cut      = "cut"      // the state machine asked to cut the queue pair to Peer
	Fenced   = "fenced"   // the queue pair to Peer drained in the error state: its requests fail
	// Stopped: a decode node incarnation's graceful stop has ended, traced
	// with the pool's last check: every page a Grant of it named before is
	// freed or cached by then, or it leaked (Err: the pages the pool still
	// held, if any). Its teardown's events may follow it, and the Grant of
	// a Bootstrap that reached it meanwhile.
	Stopped = "stopped"
)

// Event is one line of a trace. Fields a kind does not use are left out.
type Event struct {
	Node string `json:"node"`
	Inc  string `json:"inc,omitempty"` // Start: the incarnation's id
	Seq  uint64 `json:"seq"`
	T    int64  `json:"t"` // wall clock, Unix nanoseconds
	Kind string `json:"ev"`
	Role string `json:"role,omitempty"`
	Peer string `json:"peer,omitempty"`
	// QP: the node's own id of the queue pair to Peer an event is on (a
	// reconnect to the same peer is a new queue pair, a new id).
	QP     uint32 `json:"qp,omitempty"`
	Decode string `json:"decode,omitempty"` // Dispatch: the decode node
	Req    uint64 `json:"req,omitempty"`
	Msg    string `json:"msg,omitempty"` // Send, Recv: Bootstrap, Grant, Done, Abort, AbortAck
	Tokens uint32 `json:"tokens,omitempty"`
	// PageTokens: Dispatch, Submit: tokens per page of the decode node's
	// pool (the prefill node's for Submit).
	PageTokens uint32   `json:"page_tokens,omitempty"`
	Prefix     uint32   `json:"prefix,omitempty"` // Grant, Done: prompt tokens already at decode
	NPages     uint32   `json:"npages,omitempty"` // Done: pages written
	Pages      []uint32 `json:"pages,omitempty"`
	Epochs     []uint64 `json:"epochs,omitempty"`
	Write      uint64   `json:"write,omitempty"`
	Index      uint32   `json:"index,omitempty"`
	Reason     string   `json:"reason,omitempty"` // Abort's reason; Refuse's
	Cause      string   `json:"cause,omitempty"`
	Err        string   `json:"err,omitempty"`
}

// Sink is where Writers put their lines; safe for concurrent use.
type Sink struct {
	mu  sync.Mutex
	w   *bufio.Writer
	c   io.Closer
	err error
}

// NewSink writes to w; Close (or Flush) writes out what is buffered.
func NewSink(w io.Writer) *Sink { return &Sink{w: bufio.NewWriterSize(w, 64<<10)} }

// Create opens path for appending (a restarted node adds its incarnation to
// its predecessor's file) and returns a Sink over it.
func Create(path string) (*Sink, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("trace: %w", err)
	}
	return &Sink{w: bufio.NewWriterSize(f, 64<<10), c: f}, nil
}

// Flush writes out the buffered events.
func (s *Sink) Flush() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.flushLocked()
	return s.err
}

// flushLocked writes out the buffered events, keeping the first error.
func (s *Sink) flushLocked() {
	if err := s.w.Flush(); err != nil && s.err == nil {
		s.err = err
	}
}

// Close closes the file Create opened and reports the first write error.
func (s *Sink) Close() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.flushLocked()
	if s.c != nil {
		if err := s.c.Close(); err != nil && s.err == nil {
			s.err = err
		}
		s.c = nil
	}
	return s.err
}

// Writer writes one node incarnation's events to a Sink.
type Writer struct {
	sink *Sink
	node string
	mu   sync.Mutex
	seq  uint64
	buf  []byte
}

// NewWriter starts node's events on sink with a Start event naming its role
// and a fresh incarnation id. A nil sink gives a nil Writer: tracing off.
func (s *Sink) NewWriter(node, role string) *Writer {
	if s == nil {
		return nil
	}
	var id [6]byte
	_, _ = rand.Read(id[:])
	w := &Writer{sink: s, node: node}
	w.Emit(Event{Kind: Start, Role: role, Inc: hex.EncodeToString(id[:])})
	return w
}

// Emit writes ev as the node's next event. Safe for concurrent use; a nil
// Writer does nothing.
func (w *Writer) Emit(ev Event) {
	if w == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.seq++
	ev.Node, ev.Seq, ev.T = w.node, w.seq, time.Now().UnixNano()
	b, err := json.Marshal(&ev)
	if err != nil { // every field is a plain value: cannot happen
		panic(err)
	}
	w.buf = append(append(w.buf[:0], b...), '\n')
	w.sink.mu.Lock()
	if w.sink.err == nil {
		_, w.sink.err = w.sink.w.Write(w.buf)
	}
	if w.sink.err == nil && seen(ev.Kind) {
		w.sink.err = w.sink.w.Flush()
	}
	w.sink.mu.Unlock()
}

// seen reports whether another node can see the event's effect: it is
// written out at once.
func seen(kind string) bool {
	switch kind {
	case Send, Dispatch, CancelLeg, CutCall, NodeLost, Start:
		return true
	}
	return false
}

// Node is the writer's node name ("" for a nil Writer).
func (w *Writer) Node() string {
	if w == nil {
		return ""
	}
	return w.node
}

// ErrText is err's text for Event.Err: "" for nil.
func ErrText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// ErrBadTrace is wrapped by Read's errors: a line that is not an event.
var ErrBadTrace = errors.New("trace: bad trace")

// Read parses a trace's lines. A last line cut short (its node killed while
// writing it) is dropped and reported in truncated; any other bad line is
// an error naming it.
func Read(r io.Reader) (events []Event, truncated bool, err error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	var pending error
	line := 0
	for sc.Scan() {
		line++
		if pending != nil {
			return nil, false, pending // a bad line with lines after it
		}
		b := sc.Bytes()
		if len(b) == 0 {
			continue
		}
		var ev Event
		if err := json.Unmarshal(b, &ev); err != nil || ev.Node == "" || ev.Kind == "" || ev.Seq == 0 {
			pending = fmt.Errorf("%w: line %d: %.80q", ErrBadTrace, line, b)
			continue
		}
		events = append(events, ev)
	}
	if err := sc.Err(); err != nil {
		return nil, false, fmt.Errorf("%w: %w", ErrBadTrace, err)
	}
	return events, pending != nil, nil
}

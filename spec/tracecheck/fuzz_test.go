package tracecheck

import (
	"bytes"
	"encoding/json"
	"math"
	"runtime"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/trace"
)

// A trace is whatever its files hold: a node killed mid-line, a file from
// another build, one edited by hand. Check reads it with trace.Read and must
// answer every input with a report or an error, never a panic, and must not
// allocate on a count a line claims (a Tokens of 2^32-1 is not 2^28 pages:
// TestEditedTracesAreAnswered bounds what each seed allocates).

// fuzzValues are the values an edit sets a numeric field to: the edges of
// the spec's bounds (16 tokens a page, 8 pages) and of the field's type.
var fuzzValues = []uint64{0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 127, 128, 255, 256, 1 << 16, 1<<31 - 1, 1 << 31, math.MaxUint32, 1 << 32, math.MaxInt64, math.MaxUint64}

// fuzzKinds and fuzzMsgs are what an edit sets an event's kind and message to.
var (
	fuzzKinds = []string{trace.Start, trace.Dispatch, trace.Submit, trace.Send, trace.Recv, trace.Computed, trace.Post, trace.Complete,
		trace.Verified, trace.Acquire, trace.Release, trace.Free, trace.Cache, trace.Pin, trace.Unpin, trace.Outcome, trace.LegEnd, trace.ClientEnd, trace.Cancel, trace.Cut, trace.Fenced, "bogus"}
	fuzzMsgs  = []string{"Bootstrap", "Grant", "Done", "Abort", "AbortAck", "", "bogus"}
	fuzzNames = []string{"router", "p", "d", "q", ""}
)

// editTrace applies the edits in ed, four bytes each (an event, a field, a
// value, a spare), to evs: a field set to one of fuzzValues, fuzzKinds,
// fuzzMsgs or fuzzNames, a page list grown or emptied, an event dropped,
// doubled or swapped with another.
func editTrace(evs []trace.Event, ed []byte) []trace.Event {
	for ; len(ed) >= 4 && len(evs) > 0; ed = ed[4:] {
		i := int(ed[0]) % len(evs)
		v := fuzzValues[int(ed[2])%len(fuzzValues)]
		ev := &evs[i]
		switch ed[1] % 20 {
		case 0:
			ev.Tokens = uint32(v)
		case 1:
			ev.PageTokens = uint32(v)
		case 2:
			ev.Prefix = uint32(v)
		case 3:
			ev.NPages = uint32(v)
		case 4:
			ev.Index = uint32(v)
		case 5:
			ev.Write = v
		case 6:
			ev.Req = v
		case 7:
			ev.Seq = v
		case 8:
			ev.QP = uint32(v)
		case 9:
			ev.Pages = append(ev.Pages, uint32(v))
			ev.Epochs = append(ev.Epochs, uint64(ed[3]))
		case 10:
			ev.Pages = nil
		case 11:
			ev.Epochs = append(ev.Epochs[:0:0], v)
		case 12:
			ev.Kind = fuzzKinds[int(ed[2])%len(fuzzKinds)]
		case 13:
			ev.Msg = fuzzMsgs[int(ed[2])%len(fuzzMsgs)]
		case 14:
			ev.Peer = fuzzNames[int(ed[2])%len(fuzzNames)]
		case 15:
			ev.Node = fuzzNames[int(ed[2])%len(fuzzNames)]
		case 16:
			ev.Err = []string{"", "timed out", "cancelled", "bogus"}[ed[2]%4]
			ev.Reason = []string{"", "timed out", "cancelled", "too long", "bogus"}[ed[3]%5]
		case 17:
			evs = append(evs[:i], evs[i+1:]...)
		case 18:
			evs = append(evs[:i+1], evs[i:]...)
		case 19:
			j := int(ed[3]) % len(evs)
			evs[i], evs[j] = evs[j], evs[i]
		}
	}
	return evs
}

// fuzzSeeds are edits that reach the checks of merge, collect and the
// rules: a request of 2^32-1 tokens, a Done of 2^32-1 pages, a page past the
// pool, a duplicate sequence number, a message no one sent.
var fuzzSeeds = [][]byte{
	{},
	{3, 0, 20, 0},              // Dispatch of 2^32-1 tokens
	{3, 1, 0, 0},               // Dispatch's page size 0
	{4, 1, 0, 0},               // Submit's page size 0
	{13, 3, 20, 0},             // Done of 2^32-1 pages
	{9, 9, 14, 1},              // a Grant of a third page, 128, past the pool
	{17, 11, 23, 0},            // Done's Recv with an epoch of 2^64-1
	{4, 7, 1, 0},               // Submit with the sequence number of the node's Start
	{8, 15, 1, 0},              // the decode node's Recv of Bootstrap, on the prefill node
	{17, 17, 0, 0},             // Done's Recv dropped
	{11, 4, 20, 0},             // a WRITE of index 2^32-1
	{3, 2, 23, 0, 9, 2, 23, 0}, // a prefix of 2^32-1 tokens at Dispatch and Grant
}

// FuzzCheckNeverPanics edits a conforming trace (the happy path) and checks
// it: each answer is a report, which writes out, or an error.
func FuzzCheckNeverPanics(f *testing.F) {
	for _, s := range fuzzSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, ed []byte) {
		evs := editTrace(build(happy()), ed)
		checkAnswers(t, evs)
	})
}

// FuzzReadAndCheck feeds Check what trace.Read makes of arbitrary bytes,
// seeded with the happy path's lines.
func FuzzReadAndCheck(f *testing.F) {
	var happyLines bytes.Buffer
	enc := json.NewEncoder(&happyLines)
	for _, ev := range build(happy()) {
		if err := enc.Encode(ev); err != nil {
			f.Fatal(err)
		}
	}
	f.Add(happyLines.Bytes())
	f.Add([]byte(`{"node":"d","seq":1,"t":1,"ev":"recv","msg":"Done","req":7,"peer":"p","tokens":4294967295,"npages":4294967295}` + "\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		evs, _, err := trace.Read(bytes.NewReader(data))
		if err != nil {
			return
		}
		checkAnswers(t, evs)
	})
}

// checkAnswers checks evs and fails unless Check answers with a report that
// writes out or with an error.
func checkAnswers(t *testing.T, evs []trace.Event) {
	t.Helper()
	rep, err := Check(evs)
	if err != nil {
		if err.Error() == "" {
			t.Fatal("an error without a reason")
		}
		return
	}
	if rep == nil {
		t.Fatal("no report and no error")
	}
	var b strings.Builder
	rep.Write(&b)
	if b.Len() == 0 {
		t.Fatal("an empty report")
	}
}

// TestEditedTracesAreAnswered runs the fuzz seeds as a test, so that go test
// ./... checks them without -fuzz: each a report or an error, and the
// edits that break the happy path do not conform.
func TestEditedTracesAreAnswered(t *testing.T) {
	for _, s := range fuzzSeeds {
		evs := editTrace(build(happy()), s)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		checkAnswers(t, evs)
		runtime.ReadMemStats(&after)
		// The happy path's check allocates about 160 KiB; a count taken
		// at its word (2^32-1 tokens, pages, an index) would be gigabytes.
		if n := after.TotalAlloc - before.TotalAlloc; n > 64<<20 {
			t.Errorf("edit %v: the check allocated %d MiB", s, n>>20)
		}
	}
	// Edits that leave a trace the spec cannot take: a Done that claims
	// every page, a Grant of a page past the request's, a WRITE of a page
	// past the Grant's, a dispatch of 2^32-1 tokens (2^28 pages, not
	// replayed) whose Grant names 2.
	for _, ed := range [][]byte{{13, 3, 20, 0}, {9, 9, 14, 1}, {11, 4, 20, 0}, {3, 0, 20, 0}} {
		rep, err := Check(editTrace(build(happy()), ed))
		if err == nil && rep.Conforms() {
			t.Errorf("edit %v: the trace conforms", ed)
		}
	}
}

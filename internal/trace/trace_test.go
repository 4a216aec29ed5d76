package trace

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

// Every event a Writer emits reads back, numbered from 1 after its Start;
// the lines other nodes can see are written out at once, the rest at Flush.
func TestWrittenEventsReadBackInOrder(t *testing.T) {
	var buf bytes.Buffer
	sink := NewSink(&buf)
	w := sink.NewWriter("decode-0", "decode")
	w.Emit(Event{Kind: Recv, Msg: "Bootstrap", Req: 7, Peer: "prefill-0", QP: 1, Tokens: 80})
	w.Emit(Event{Kind: Send, Msg: "Grant", Req: 7, Peer: "prefill-0", QP: 1, Pages: []uint32{3, 4}, Epochs: []uint64{1, 1}})
	seenLines := strings.Count(buf.String(), "\n")
	w.Emit(Event{Kind: Verified, Req: 7})
	if strings.Count(buf.String(), "\n") != seenLines {
		t.Fatal("an event no other node sees was written out before a Flush")
	}
	if err := sink.Close(); err != nil {
		t.Fatal(err)
	}
	evs, truncated, err := Read(&buf)
	if err != nil || truncated || len(evs) != 4 {
		t.Fatalf("%d events, truncated %v, err %v", len(evs), truncated, err)
	}
	for i, ev := range evs {
		if ev.Seq != uint64(i+1) || ev.Node != "decode-0" {
			t.Fatalf("event %d: %+v", i, ev)
		}
	}
	if evs[0].Kind != Start || evs[0].Role != "decode" || evs[0].Inc == "" || evs[2].Pages[1] != 4 || evs[2].Epochs[0] != 1 {
		t.Fatalf("%+v", evs)
	}
	var off *Writer // tracing off
	off.Emit(Event{Kind: Send})
	if (*Sink)(nil).NewWriter("n", "r") != nil {
		t.Fatal("a nil sink gave a writer")
	}
}

// A node killed while writing leaves its last line cut short: dropped and
// reported. A bad line anywhere else is an error.
func TestACutLastLineIsDroppedAndABadLineElsewhereRefused(t *testing.T) {
	good := `{"node":"p","seq":1,"t":1,"ev":"start","role":"prefill"}` + "\n"
	evs, truncated, err := Read(strings.NewReader(good + `{"node":"p","seq":2,"t":2,"ev":"se`))
	if err != nil || !truncated || len(evs) != 1 {
		t.Fatalf("a cut last line: %d events, truncated %v, err %v", len(evs), truncated, err)
	}
	if _, _, err := Read(strings.NewReader(`{"node":"p","seq":1,"t":1,"ev":"st` + "\n" + good)); !errors.Is(err, ErrBadTrace) {
		t.Fatalf("a bad first line: %v", err)
	}
	if _, _, err := Read(strings.NewReader(good + `{"seq":2,"ev":"send"}` + "\n" + good)); !errors.Is(err, ErrBadTrace) {
		t.Fatalf("an event with no node: %v", err)
	}
}

package protocol

import (
	"errors"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/research"
)

// A decode rejection reaches the prefill side as an error it can match: the
// leg failed because its peer aborted (ErrPeerFailed), and why (the reason).
func TestAbortReasonIsAnErrorThePrefillSideMatches(t *testing.T) {
	for reason := AbortCancelled; reason <= maxAbortReason; reason++ {
		s := boundsSender(t, SenderConfig{Pages: 4, PageTokens: 1})
		if _, err := s.Submit(1, 2, 1); err != nil {
			t.Fatal(err)
		}
		s.Effects()
		if err := s.Step(2, &Abort{Request: 1, Reason: reason}); err != nil {
			t.Fatal(err)
		}
		e := s.Effects()
		if len(e.Outcomes) != 1 {
			t.Fatalf("%v: outcomes %v", reason, e.Outcomes)
		}
		err := e.Outcomes[0].Err
		if !errors.Is(err, ErrPeerFailed) || !errors.Is(err, reason) {
			t.Fatalf("%v: %v, want ErrPeerFailed and %v", reason, err, reason)
		}
		for other := AbortCancelled; other <= maxAbortReason; other++ {
			if other != reason && errors.Is(err, other) {
				t.Fatalf("%v: matches %v too", reason, other)
			}
		}
		var got AbortReason
		if !errors.As(err, &got) || got != reason {
			t.Fatalf("errors.As: %v", got)
		}
	}
	// The receiver's refusal, end to end: a Bootstrap over its limit.
	r := boundsReceiver(t, ReceiverConfig{Pages: 4, PageTokens: 1})
	s := boundsSender(t, SenderConfig{Pages: 8, PageTokens: 1})
	if _, err := s.Submit(1, 2, 5); err != nil {
		t.Fatal(err)
	}
	for _, op := range s.Effects().Ops {
		if err := r.Step(1, op.Msg, testNow); err != nil {
			t.Fatal(err)
		}
	}
	for _, snd := range r.Effects().Sends {
		if err := s.Step(2, snd.Msg); err != nil {
			t.Fatal(err)
		}
	}
	if e := s.Effects(); len(e.Outcomes) != 1 || !errors.Is(e.Outcomes[0].Err, AbortRejected) {
		t.Fatalf("the prefill side's outcome of a decode rejection: %v", e.Outcomes)
	}
}

func TestStatusesAndReasonsHaveNames(t *testing.T) {
	names := map[string]bool{}
	for st := ReceiverNone; st <= ReceiverClosed; st++ {
		names["r "+st.String()] = true
	}
	for st := SenderNone; st <= SenderFailed; st++ {
		names["s "+st.String()] = true
	}
	for r := AbortCancelled; r <= maxAbortReason; r++ {
		names["a "+r.String()] = true
	}
	if want := 8 + 8 + 8; len(names) != want {
		t.Fatalf("%d distinct names, want %d: %v", len(names), want, names)
	}
	if ReceiverReady.String() != "ready" || SenderAwaitGrant.String() != "awaiting-grant" || AbortRejected.String() != "rejected" {
		t.Fatal("names changed")
	}
	if ReceiverStatus(99).String() != "ReceiverStatus(99)" || AbortReason(0).String() != "AbortReason(0)" {
		t.Fatal("out-of-range values")
	}
}

// The concurrency bugs are not the SharedReceiver's: asked for, it refuses.
func TestSharedReceiverRefusesConcurrencySwitches(t *testing.T) {
	for _, sw := range research.Concurrency() {
		_, err := NewSharedReceiver(ReceiverConfig{Pages: 1, PageTokens: 1, Memory: newLazyMemory(1), TagKeys: testKeys,
			Region: func(uint32) (uint64, uint32) { return 0, 0 }, Research: research.On(sw)})
		if err == nil {
			t.Fatalf("%v accepted", sw)
		}
	}
}

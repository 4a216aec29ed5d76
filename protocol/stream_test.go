package protocol

import (
	"errors"
	"testing"
)

// streamSender is a sender of pages of one token with a request of pages
// pages submitted to peer 2, its Bootstrap taken out of the effects.
func streamSender(t *testing.T, pages int, o SubmitOptions) *Sender {
	t.Helper()
	s := boundsSender(t, SenderConfig{Pages: 16, PageTokens: 1, MaxInFlight: 16})
	if _, err := s.SubmitWith(1, 2, pages, o); err != nil {
		t.Fatal(err)
	}
	s.Effects()
	return s
}

// grant admits a Grant of n distinct pages (prefix pages present) for request 1.
func grant(t *testing.T, s *Sender, tokens, prefix, n int) {
	t.Helper()
	g := &Grant{Request: 1, Tokens: uint32(tokens), Prefix: uint32(prefix)}
	for i := range n {
		g.Pages = append(g.Pages, PageGrant{Page: uint32(10 + i), Epoch: 1, Addr: uint64(10+i) << 20, Key: 7})
	}
	if err := s.Step(2, g); err != nil {
		t.Fatal(err)
	}
}

// posted is the page indices of the WRITEs among ops, and whether a Done follows them.
func posted(ops []Op) (indices []uint32, done bool) {
	for _, op := range ops {
		if op.Write != nil {
			indices = append(indices, op.Write.Index)
		}
		if _, ok := op.Msg.(*Done); ok {
			done = true
		}
	}
	return indices, done
}

func wantPosted(t *testing.T, s *Sender, indices []uint32, done bool) []Op {
	t.Helper()
	e := s.Effects()
	got, gotDone := posted(e.Ops)
	if len(got) != len(indices) || gotDone != done {
		t.Fatalf("posted WRITEs of pages %v (Done %v), want %v (Done %v)", got, gotDone, indices, done)
	}
	for i := range got {
		if got[i] != indices[i] {
			t.Fatalf("posted WRITEs of pages %v, want %v", got, indices)
		}
	}
	return append([]Op(nil), e.Ops...) // the effects' slice is reused two calls later
}

// Rule 25: a granted page's WRITE is posted only once ComputedPages says the
// page holds its KV, and then at once: the transfer follows the computation
// chunk by chunk.
func TestAWriteWaitsForItsPageToBeComputed(t *testing.T) {
	s := streamSender(t, 6, SubmitOptions{})
	grant(t, s, 6, 0, 6)
	wantPosted(t, s, nil, false) // granted, nothing computed: nothing to write
	if err := s.ComputedPages(1, 2); err != nil {
		t.Fatal(err)
	}
	wantPosted(t, s, []uint32{0, 1}, false)
	if err := s.ComputedPages(1, 2); err != nil { // the same count again changes nothing
		t.Fatal(err)
	}
	wantPosted(t, s, nil, false)
	if err := s.ComputedPages(1, 5); err != nil {
		t.Fatal(err)
	}
	wantPosted(t, s, []uint32{2, 3, 4}, false)
	if err := s.ComputedPages(1, 6); err != nil {
		t.Fatal(err)
	}
	wantPosted(t, s, []uint32{5}, true)
}

// Rule 25: pages computed before the Grant are written as soon as it is
// admitted, and the rest as they are computed.
func TestPagesComputedBeforeTheGrantAreWrittenAtIt(t *testing.T) {
	s := streamSender(t, 4, SubmitOptions{})
	if err := s.ComputedPages(1, 3); err != nil {
		t.Fatal(err)
	}
	wantPosted(t, s, nil, false) // no Grant: nowhere to write
	grant(t, s, 4, 0, 4)
	wantPosted(t, s, []uint32{0, 1, 2}, false)
	if err := s.Computed(1); err != nil { // Computed is ComputedPages(all)
		t.Fatal(err)
	}
	wantPosted(t, s, []uint32{3}, true)
}

// Rule 25 with the window: Done waits for the last page's computation even
// when every WRITE of the computed pages has completed, and the window still
// bounds what is posted.
func TestDoneWaitsForEveryPageToBeComputed(t *testing.T) {
	s := boundsSender(t, SenderConfig{Pages: 16, PageTokens: 1, MaxInFlight: 2})
	if _, err := s.Submit(1, 2, 5); err != nil {
		t.Fatal(err)
	}
	s.Effects()
	grant(t, s, 5, 0, 5)
	if err := s.ComputedPages(1, 4); err != nil {
		t.Fatal(err)
	}
	ops := wantPosted(t, s, []uint32{0, 1}, false) // the window: 2 in flight
	for _, op := range ops {
		if err := s.Completed(op.Write.ID, nil); err != nil {
			t.Fatal(err)
		}
	}
	ops = wantPosted(t, s, []uint32{2, 3}, false)
	for _, op := range ops {
		if err := s.Completed(op.Write.ID, nil); err != nil {
			t.Fatal(err)
		}
	}
	wantPosted(t, s, nil, false) // every computed page written, the last not computed: no Done
	if st := s.Status(1); st != SenderWriting {
		t.Fatalf("status %v, want writing", st)
	}
	if err := s.ComputedPages(1, 5); err != nil {
		t.Fatal(err)
	}
	ops = wantPosted(t, s, []uint32{4}, true)
	if err := s.Completed(ops[0].Write.ID, nil); err != nil {
		t.Fatal(err)
	}
	if e := s.Effects(); len(e.Outcomes) != 1 || e.Outcomes[0].Err != nil || s.Pool().Free() != 16 {
		t.Fatalf("outcomes %v, %d pages free; want one success and every page back", e.Outcomes, s.Pool().Free())
	}
}

// Rule 25: a count of no pages, more pages than the request has, or fewer
// than before is refused with ErrBadComputed and changes nothing; an unknown
// request is ErrUnknownRequest.
func TestComputedPagesRefusesCountsOutsideTheRequest(t *testing.T) {
	s := streamSender(t, 4, SubmitOptions{})
	grant(t, s, 4, 0, 4)
	if err := s.ComputedPages(1, 3); err != nil {
		t.Fatal(err)
	}
	s.Effects()
	for _, n := range []int{0, -1, 5, 1 << 30, 2} {
		if err := s.ComputedPages(1, n); !errors.Is(err, ErrBadComputed) {
			t.Errorf("ComputedPages(1, %d): %v, want ErrBadComputed", n, err)
		}
	}
	wantPosted(t, s, nil, false)
	if err := s.ComputedPages(9, 1); !errors.Is(err, ErrUnknownRequest) {
		t.Errorf("ComputedPages of an unknown request: %v, want ErrUnknownRequest", err)
	}
	if err := s.ComputedPages(1, 4); err != nil { // and the request goes on
		t.Fatal(err)
	}
	wantPosted(t, s, []uint32{3}, true)
}

// Rule 25 with rule 10: a request cancelled or aborted mid-stream posts
// nothing more, whatever ComputedPages says after (nil: the driver was
// computing when it ended); its pages come back once its posted WRITEs have
// completed, and the receiver gets AbortAck, never Done.
func TestComputedPagesAfterTheRequestEndedChangesNothing(t *testing.T) {
	for _, how := range []string{"cancel", "abort"} {
		t.Run(how, func(t *testing.T) {
			s := streamSender(t, 6, SubmitOptions{})
			grant(t, s, 6, 0, 6)
			if err := s.ComputedPages(1, 2); err != nil {
				t.Fatal(err)
			}
			ops := wantPosted(t, s, []uint32{0, 1}, false)
			if how == "cancel" {
				s.Cancel(1)
			} else if err := s.Step(2, &Abort{Request: 1, Reason: AbortTimedOut}); err != nil {
				t.Fatal(err)
			}
			if st := s.Status(1); st != SenderAborting {
				t.Fatalf("status %v, want aborting behind its 2 WRITEs", st)
			}
			for _, n := range []int{4, 6} {
				if err := s.ComputedPages(1, n); err != nil {
					t.Fatalf("ComputedPages(1, %d) after the %s: %v, want nil", n, how, err)
				}
			}
			if err := s.Computed(1); err != nil {
				t.Fatal(err)
			}
			wantPosted(t, s, nil, false)
			for _, op := range ops {
				if err := s.Completed(op.Write.ID, nil); err != nil {
					t.Fatal(err)
				}
			}
			e := s.Effects()
			if len(e.Ops) != 1 {
				t.Fatalf("ops %v, want only the AbortAck", e.Ops)
			}
			if _, ok := e.Ops[0].Msg.(*AbortAck); !ok {
				t.Fatalf("sent %v, want AbortAck", e.Ops[0].Msg)
			}
			if s.Pool().Free() != 16 {
				t.Fatalf("%d source pages free of 16", s.Pool().Free())
			}
			if err := s.ComputedPages(1, 6); err != nil || len(s.Effects().Ops) != 0 {
				t.Fatalf("ComputedPages after the end: %v", err)
			}
		})
	}
	t.Run("awaiting the grant", func(t *testing.T) {
		s := streamSender(t, 4, SubmitOptions{})
		if err := s.ComputedPages(1, 1); err != nil {
			t.Fatal(err)
		}
		s.Cancel(1)
		if err := s.ComputedPages(1, 4); err != nil || s.Pool().Free() != 16 {
			t.Fatalf("ComputedPages after a cancel: %v, %d pages free", err, s.Pool().Free())
		}
		s.Effects()
		grant(t, s, 4, 0, 4)
		e := s.Effects()
		if len(e.Ops) != 1 || e.Ops[0].Write != nil {
			t.Fatalf("ops %v, want only AbortAck for the late Grant", e.Ops)
		}
	})
}

// Rules 25 and 22: with a prefix hit, the pages decode holds are computed
// (they count toward ComputedPages) and never written; the first WRITE waits
// for the first page past the prefix.
func TestStreamingWithAPrefixWritesOnlyThePagesPastIt(t *testing.T) {
	s := streamSender(t, 5, SubmitOptions{Scope: 3, Chain: make([]ChainHash, 5)})
	grant(t, s, 5, 2, 3) // decode holds pages 0 and 1
	if err := s.ComputedPages(1, 2); err != nil {
		t.Fatal(err)
	}
	wantPosted(t, s, nil, false) // only the prefix computed: nothing to write yet
	if err := s.ComputedPages(1, 4); err != nil {
		t.Fatal(err)
	}
	wantPosted(t, s, []uint32{2, 3}, false)
	if err := s.ComputedPages(1, 5); err != nil {
		t.Fatal(err)
	}
	ops := wantPosted(t, s, []uint32{4}, true)
	if d := ops[len(ops)-1].Msg.(*Done); d.Prefix != 2 || d.Pages != 3 {
		t.Fatalf("Done %+v, want a prefix of 2 tokens and 3 pages written", d)
	}
}

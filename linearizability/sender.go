package linearizability

import (
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/protocol/protocoltest"
)

// Sender operations: Submit, Computed, Status and Cancel from prefill workers
// and the router; Grant and Complete (a WRITE completion) from the transport's
// poller; Flush (a queue pair broke) as a fault. Requests are one page.
const (
	OpSubmit OpKind = 100 + iota
	OpComputed
	OpGrant
	OpComplete
	OpFlush
	OpSenderStatus
	OpSenderCancel
)

// senderState is one request on the sender.
type senderState struct {
	Phase    protocol.SenderStatus
	Computed bool
}

// senderStep is the sender's sequential semantics for a one-page request.
func senderStep(s senderState, in Input, out Output) []senderState {
	next, ok := s, true
	switch in.Kind {
	case OpSubmit:
		if s.Phase == protocol.SenderNone {
			next.Phase = protocol.SenderAwaitGrant
		} else {
			ok = false
		}
	case OpComputed:
		if s.Phase == protocol.SenderNone {
			ok = false
		} else {
			next.Computed = true
			if s.Phase == protocol.SenderWriting {
				next.Phase = protocol.SenderDoneSent // the WRITE and Done are posted
			}
		}
	case OpGrant:
		switch s.Phase {
		case protocol.SenderAwaitGrant:
			next.Phase = protocol.SenderWriting
			if s.Computed {
				next.Phase = protocol.SenderDoneSent
			}
		case protocol.SenderAborted, protocol.SenderFailed:
			// answered with AbortAck
		default:
			ok = false // unknown request, or a second grant
		}
	case OpComplete:
		switch s.Phase {
		case protocol.SenderDoneSent:
			next.Phase = protocol.SenderFinished
		case protocol.SenderAborting:
			next.Phase = protocol.SenderAborted
		case protocol.SenderFailed:
			ok = false // the flush forgot the WRITE
		default:
			return nil
		}
	case OpSenderCancel:
		switch s.Phase {
		case protocol.SenderAwaitGrant, protocol.SenderWriting: // nothing posted
			next.Phase = protocol.SenderAborted
		case protocol.SenderDoneSent:
			next.Phase = protocol.SenderAborting
		}
		if out.Unknown {
			if next == s {
				return []senderState{s}
			}
			return []senderState{next, s}
		}
		return []senderState{next}
	case OpSenderStatus:
		if out.SendStatus != s.Phase {
			return nil
		}
		return []senderState{s}
	case OpFlush:
		switch s.Phase {
		case protocol.SenderAwaitGrant, protocol.SenderWriting, protocol.SenderDoneSent, protocol.SenderAborting:
			next.Phase = protocol.SenderFailed
		}
		return []senderState{next}
	}
	if out.OK != ok {
		return nil
	}
	return []senderState{next}
}

// SenderModel is the porcupine model of the concurrent sender, partitioned by request.
var SenderModel = porcupine.NondeterministicModel{
	Init: func() []interface{} { return []interface{}{senderState{Phase: protocol.SenderNone}} },
	Step: func(state, input, output interface{}) []interface{} {
		var out []interface{}
		for _, s := range senderStep(state.(senderState), input.(Input), output.(Output)) {
			out = append(out, s)
		}
		return out
	},
	Partition: Model.Partition,
	DescribeOperation: func(input, output interface{}) string {
		in, out := input.(Input), output.(Output)
		name := map[OpKind]string{OpSubmit: "Submit", OpComputed: "Computed", OpGrant: "Grant", OpComplete: "Complete",
			OpFlush: "Flush", OpSenderStatus: "Status", OpSenderCancel: "Cancel"}[in.Kind]
		switch {
		case out.Unknown:
			return fmt.Sprintf("%s(r%d) -> ? (not awaited)", name, in.Request)
		case in.Kind == OpSenderStatus:
			return fmt.Sprintf("Status(r%d) -> %s", in.Request, out.SendStatus)
		case out.OK:
			return fmt.Sprintf("%s(r%d) -> ok", name, in.Request)
		}
		return fmt.Sprintf("%s(r%d) -> error", name, in.Request)
	},
	DescribeState: func(state interface{}) string {
		s := state.(senderState)
		return fmt.Sprintf("%s, computed=%v", s.Phase, s.Computed)
	},
}

// RunSender records a history from a real concurrent run of
// protocol.SharedSender and checks it, like Run does for the receiver.
func RunSender(cfg Config) (*Result, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	start := time.Now()
	requests, transportOps := transportShare(cfg.Ops)
	snd, err := protocol.NewSharedSender(protocol.SenderConfig{Pages: requests, PageTokens: 4, Memory: protocoltest.NewMemory(requests, 0), TagKeys: tagKeys})
	if err != nil {
		return nil, err
	}
	rec := &recorder{start: time.Now()}
	var frontier atomic.Uint64 // the highest request the transport has started
	frontier.Store(1)
	var transportDone atomic.Bool
	var wg sync.WaitGroup

	// The transport's poller: a grant for every request (known to the sender
	// or not), and the completion of every WRITE it posted.
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer transportDone.Store(true)
		rng := rand.New(rand.NewPCG(cfg.Seed, 0))
		pending := map[uint64]protocol.RequestID{}
		for id := protocol.RequestID(1); int(id) <= requests; id++ {
			frontier.Store(uint64(id))
			peer := protocol.PeerID(int(id) % peers)
			call := rec.now()
			err := snd.Step(peer, &protocol.Grant{Request: id, Tokens: 4, Pages: []protocol.PageGrant{{Page: uint32(id), Epoch: 1}}})
			rec.add(0, Input{OpGrant, id}, call, Output{OK: err == nil}, rec.now())
			for _, op := range snd.Effects().Ops {
				if w := op.Write; w != nil {
					pending[w.ID] = w.Request
				}
			}
			if cfg.Faults && rng.IntN(25) == 0 {
				cut := protocol.PeerID(rng.IntN(peers))
				call := rec.now()
				snd.Flushed(cut)
				ret := rec.now()
				rec.fault(OpFlush, cut, id+2, call, ret, fmt.Sprintf("queue pair %d flushed", cut)) // workers reach 2 past the frontier
			}
			ids := make([]uint64, 0, len(pending))
			for wid := range pending {
				ids = append(ids, wid)
			}
			sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
			for _, wid := range ids {
				call := rec.now()
				err := snd.Completed(wid, nil)
				rec.add(0, Input{OpComplete, pending[wid]}, call, Output{OK: err == nil}, rec.now())
				delete(pending, wid)
			}
		}
	}()

	// Prefill workers and the router, on requests near the transport's frontier.
	workers(cfg, cfg.Ops-transportOps, requests, &frontier, &transportDone, &wg, func(c int, rng *rand.Rand) {
		id := near(&frontier, rng, 2, 5) // up to 2 past the frontier: Flush copies reach as far
		peer := protocol.PeerID(int(id) % peers)
		call := rec.now()
		switch x := rng.IntN(10); {
		case x < 3:
			_, err := snd.Submit(id, peer, 4)
			rec.add(c, Input{OpSubmit, id}, call, Output{OK: err == nil}, rec.now())
		case x < 5:
			err := snd.Computed(id)
			rec.add(c, Input{OpComputed, id}, call, Output{OK: err == nil}, rec.now())
		case x < 8:
			st := snd.Status(id)
			rec.add(c, Input{OpSenderStatus, id}, call, Output{OK: true, SendStatus: st}, rec.now())
		default:
			rec.cancel(c, OpSenderCancel, id, cfg.Faults && x == 9, snd.Cancel)
		}
	})
	wg.Wait()
	time.Sleep(10 * time.Millisecond)
	return check(SenderModel.ToModel(), rec, cfg, start)
}

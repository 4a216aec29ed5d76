package linearizability

import (
	"math"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/anishathalye/porcupine"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
)

func TestSharedReceiverIsLinearizable(t *testing.T) {
	for _, faults := range []bool{false, true} {
		r, err := Run(Config{Clients: 8, Ops: 20000, Faults: faults, Seed: 3, Dir: t.TempDir()})
		if err != nil {
			t.Fatal(err)
		}
		if r.Result != "ok" || r.Partitions < 2 {
			t.Fatalf("faults=%v: %+v", faults, *r)
		}
	}
}

// The same with the prefix cache on: requests pin a shared cached page at
// Bootstrap, are granted their own, and insert or release at Finish while
// others pin and read; the calls stay linearizable. A hit needs a worker's
// Finish to insert the shared page before the transport's next Bootstrap,
// which the scheduler decides: on a loaded machine (CI, 2 cores) a run once
// had none, so each case tries up to five seeds until one has hits, and
// every run must be linearizable.
func TestSharedReceiverWithThePrefixCacheIsLinearizable(t *testing.T) {
	for _, faults := range []bool{false, true} {
		hits := uint64(0)
		for seed := uint64(3); seed < 8 && hits == 0; seed++ {
			r, err := Run(Config{Clients: 8, Ops: 20000, Faults: faults, Seed: seed, Dir: t.TempDir(), PrefixCache: true})
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("faults=%v, seed %d: %d ops, %d prefix hits", faults, seed, r.Ops, r.PrefixHits)
			if r.Result != "ok" || r.Partitions < 2 {
				t.Fatalf("faults=%v, seed %d: %+v", faults, seed, *r)
			}
			hits = r.PrefixHits
		}
		if hits == 0 {
			t.Fatalf("faults=%v: no prefix hit in five runs: the cache's concurrency went unexercised", faults)
		}
	}
}

// Each concurrency switch makes histories illegal, and the visualization names
// the operations involved.
func TestEachConcurrencySwitchIsCaught(t *testing.T) {
	for _, sw := range research.Concurrency() {
		t.Run(sw.String(), func(t *testing.T) {
			var r *Result
			// The interleaving is the scheduler's: a few tries make the race likely.
			for try := uint64(0); try < 20 && (r == nil || r.Result != "illegal"); try++ {
				var err error
				if r, err = Run(Config{Clients: 16, Ops: 50000, Bugs: research.On(sw), Seed: try, Dir: t.TempDir()}); err != nil {
					t.Fatal(err)
				}
			}
			if r.Result != "illegal" {
				t.Fatalf("20 runs found %v linearizable", sw)
			}
			html, err := os.ReadFile(r.Visualization)
			if err != nil {
				t.Fatal(err)
			}
			for _, want := range []string{"<html", "Bootstrap(r"} {
				if !strings.Contains(string(html), want) {
					t.Errorf("the visualization lacks %q", want)
				}
			}
		})
	}
}

// The model's step is the receiver's: a few sequential facts it must agree on.
func TestStepMatchesTheReceiversRules(t *testing.T) {
	cases := []struct {
		from protocol.ReceiverStatus
		in   Input
		out  Output
		want []protocol.ReceiverStatus
	}{
		{protocol.ReceiverNone, Input{OpCancel, 1}, Output{OK: true}, []protocol.ReceiverStatus{protocol.ReceiverTombstone}},
		{protocol.ReceiverReserved, Input{OpCancel, 1}, Output{OK: true}, []protocol.ReceiverStatus{protocol.ReceiverQuarantine}},
		{protocol.ReceiverQuarantine, Input{OpDone, 1}, Output{OK: true}, []protocol.ReceiverStatus{protocol.ReceiverClosed}},
		{protocol.ReceiverReady, Input{OpAcquire, 1}, Output{OK: true}, []protocol.ReceiverStatus{protocol.ReceiverReading}},
		{protocol.ReceiverClosed, Input{OpAcquire, 1}, Output{OK: true}, nil},
		{protocol.ReceiverReading, Input{OpCancel, 1}, Output{OK: true}, []protocol.ReceiverStatus{protocol.ReceiverReading}},
		{protocol.ReceiverReserved, Input{OpCancel, 1}, Output{OK: true, Unknown: true}, []protocol.ReceiverStatus{protocol.ReceiverQuarantine, protocol.ReceiverReserved}},
		{protocol.ReceiverReady, Input{OpStatus, 1}, Output{OK: true, Status: protocol.ReceiverReserved}, nil},
		{protocol.ReceiverReserved, Input{OpCut, 1}, Output{OK: true}, []protocol.ReceiverStatus{protocol.ReceiverClosed}},
	}
	for _, c := range cases {
		got := step(c.from, c.in, c.out)
		if !slices.Equal(got, c.want) {
			t.Errorf("%s then %v -> %+v: got %v, want %v", c.from, c.in.Kind, c.out, got, c.want)
		}
	}
}

func TestSharedSenderIsLinearizable(t *testing.T) {
	for _, faults := range []bool{false, true} {
		r, err := RunSender(Config{Clients: 8, Ops: 20000, Faults: faults, Seed: 5, Dir: t.TempDir()})
		if err != nil {
			t.Fatal(err)
		}
		if r.Result != "ok" || r.Partitions < 2 {
			t.Fatalf("faults=%v: %+v", faults, *r)
		}
	}
}

// The sender model rejects what the sender cannot do, and accepts overlaps it can.
func TestSenderModelJudgesHandBuiltHistories(t *testing.T) {
	op := func(client int, kind OpKind, call, ret int64, out Output) porcupine.Operation {
		return porcupine.Operation{ClientId: client, Input: Input{kind, 1}, Call: call, Output: out, Return: ret}
	}
	model := SenderModel.ToModel()
	impossible := []porcupine.Operation{
		op(0, OpSubmit, 0, 1, Output{OK: true}),
		op(1, OpSenderStatus, 2, 3, Output{OK: true, SendStatus: protocol.SenderNone}), // after a completed Submit
	}
	if porcupine.CheckOperations(model, impossible) {
		t.Fatal("a status older than a completed Submit must be illegal")
	}
	overlapping := []porcupine.Operation{
		op(0, OpSubmit, 0, 10, Output{OK: true}),
		op(1, OpSenderStatus, 2, 3, Output{OK: true, SendStatus: protocol.SenderNone}), // during the Submit
		op(2, OpGrant, 4, 5, Output{OK: false}),                                        // also during it
		op(1, OpSenderStatus, 11, 12, Output{OK: true, SendStatus: protocol.SenderAwaitGrant}),
	}
	if !porcupine.CheckOperations(model, overlapping) {
		t.Fatal("operations that overlap the Submit may see the state before it")
	}
	unknownCancel := []porcupine.Operation{
		op(0, OpSubmit, 0, 1, Output{OK: true}),
		op(1, OpSenderCancel, 2, math.MaxInt64, Output{OK: true, Unknown: true}),
		op(0, OpSenderStatus, 3, 4, Output{OK: true, SendStatus: protocol.SenderAwaitGrant}), // not applied yet
		op(0, OpSenderStatus, 5, 6, Output{OK: true, SendStatus: protocol.SenderAborted}),    // applied now
	}
	if !porcupine.CheckOperations(model, unknownCancel) {
		t.Fatal("a cancel whose outcome is unknown may take effect at any point after its call")
	}
}

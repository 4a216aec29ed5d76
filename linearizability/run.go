package linearizability

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/internal/research/racy"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/protocol/checksum"
	"github.com/kvhandoff/kvhandoff/protocol/protocoltest"
)

// Config is one recorded concurrent run.
type Config struct {
	Clients int  // goroutines calling the receiver: one transport poller, the rest decode workers
	Ops     int  // operations to record in all
	Faults  bool // queue-pair cuts and fire-and-forget cancels
	// PrefixCache turns the receiver's prefix cache on: every request is 2
	// pages of one scope whose first page all share, so from the second on
	// a request pins a cached page, is granted one, and Finish inserts or
	// releases while other requests pin and read.
	PrefixCache bool
	Bugs        research.Switches
	Seed        uint64 // the workload's choices (the interleaving is the scheduler's)
	// Dir receives the HTML visualization of an illegal history; "" means the
	// system's temporary directory.
	Dir     string
	Timeout time.Duration // for the check; 0 means 60 s
}

// Result of a run.
type Result struct {
	Ops           int
	Partitions    int
	Result        string // "ok", "illegal" or "unknown" (the check timed out)
	Seconds       float64
	Visualization string // the HTML file of an illegal history
	PrefixHits    uint64 // requests that reused a cached page (Config.PrefixCache)
}

type recorder struct {
	mu    sync.Mutex
	start time.Time
	ops   []porcupine.Operation
	notes []porcupine.Annotation
}

// tagKey is the tag key of every queue pair here: the checks are of
// concurrency, not of who wrote a page.
var tagKey = func() *protocol.TagKey {
	k, err := protocol.NewTagKey(bytes.Repeat([]byte{0x11}, protocol.TagKeySecretSize), protocol.SumXXH3)
	if err != nil {
		panic(err)
	}
	return k
}()

func tagKeys(protocol.PeerID) *protocol.TagKey { return tagKey }

func (r *recorder) now() int64 { return time.Since(r.start).Nanoseconds() }

func (r *recorder) add(client int, in Input, call int64, out Output, ret int64) {
	r.mu.Lock()
	r.ops = append(r.ops, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
	r.mu.Unlock()
}

// defaults checks cfg and fills in its defaults.
func (cfg *Config) defaults() error {
	if cfg.Clients < 2 || cfg.Ops < 1 {
		return fmt.Errorf("linearizability: need at least 2 clients and 1 operation")
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 60 * time.Second
	}
	return nil
}

// fault records a fault that hits every request on a queue pair: one operation
// in each touched request's partition, with the fault's own times, and an
// annotation for the visualization. Requests above upTo (the highest any client
// can have reached; the frontier does not move during the fault) are still in
// state none, where a fault changes nothing and every later operation comes
// after it, so leaving them out changes no verdict.
func (r *recorder) fault(kind OpKind, peer protocol.PeerID, upTo protocol.RequestID, call, ret int64, what string) {
	for id := protocol.RequestID(1); id <= upTo; id++ {
		if protocol.PeerID(int(id)%peers) == peer {
			r.add(0, Input{kind, id}, call, Output{OK: true}, ret)
		}
	}
	r.mu.Lock()
	r.notes = append(r.notes, porcupine.Annotation{Tag: "faults", Start: call, End: ret, Description: what, BackgroundColor: "#ffd6d6"})
	r.mu.Unlock()
}

// workers starts client goroutines 1..cfg.Clients-1, each with its own seeded
// generator, which share n operations (act makes one). Each worker spreads its
// operations over the transport's run: its k-th waits until the transport's
// frontier has reached the matching share of the requests (or the transport is
// done), so that calls race with every request's Bootstrap and Done rather than
// piling up on the first ones.
func workers(cfg Config, n, requests int, frontier *atomic.Uint64, transportDone *atomic.Bool, wg *sync.WaitGroup, act func(c int, rng *rand.Rand)) {
	clients := cfg.Clients - 1
	for c := 1; c <= clients; c++ {
		ops := n / clients
		if c <= n%clients {
			ops++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(cfg.Seed, uint64(c)))
			for k := range ops {
				for target := uint64(1 + k*requests/ops); frontier.Load() < target && !transportDone.Load(); {
					runtime.Gosched()
				}
				act(c, rng)
			}
		}()
	}
}

// transportShare is how many operations the transport records for a run of n:
// about two per request (Bootstrap and Done, or Grant and a completion).
func transportShare(n int) (requests, ops int) {
	requests = max(4, n/12)
	return requests, min(n-1, 2*requests)
}

// near picks a request around the transport's frontier (from ahead of it down
// over spread requests, never below 1), so that workers race with the transport.
func near(frontier *atomic.Uint64, rng *rand.Rand, ahead, spread int) protocol.RequestID {
	return protocol.RequestID(max(1, int(frontier.Load())+ahead-rng.IntN(spread)))
}

// cancel calls do(id) and records it as an operation of kind. With async it is
// fire-and-forget: the caller does not wait, so the outcome is unknown and the
// operation returns at infinity (it may take effect any time after its call).
func (r *recorder) cancel(c int, kind OpKind, id protocol.RequestID, async bool, do func(protocol.RequestID)) {
	call := r.now()
	if async {
		go do(id)
		r.add(c, Input{kind, id}, call, Output{OK: true, Unknown: true}, math.MaxInt64)
		return
	}
	do(id)
	r.add(c, Input{kind, id}, call, Output{OK: true}, r.now())
}

const peers = 2 // requests alternate between two prefill nodes' queue pairs

// Run records a history from a real concurrent run of protocol.SharedReceiver
// and checks it.
func Run(cfg Config) (*Result, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	start := time.Now()
	requests, transportOps := transportShare(cfg.Ops)
	// The decode node's pages. Only the transport goroutine writes them, and
	// it does so before the Done that makes the receiver read them.
	pagesPer := 1
	if cfg.PrefixCache {
		pagesPer = 2
	}
	mem := protocoltest.NewMemory(pagesPer*requests, 32)
	rc := protocol.ReceiverConfig{Pages: pagesPer * requests, PageTokens: 4, Memory: mem, TagKeys: tagKeys,
		Region: func(p uint32) (uint64, uint32) { return uint64(p), 1 }, Research: cfg.Bugs.Without(research.Concurrency()...)}
	if cfg.PrefixCache {
		// The harness is its own router: every Bootstrap's scope is the one it chose.
		rc.PrefixCache, rc.Authorize = true, func(protocol.PeerID, *protocol.Bootstrap) error { return nil }
	}
	recv, err := racy.NewReceiver(rc, cfg.Bugs)
	if err != nil {
		return nil, err
	}
	rec := &recorder{start: time.Now()}
	var frontier atomic.Uint64 // the highest request the transport has started
	frontier.Store(1)
	var wg sync.WaitGroup
	var transportDone atomic.Bool

	// The transport's poller: Bootstrap, the sender's WRITEs (payload and tag
	// record), Done; and, with faults, queue-pair cuts.
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer transportDone.Store(true)
		rng := rand.New(rand.NewPCG(cfg.Seed, 0))
		now := time.Unix(0, 0)
		for id := protocol.RequestID(1); int(id) <= requests; id++ {
			frontier.Store(uint64(id))
			peer := protocol.PeerID(int(id) % peers)
			call := rec.now()
			boot := &protocol.Bootstrap{Request: id, Tokens: 4}
			if cfg.PrefixCache {
				boot = &protocol.Bootstrap{Request: id, Tokens: 8, Scope: 1, Chain: chainOf(id)}
			}
			err := recv.Step(peer, boot, now)
			rec.add(0, Input{OpBootstrap, id}, call, Output{OK: err == nil}, rec.now())
			done := &protocol.Done{Request: id, Tokens: boot.Tokens, Pages: 1}
			for _, s := range recv.Effects().Sends {
				if g, ok := s.Msg.(*protocol.Grant); ok && g.Request == id {
					k := int(g.Prefix) / 4
					done.Pages, done.Prefix = uint32(len(g.Pages)), g.Prefix
					for j, p := range g.Pages {
						copy(mem.Payload(p.Page), fmt.Sprintf("kv of request %d page %d", id, k+j))
						copy(mem.TagRecord(p.Page), protocol.Tag{Request: id, Epoch: p.Epoch, Index: uint32(k + j), Tokens: 4, Sum: checksum.Sum(mem.Payload(p.Page))}.Append(nil, tagKey))
					}
				}
			}
			if cfg.Faults && rng.IntN(25) == 0 {
				cut := protocol.PeerID(rng.IntN(peers))
				call := rec.now()
				recv.QueuePairFenced(cut)
				ret := rec.now()
				rec.fault(OpCut, cut, id, call, ret, fmt.Sprintf("cut queue pair %d", cut)) // workers reach up to the frontier
			}
			call = rec.now()
			err = recv.Step(peer, done, now)
			rec.add(0, Input{OpDone, id}, call, Output{OK: err == nil}, rec.now())
			recv.Effects()
			// The workers' turn: on one core (GOMAXPROCS=1) the poller
			// otherwise ran every request before a worker ran at all, so no
			// Finish came between two Bootstraps (no prefix hit in five
			// runs) and the workers met no request on its way.
			runtime.Gosched()
		}
	}()

	// Decode workers: status, acquire, finish, and the router's cancels, on
	// requests near the transport's frontier so that they race with it.
	workers(cfg, cfg.Ops-transportOps, requests, &frontier, &transportDone, &wg, func(c int, rng *rand.Rand) {
		id := near(&frontier, rng, 0, 4)
		call := rec.now()
		switch x := rng.IntN(10); {
		case x < 3:
			st := recv.Status(id)
			rec.add(c, Input{OpStatus, id}, call, Output{OK: true, Status: st}, rec.now())
		case x < 6:
			_, err := recv.Acquire(id)
			rec.add(c, Input{OpAcquire, id}, call, Output{OK: err == nil}, rec.now())
		case x < 8:
			err := recv.Finish(id)
			rec.add(c, Input{OpFinish, id}, call, Output{OK: err == nil}, rec.now())
		default:
			rec.cancel(c, OpCancel, id, cfg.Faults && x == 9, recv.Cancel)
		}
	})
	wg.Wait()
	// Let fire-and-forget cancels land before the run is torn down.
	time.Sleep(10 * time.Millisecond)

	res, err := check(Model.ToModel(), rec, cfg, start)
	if res != nil {
		res.PrefixHits = recv.Stats().PrefixHits
	}
	return res, err
}

// check runs porcupine on a recorded history and, if it is illegal, writes the
// visualization of the first illegal partition.
func check(model porcupine.Model, rec *recorder, cfg Config, start time.Time) (*Result, error) {
	res := &Result{Ops: len(rec.ops), Partitions: len(model.Partition(rec.ops))}
	verdict, info := porcupine.CheckOperationsVerbose(model, rec.ops, cfg.Timeout)
	switch verdict {
	case porcupine.Ok:
		res.Result = "ok"
	case porcupine.Illegal:
		res.Result = "illegal"
		// Show the first illegal partition only: the whole history renders to
		// tens of megabytes, which a browser opens slowly.
		single := model
		single.Partition, single.PartitionEvent = nil, nil
		for _, part := range model.Partition(rec.ops) {
			if v, partInfo := porcupine.CheckOperationsVerbose(single, part, cfg.Timeout); v == porcupine.Illegal {
				info = partInfo
				break
			}
		}
		info.AddAnnotations(rec.notes)
		dir := cfg.Dir
		if dir == "" {
			dir = os.TempDir()
		}
		path := filepath.Join(dir, fmt.Sprintf("kvhandoff-lincheck-%d-%d.html", cfg.Seed, time.Now().UnixNano()))
		if err := porcupine.VisualizePath(model, info, path); err != nil {
			return nil, err
		}
		res.Visualization = path
	default:
		res.Result = "unknown"
	}
	res.Seconds = time.Since(start).Seconds()
	return res, nil
}

// chainOf is request id's prompt chain with the prefix cache: 2 pages of 4
// tokens, the first the same for every request, the second its own.
func chainOf(id protocol.RequestID) []protocol.ChainHash {
	return protocol.PrefixChain([]uint32{1, 2, 3, 4, uint32(id), 0, 0, 0}, 4)
}

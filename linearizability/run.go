package linearizability

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/protocol/checksum"
)

// Config is one recorded concurrent run.
type Config struct {
	Clients int  // goroutines calling the receiver: one transport poller, the rest decode workers
	Ops     int  // operations to record in all
	Faults  bool // queue-pair cuts and fire-and-forget cancels
	Bugs    research.Switches
	Seed    uint64 // the workload's choices (the interleaving is the scheduler's)
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
}

type recorder struct {
	mu    sync.Mutex
	start time.Time
	ops   []porcupine.Operation
	notes []porcupine.Annotation
}

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

// newBudget is a channel holding one token per operation to record; the
// recording goroutines stop when it runs dry.
func newBudget(n int) chan struct{} {
	b := make(chan struct{}, n)
	for range n {
		b <- struct{}{}
	}
	close(b)
	return b
}

// fault records a fault that hits every request on a queue pair: one operation
// in each request's partition, with the fault's own times, and an annotation
// for the visualization.
func (r *recorder) fault(kind OpKind, peer protocol.PeerID, requests int, call, ret int64, what string) {
	for id := protocol.RequestID(1); int(id) <= requests; id++ {
		if protocol.PeerID(int(id)%peers) == peer {
			r.add(0, Input{kind, id}, call, Output{OK: true}, ret)
		}
	}
	r.mu.Lock()
	r.notes = append(r.notes, porcupine.Annotation{Tag: "faults", Start: call, End: ret, Description: what, BackgroundColor: "#ffd6d6"})
	r.mu.Unlock()
}

// pageMemory is the decode node's pages. Only the transport goroutine writes
// them, and it does so before the Done that makes the receiver read them.
type pageMemory struct{ payload, tags [][]byte }

func (m *pageMemory) TagRecord(p uint32) []byte { return m.tags[p] }
func (m *pageMemory) Payload(p uint32) []byte   { return m.payload[p] }

const peers = 2 // requests alternate between two prefill nodes' queue pairs

// Run records a history from a real concurrent run of protocol.SharedReceiver
// and checks it.
func Run(cfg Config) (*Result, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	start := time.Now()
	requests := max(4, cfg.Ops/12)
	mem := &pageMemory{}
	for range requests {
		mem.payload = append(mem.payload, make([]byte, 32))
		mem.tags = append(mem.tags, make([]byte, protocol.TagSize))
	}
	recv, err := protocol.NewSharedReceiver(protocol.ReceiverConfig{Pages: requests, PageTokens: 4, Memory: mem,
		Region: func(p uint32) (uint64, uint32) { return uint64(p), 1 }, Research: cfg.Bugs})
	if err != nil {
		return nil, err
	}
	rec := &recorder{start: time.Now()}
	var frontier sync.Map // highest request the transport has started, for the workers
	frontier.Store(0, protocol.RequestID(1))
	var wg sync.WaitGroup
	budget := newBudget(cfg.Ops)
	done := make(chan struct{})

	// The transport's poller: Bootstrap, the sender's WRITEs (payload and tag
	// record), Done; and, with faults, queue-pair cuts.
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(done)
		rng := rand.New(rand.NewPCG(cfg.Seed, 0))
		now := time.Unix(0, 0)
		for id := protocol.RequestID(1); int(id) <= requests; id++ {
			frontier.Store(0, id)
			peer := protocol.PeerID(int(id) % peers)
			if _, ok := <-budget; !ok {
				return
			}
			call := rec.now()
			err := recv.Step(peer, &protocol.Bootstrap{Request: id, Tokens: 4}, now)
			rec.add(0, Input{OpBootstrap, id}, call, Output{OK: err == nil}, rec.now())
			for _, s := range recv.Effects().Sends {
				if g, ok := s.Msg.(*protocol.Grant); ok && g.Request == id {
					p := g.Pages[0]
					copy(mem.payload[p.Page], fmt.Sprintf("kv of request %d", id))
					copy(mem.tags[p.Page], protocol.Tag{Request: id, Epoch: p.Epoch, Index: 0, Tokens: 4, Sum: checksum.Sum(mem.payload[p.Page])}.Append(nil))
				}
			}
			if cfg.Faults && rng.IntN(25) == 0 {
				cut := protocol.PeerID(rng.IntN(peers))
				call := rec.now()
				recv.QueuePairFenced(cut)
				ret := rec.now()
				rec.fault(OpCut, cut, requests, call, ret, fmt.Sprintf("cut queue pair %d", cut))
			}
			if _, ok := <-budget; !ok {
				return
			}
			call = rec.now()
			err = recv.Step(peer, &protocol.Done{Request: id, Tokens: 4, Pages: 1}, now)
			rec.add(0, Input{OpDone, id}, call, Output{OK: err == nil}, rec.now())
			recv.Effects()
		}
	}()

	// Decode workers: status, acquire, finish, and the router's cancels, on
	// requests near the transport's frontier so that they race with it.
	for c := 1; c < cfg.Clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(cfg.Seed, uint64(c)))
			for range budget {
				f, _ := frontier.Load(0)
				top := int(f.(protocol.RequestID))
				id := protocol.RequestID(max(1, top-rng.IntN(4)))
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
				case cfg.Faults && x == 9:
					// Fire-and-forget: the caller does not wait, so the outcome is
					// unknown; it may take effect any time after the call.
					go recv.Cancel(id)
					rec.add(c, Input{OpCancel, id}, call, Output{OK: true, Unknown: true}, math.MaxInt64)
				default:
					recv.Cancel(id)
					rec.add(c, Input{OpCancel, id}, call, Output{OK: true}, rec.now())
				}
			}
		}()
	}
	wg.Wait()
	<-done
	// Let fire-and-forget cancels land before the run is torn down.
	time.Sleep(10 * time.Millisecond)

	return check(Model.ToModel(), rec, cfg, start)
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

package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// spyDevice is the rogue's RDMA device: the fabric's, with its queue pairs
// and regions kept so the test can post WRITEs of its own on them, and the
// remote addresses and keys of the endpoint's own WRITEs (its Grants') kept
// as what the rogue has learned.
type spyDevice struct {
	rdma.Device
	s *spy
}

type spy struct {
	mu      sync.Mutex
	qp      rdma.QueuePair
	src     rdma.MemoryRegion // the largest region: the endpoint's source pages
	pd      rdma.ProtectionDomain
	learnt  map[uint32]uint64 // key -> the lowest address the endpoint wrote under it
	highest map[uint32]uint64 // key -> the highest
}

func (d spyDevice) AllocPD() (rdma.ProtectionDomain, error) {
	pd, err := d.Device.AllocPD()
	if err != nil {
		return nil, err
	}
	d.s.mu.Lock()
	d.s.pd = pd
	d.s.mu.Unlock()
	return spyPD{pd, d.s}, nil
}

type spyPD struct {
	rdma.ProtectionDomain
	s *spy
}

func (p spyPD) keep(m rdma.MemoryRegion, err error) (rdma.MemoryRegion, error) {
	if err == nil {
		p.s.mu.Lock()
		if p.s.src == nil || m.Len() > p.s.src.Len() {
			p.s.src = m
		}
		p.s.mu.Unlock()
	}
	return m, err
}

func (p spyPD) Alloc(size int, access rdma.Access) (rdma.MemoryRegion, error) {
	return p.keep(p.ProtectionDomain.Alloc(size, access))
}

func (p spyPD) Register(buf []byte, access rdma.Access) (rdma.MemoryRegion, error) {
	return p.keep(p.ProtectionDomain.Register(buf, access))
}

func (p spyPD) Deregister(m rdma.MemoryRegion) error {
	if d, ok := p.ProtectionDomain.(rdma.Deregistrar); ok {
		return d.Deregister(m)
	}
	return nil
}

func (p spyPD) CreateQP(sendCQ, recvCQ rdma.CompletionQueue, depth int) (rdma.QueuePair, error) {
	qp, err := p.ProtectionDomain.CreateQP(sendCQ, recvCQ, depth)
	if err != nil {
		return nil, err
	}
	q := spyQP{qp, p.s}
	p.s.mu.Lock()
	p.s.qp = q
	p.s.mu.Unlock()
	return q, nil
}

type spyQP struct {
	rdma.QueuePair
	s *spy
}

func (q spyQP) PostSend(wr rdma.WorkRequest) error {
	if wr.Op == rdma.OpWrite || wr.Op == rdma.OpWriteImm {
		q.s.mu.Lock()
		if a, ok := q.s.learnt[wr.RKey]; !ok || wr.RemoteAddr < a { // the lowest: a page's start, not its tag record
			q.s.learnt[wr.RKey] = wr.RemoteAddr
		}
		q.s.highest[wr.RKey] = max(q.s.highest[wr.RKey], wr.RemoteAddr)
		q.s.mu.Unlock()
	}
	return q.QueuePair.PostSend(wr)
}

// rogueWRID names no queue pair of the endpoint (transfer's work request
// ids carry a peer id): its completions of the rogue's own WRITEs are ignored.
const rogueWRID = uint64(0x7fffffff) << 32

// rogueCounts are what the attack did.
type rogueCounts struct {
	rounds, writes, refused, unbroken, intruderRefused atomic.Int64
}

// attackDecode runs the rogue until ctx ends: round after round it
// connects a queue pair to decode-0 as prefill-9 (listed, its certificate
// the authority's), sends a Bootstrap with a valid ticket and one without,
// learns its Grant's keys and addresses from its own WRITEs, then sprays
// 256-byte WRITEs of 0xEE with each learnt key, each with a bit flipped, 0 and
// a random key, at every page slot around its grant, nearest first (the
// pool's size is in the registry), skipping only its own pages under their
// own key. A refused WRITE breaks its queue pair; the next round dials again.
// Meanwhile an unlisted certificate (intruder) dials again and again.
func attackDecode(ctx context.Context, t *testing.T, l *Local, pageBytes int, c *rogueCounts) {
	slot := uint64(pageBytes + protocol.TagSize)
	rng := rand.New(rand.NewPCG(7, 7))
	d := l.Decodes[0]
	d.mu.Lock()
	addr := d.self.Transfer
	d.mu.Unlock()
	setup := func(name string) transfer.SetupConfig {
		tc, err := l.ca.ConfigAs(name, pki.RolePrefill)
		if err != nil {
			t.Error(err)
		}
		return transfer.SetupConfig{Name: name, TLS: tc, Timeout: 5 * time.Second, Log: quietLog()}
	}
	intruded := make(chan struct{})
	go func() { // an unlisted name, with the authority's certificate
		defer close(intruded)
		for ctx.Err() == nil {
			ep, err := transfer.NewPrefill(l.fabric.Device("intruder"), transfer.PrefillConfig{Pages: 8, PageTokens: l.cfg.PageTokens, PageBytes: pageBytes})
			if err != nil {
				t.Error(err)
				return
			}
			err = ep.Dial(ctx, "decode-0", addr, setup("intruder"))
			ep.Close()
			switch {
			case ctx.Err() != nil:
			case errors.Is(err, transfer.ErrSetup):
				c.intruderRefused.Add(1)
			default:
				t.Errorf("intruder (unlisted) connected a queue pair: %v", err)
			}
		}
	}()
	defer func() { <-intruded }()
	id := protocol.RequestID(1 << 40)
	for ctx.Err() == nil {
		c.rounds.Add(1)
		s := &spy{learnt: map[uint32]uint64{}, highest: map[uint32]uint64{}}
		ep, err := transfer.NewPrefill(spyDevice{l.fabric.Device("prefill-9"), s}, transfer.PrefillConfig{Pages: 64, PageTokens: l.cfg.PageTokens, PageBytes: pageBytes})
		if err != nil {
			t.Error(err)
			return
		}
		rctx, stop := context.WithCancel(ctx)
		go ep.Run(rctx)
		func() {
			defer ep.Close()
			defer stop()
			if err := ep.Dial(ctx, "decode-0", addr, setup("prefill-9")); err != nil {
				if ctx.Err() == nil {
					t.Errorf("prefill-9 (listed) did not connect: %v", err)
				}
				return
			}
			id += 2
			tk, err := SignTicket(l.ticketKey, Ticket{Request: id, Tokens: 4 * uint32(l.cfg.PageTokens), Prefill: "prefill-9", Decode: "decode-0", Expires: time.Now().Add(time.Minute)})
			if err != nil {
				t.Error(err)
				return
			}
			if err := ep.SubmitTicket(id, "decode-0", 4*l.cfg.PageTokens, tk); err != nil {
				t.Error(err)
				return
			}
			if err := ep.SubmitTicket(id+1, "decode-0", 4*l.cfg.PageTokens, nil); err != nil {
				t.Error(err)
				return
			}
			for range 200 { // its own WRITEs: the Grant's keys
				s.mu.Lock()
				n := len(s.learnt)
				s.mu.Unlock()
				if n > 0 || ctx.Err() != nil {
					break
				}
				time.Sleep(5 * time.Millisecond)
			}
			s.mu.Lock()
			qp, src, pd := s.qp, s.src, s.pd
			var keys []uint32
			var near uint64
			own := map[uint32][2]uint64{} // its own grant's range under each key
			for k, a := range s.learnt {
				keys, near, own[k] = append(keys, k), a, [2]uint64{a, s.highest[k]}
			}
			for k := range own {
				keys = append(keys, k^1)
			}
			s.mu.Unlock()
			if qp == nil || src == nil || len(keys) == 0 {
				return
			}
			keys = append(keys, 0, rng.Uint32())
			if held, _ := d.Endpoint().PeerUse("prefill-9"); held > 1 {
				t.Errorf("prefill-9 holds %d requests: only its ticketed one may reserve pages", held)
			}
			// The rogue's bytes come from a region of their own: its
			// source pages are its own request's, whose WRITEs may still
			// read them (a provider reads a WRITE's source when it runs it),
			// and bytes of its own Grant's pages are allowed to land.
			rogue, err := pd.Alloc(256, rdma.LocalWrite)
			if err != nil {
				t.Error(err)
				return
			}
			for i := range 256 {
				rogue.Bytes()[i] = 0xEE
			}
			pages, posted := int64(l.cfg.DecodePages), 0
			defer func() {
				switch {
				case posted == 0:
				case qp.State() != rdma.StateRTS:
					c.refused.Add(1)
				case ctx.Err() == nil:
					c.unbroken.Add(1) // every slot sprayed, the queue pair up
				}
			}()
			for _, key := range keys { // learnt keys first, then guesses
				for j := int64(0); j < 2*pages && ctx.Err() == nil; j++ {
					off := (j + 1) / 2 // 0, 1, -1, 2, -2, ...: the nearest slots first
					if j%2 == 0 {
						off = -off
					}
					target := near + uint64(off)*slot
					if r, ok := own[key]; ok && target >= r[0] && target <= r[1] {
						continue // its own granted pages under their own key: allowed
					}
					if qp.State() != rdma.StateRTS {
						return
					}
					if err := qp.PostSend(rdma.WorkRequest{ID: rogueWRID, Op: rdma.OpWrite, Local: rdma.SGE{MR: rogue, Length: 256},
						RemoteAddr: target, RKey: key}); err != nil {
						return
					}
					posted++
					c.writes.Add(1)
					for range 200 { // the first WRITE decided: refused breaks the queue pair
						if posted > 1 || qp.State() != rdma.StateRTS {
							break
						}
						time.Sleep(time.Millisecond)
					}
				}
			}
		}()
	}
}

// A peer with a valid certificate of any name cannot produce one wrong 200:
// while 36 clients' completions run over the handoff, a rogue prefill
// endpoint with the authority's certificate, as prefill-9 (a name the
// registry lists) and as intruder (one it does not), attacks decode-0 for the
// whole run (attackDecode). Every answer is 200 with the colocated run's text
// or an explicit error; the intruder never gets a queue pair; every WRITE the
// rogue aims at the pool is refused and breaks its queue pair; the rogue holds
// no pages once its queue pairs are gone. With pool-wide-key on the decode
// node the rogue's learnt key opens the pool: its WRITEs land and its queue
// pair stays up.
func TestARoguePeerWithAValidCertificateGetsNoWrong200(t *testing.T) {
	for _, sw := range []research.Switches{{}, research.On(research.PoolWideKey)} {
		t.Run(sw.String(), func(t *testing.T) {
			if sw.Any() && testing.Short() {
				t.Skip("the switched-off defense's run: without -short")
			}
			rogueRun(t, sw)
		})
	}
}

func rogueRun(t *testing.T, sw research.Switches) {
	m := llama.Builtin(5)
	pageBytes := engine.GeometryOf(m.Config, 16).PageBytes()
	l, err := StartLocal(LocalConfig{PrefillPages: 160, DecodePages: 160, PageTokens: 16, Model: m, Timeout: 30 * time.Second, Log: quietLog(), Research: sw})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := l.Registry.Register(ctx, Member{Name: "prefill-9", Role: RolePrefill, PoolPages: 64, PageTokens: 16, PageBytes: pageBytes,
		Model: "other-model"}); err != nil { // another model: the router sends it nothing of its own
		t.Fatal(err)
	}
	const requests, clients = 36, 6
	ps := prompts(requests, 17)
	want := make([]string, len(ps))
	for i, p := range ps {
		want[i] = colocated(t, m, 16, p, 8+i%9)
	}
	var c rogueCounts
	attackCtx, stopAttack := context.WithCancel(ctx)
	attacked := make(chan struct{})
	go func() {
		defer close(attacked)
		attackDecode(attackCtx, t, l, pageBytes, &c)
	}()
	for c.writes.Load() == 0 && c.rounds.Load() < 50 { // the attack under way before the first client
		time.Sleep(5 * time.Millisecond)
	}
	clientsBegan := time.Now()
	var right, explicit, wrong atomic.Int64
	next := make(chan int, requests)
	for i := range ps {
		next <- i
	}
	close(next)
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for i := range next {
				a, err := complete(ctx, l.API, fmt.Sprintf("tenant-%d", i%7), ps[i], 8+i%9)
				switch {
				case err != nil:
					t.Errorf("request %d: no HTTP answer: %v", i, err)
				case a.code != http.StatusOK:
					explicit.Add(1)
					t.Logf("request %d: explicit %d %s", i, a.code, a.err)
				case a.text != want[i]:
					wrong.Add(1)
					t.Logf("request %d: a WRONG 200: %q over the handoff, %q colocated", i, a.text, want[i])
				default:
					right.Add(1)
				}
			}
		})
	}
	wg.Wait()
	for deadline := time.Now().Add(10 * time.Second); c.intruderRefused.Load() == 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond) // the intruder's refusal takes its handshake's time
	}
	stopAttack()
	<-attacked
	landed := 0 // pages the rogue's bytes are in (none of them its own: it never WRITEs its own pages)
	for _, page := range l.Decodes[0].Endpoint().Pages() {
		if bytes.Equal(page[:256], bytes.Repeat([]byte{0xEE}, 256)) {
			landed++
		}
	}
	t.Logf("clients done in %v; the rogue's bytes are in %d decode pages", time.Since(clientsBegan), landed)
	t.Logf("%s: answers right %d, explicit errors %d, wrong 200s %d; rogue rounds %d, WRITEs %d, rounds its queue pair broke (WRITE refused) %d, rounds it survived %d; intruder refused at the handshake %d",
		sw, right.Load(), explicit.Load(), wrong.Load(), c.rounds.Load(), c.writes.Load(), c.refused.Load(), c.unbroken.Load(), c.intruderRefused.Load())
	if c.writes.Load() == 0 {
		t.Fatal("the rogue posted no WRITE: the test attacked nothing")
	}
	if sw.Any() {
		if landed == 0 && c.unbroken.Load() == 0 {
			t.Fatalf("under %s the rogue's learnt key should open the pool: its bytes are in no decode page, no round's queue pair survived", sw)
		}
		return
	}
	if landed != 0 {
		t.Fatalf("the rogue's WRITEs landed in %d decode pages", landed)
	}
	if wrong.Load() != 0 {
		t.Fatalf("%d wrong 200s", wrong.Load())
	}
	if right.Load() == 0 {
		t.Fatal("no answer was right: the comparison saw nothing")
	}
	if c.unbroken.Load() != 0 || c.refused.Load() == 0 {
		t.Fatalf("the rogue's queue pair survived its WRITEs in %d rounds (%d broke)", c.unbroken.Load(), c.refused.Load())
	}
	if c.intruderRefused.Load() == 0 {
		t.Fatal("the intruder never tried")
	}
	d := l.Decodes[0].Endpoint()
	eventually := time.Now().Add(10 * time.Second)
	for {
		held, pages := d.PeerUse("prefill-9")
		if held == 0 && pages == 0 {
			break
		}
		if time.Now().After(eventually) {
			t.Fatalf("after the attack prefill-9 holds %d requests, %d pages", held, pages)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

package transfer

import (
	"context"
	"errors"
	"testing"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// slowKV computes request 1's KV only when release is closed (an engine's
// long prefill); every other request's at once.
type slowKV struct {
	started, release chan struct{}
}

func (s slowKV) FillKV(id protocol.RequestID, tokens int, pages []uint32, memory [][]byte) error {
	if id == 1 {
		close(s.started)
		<-s.release
	}
	return GeneratedKV{PageTokens: pageTokens}.FillKV(id, tokens, pages, memory)
}

// slowPair is a prefill and a decode node on their own run loops, whose KV
// source holds request 1 until the test releases it.
func slowPair(t *testing.T, provider string) (p *Prefill, d *Decode, pn, dn *node, kv slowKV) {
	ctx, cancel := context.WithCancel(context.Background())
	devs := devices(t, provider, "prefill", "decode")
	kv = slowKV{started: make(chan struct{}), release: make(chan struct{})}
	var err error
	if p, err = NewPrefill(devs[0], PrefillConfig{Pages: 128, PageTokens: pageTokens, PageBytes: pageBytes, KV: kv}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	d = newDecode(t, devs[1])
	if err := ConnectLocal(p, "prefill", d, "decode"); err != nil {
		t.Fatal(err)
	}
	pn, dn = runNode(t, ctx, p, nil), runNode(t, ctx, d, d)
	t.Cleanup(cancel) // before the run loops' cleanups wait for them (cleanups run last first)
	return p, d, pn, dn, kv
}

// While one request's KV is being computed, the endpoint goes on: another
// request is handed off, verified and read meanwhile. The computing request's
// Bootstrap went out first, so decode has reserved it.
func TestComputingKVDoesNotStopTheEndpoint(t *testing.T) {
	for _, provider := range providerNames() {
		t.Run(provider, func(t *testing.T) {
			p, d, pn, dn, kv := slowPair(t, provider)
			submitted := make(chan error, 1)
			go func() { submitted <- p.Submit(1, "decode", 64) }()
			<-kv.started
			if err := p.Submit(2, "decode", 100); err != nil {
				t.Fatal(err)
			}
			if err := dn.wait(2)[2]; err != nil {
				t.Fatalf("request 2, handed off while request 1 computes: %v", err)
			}
			eventually(t, "decode reserves request 1 while its KV is computed", func() bool { return d.Status(1) == protocol.ReceiverReserved })
			close(kv.release)
			if err := <-submitted; err != nil {
				t.Fatal(err)
			}
			if err := dn.wait(1)[1]; err != nil {
				t.Fatal(err)
			}
			if err := pn.wait(1, 2)[1]; err != nil {
				t.Fatal(err)
			}
		})
	}
}

// What would free a computing request's source pages waits until its KV is
// computed: a cancel on both nodes (the decode node's Abort arrives at the
// prefill node mid-compute), or a cut of its queue pair. The pages stay the
// request's throughout; afterwards the request ends as it must.
func TestWhatWouldFreeAComputingRequestsPagesWaits(t *testing.T) {
	for name, stop := range map[string]struct {
		do      func(p *Prefill, d *Decode)
		arrived func(p *Prefill, d *Decode) bool
		want    error
	}{
		"cancel on both nodes": {func(p *Prefill, d *Decode) { d.Cancel(1); p.Cancel(1) },
			func(p *Prefill, d *Decode) bool { return p.held(1) > 0 }, protocol.ErrCancelled},
		"cut": {func(p *Prefill, d *Decode) { p.Cut("decode") },
			func(p *Prefill, d *Decode) bool { return len(p.Peers()) == 0 }, protocol.ErrPeerFailed},
	} {
		t.Run(name, func(t *testing.T) {
			for _, provider := range providerNames() {
				t.Run(provider, func(t *testing.T) {
					p, d, pn, _, kv := slowPair(t, provider)
					submitted := make(chan error, 1)
					go func() { submitted <- p.Submit(1, "decode", 64) }() // 4 pages
					<-kv.started
					eventually(t, "decode reserves request 1", func() bool { return d.Status(1) == protocol.ReceiverReserved })
					stop.do(p, d)
					eventually(t, "what would free the pages arrives", func() bool { return stop.arrived(p, d) })
					if free := p.Stats().PagesFree; free != 128-4 {
						t.Fatalf("%d source pages free while request 1's KV is computed, want %d", free, 128-4)
					}
					close(kv.release)
					if err := <-submitted; err != nil {
						t.Fatal(err)
					}
					if err := pn.wait(1)[1]; !errors.Is(err, stop.want) {
						t.Fatalf("prefill: %v, want %v", err, stop.want)
					}
					eventually(t, "the source pages come back", func() bool { return p.Stats().PagesFree == 128 })
				})
			}
		})
	}
}

// held is how many messages wait for request id's KV to be computed.
func (p *Prefill) held(id protocol.RequestID) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if st := p.computing[id]; st != nil {
		return len(st.held)
	}
	return 0
}

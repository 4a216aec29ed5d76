package transfer

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
)

// mesh is prefill and decode nodes, each on its own Run loop, every prefill
// node connected to every decode node by Dial and Serve over TLS.
type mesh struct {
	t        *testing.T
	prefills map[string]*Prefill
	decodes  map[string]*Decode
	nodes    map[string]*node
}

func newMesh(t *testing.T, ctx context.Context, provider string, prefills, decodes []string) *mesh {
	t.Helper()
	ca := newTestCA(t)
	m := &mesh{t: t, prefills: map[string]*Prefill{}, decodes: map[string]*Decode{}, nodes: map[string]*node{}}
	devs := devices(t, provider, append(append([]string{}, prefills...), decodes...)...)
	addrs := map[string]string{}
	for i, name := range decodes {
		d := newDecode(t, devs[len(prefills)+i])
		ln := listen(t)
		go d.Serve(ctx, ln, SetupConfig{Name: name, TLS: ca.config(t, name), Log: quiet})
		m.decodes[name], m.nodes[name], addrs[name] = d, runNode(t, ctx, d, d), ln.Addr().String()
	}
	for i, name := range prefills {
		p := newPrefill(t, devs[i])
		m.prefills[name], m.nodes[name] = p, runNode(t, ctx, p, nil)
		for _, peer := range decodes {
			if err := p.Dial(ctx, peer, addrs[peer], SetupConfig{Name: name, TLS: ca.config(t, name), Log: quiet}); err != nil {
				t.Fatal(err)
			}
		}
	}
	for name, d := range m.decodes {
		eventually(t, name+" sees every prefill node", func() bool { return len(d.Peers()) == len(prefills) })
	}
	return m
}

// holdAll pauses every decode node's queue pairs: Grants wait in the
// network, so every request stays reserved until the returned resume.
func (m *mesh) holdAll() (resume func()) {
	var held []rdma.Faults
	for _, d := range m.decodes {
		d.mu.Lock()
		for _, c := range d.names {
			qp := c.qp.(rdma.Faults)
			qp.Pause()
			held = append(held, qp)
		}
		d.mu.Unlock()
	}
	return func() {
		for _, qp := range held {
			qp.Resume()
		}
	}
}

// leg is one request: which prefill and decode node it ran between.
type leg struct{ prefill, decode string }

// run submits perPair requests between every prefill and decode node.
func (m *mesh) run(perPair int) map[protocol.RequestID]leg {
	legs := map[protocol.RequestID]leg{}
	id := protocol.RequestID(0)
	for i := 0; i < perPair; i++ {
		for pname, p := range m.prefills {
			for dname := range m.decodes {
				id++
				if err := p.Submit(id, dname, int(id%3+1)*pageTokens-int(id%5)); err != nil { // 1 to 3 pages
					m.t.Fatal(err)
				}
				legs[id] = leg{pname, dname}
			}
		}
	}
	return legs
}

// reservedAll waits until every request is reserved on its decode node.
func (m *mesh) reservedAll(legs map[protocol.RequestID]leg) {
	m.t.Helper()
	eventually(m.t, "every request reserved", func() bool {
		for id, l := range legs {
			if m.decodes[l.decode].Status(id) != protocol.ReceiverReserved {
				return false
			}
		}
		return true
	})
}

// check waits for every outcome on both legs: requests between the victim
// pair fail with ErrPeerFailed on both nodes, every other one succeeds.
func (m *mesh) check(legs map[protocol.RequestID]leg, victim leg) {
	m.t.Helper()
	byNode := map[string][]protocol.RequestID{}
	for id, l := range legs {
		byNode[l.prefill] = append(byNode[l.prefill], id)
		byNode[l.decode] = append(byNode[l.decode], id)
	}
	failed := 0
	for name, ids := range byNode {
		for id, err := range m.nodes[name].wait(ids...) {
			switch l := legs[id]; {
			case l == victim:
				failed++
				if !errors.Is(err, protocol.ErrPeerFailed) {
					m.t.Fatalf("%s: request %d on the cut queue pair %v: %v, want ErrPeerFailed", name, id, l, err)
				}
			case err != nil:
				m.t.Fatalf("%s: request %d between %v, not on the cut queue pair: %v", name, id, l, err)
			}
		}
	}
	if failed == 0 {
		m.t.Fatal("no request was on the cut queue pair")
	}
	for name, p := range m.prefills {
		eventually(m.t, name+"'s pages free", func() bool { return p.Stats().PagesFree == 128 })
	}
	for name, d := range m.decodes {
		eventually(m.t, name+"'s pages free", func() bool { return d.Stats().PagesFree == 256 })
	}
}

// One prefill node feeds three decode nodes; with every request reserved and
// its Grant held in the network, the queue pair to one of them is cut: only
// its requests fail, on both nodes, and the others complete.
func TestOnePrefillFeedsThreeDecodesAndACutFailsOnlyItsRequests(t *testing.T) {
	for _, provider := range providerNames() {
		t.Run(provider, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			m := newMesh(t, ctx, provider, []string{"prefill-1"}, []string{"decode-1", "decode-2", "decode-3"})
			resume := m.holdAll()
			legs := m.run(20)
			m.reservedAll(legs)
			if err := m.prefills["prefill-1"].Cut("decode-2"); err != nil {
				t.Fatal(err)
			}
			resume()
			m.check(legs, leg{"prefill-1", "decode-2"})
		})
	}
}

// One decode node is fed by three prefill nodes; with every request reserved
// and its Grant held, it cuts the queue pair to one of them: only its
// requests fail, on both nodes, and the others complete.
func TestOneDecodeFedByThreePrefillsAndACutFailsOnlyItsRequests(t *testing.T) {
	for _, provider := range providerNames() {
		t.Run(provider, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			m := newMesh(t, ctx, provider, []string{"prefill-1", "prefill-2", "prefill-3"}, []string{"decode-1"})
			resume := m.holdAll()
			legs := m.run(20)
			m.reservedAll(legs)
			d := m.decodes["decode-1"]
			if err := d.Cut("prefill-2"); err != nil {
				t.Fatal(err)
			}
			resume()
			m.check(legs, leg{"prefill-2", "decode-1"})
			if got := fmt.Sprint(len(d.Peers()), len(m.prefills["prefill-2"].Peers())); got != "2 0" {
				t.Fatalf("live queue pairs (decode-1, prefill-2) = %s, want 2 0", got)
			}
		})
	}
}

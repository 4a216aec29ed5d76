package protocol_test

import (
	"bytes"
	"fmt"
	"time"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// pages is a node's KV memory: a payload and a tag record slot per page.
type pages struct{ payload, tags [][]byte }

func newPages(n, size int) *pages {
	p := &pages{}
	for i := 0; i < n; i++ {
		p.payload = append(p.payload, make([]byte, size))
		p.tags = append(p.tags, make([]byte, protocol.TagSize))
	}
	return p
}

func (p *pages) Page(i uint32) []byte      { return p.payload[i] }
func (p *pages) Payload(i uint32) []byte   { return p.payload[i] }
func (p *pages) TagRecord(i uint32) []byte { return p.tags[i] }

// One complete handoff of a 10-token prompt (3 pages of 4 tokens) from a
// prefill node to a decode node. The loop is the one an engine writes: feed
// events in, carry the effects out. Here "carrying" a WRITE is a copy; over RDMA
// it is a posted WRITE whose completion comes back later.
func Example() {
	const prefillPeer, decodePeer = protocol.PeerID(1), protocol.PeerID(2)
	src, dst := newPages(8, 64), newPages(8, 64)
	// The queue pair's tag key, from a secret both nodes agreed on when they
	// set it up (over TLS 1.3: 32 bytes of ExportKeyingMaterial). Each node
	// knows the key of each of its peers.
	secret := bytes.Repeat([]byte{7}, protocol.TagKeySecretSize) // a real one is random
	key, _ := protocol.NewTagKey(secret, protocol.SumXXH3)
	keyOf := func(peer protocol.PeerID) *protocol.TagKey { return key } // one peer each here
	sender, _ := protocol.NewSender(protocol.SenderConfig{Pages: 8, PageTokens: 4, Memory: src, TagKeys: keyOf})
	receiver, _ := protocol.NewReceiver(protocol.ReceiverConfig{Pages: 8, PageTokens: 4, Memory: dst,
		TagKeys: keyOf, Timeout: 5 * time.Second,
		Region: func(p uint32) (uint64, uint32) { return uint64(p) * 64, 0x1234 }})
	now := time.Now()

	// Prefill intake takes source pages; the engine computes the KV into them.
	srcPages, err := sender.Submit(42, decodePeer, 10)
	if err != nil {
		fmt.Println("rejected:", err)
		return
	}
	for i, p := range srcPages {
		copy(src.payload[p], bytes.Repeat([]byte{byte(i + 1)}, 64))
	}
	sender.Computed(42)

	for round := 0; round < 10; round++ {
		se := sender.Effects()      // take every field of each batch of effects:
		for _, op := range se.Ops { // in order, Done goes behind the WRITEs
			if w := op.Write; w != nil {
				copy(dst.payload[w.Remote.Page], src.payload[w.Source]) // the payload, then
				copy(dst.tags[w.Remote.Page], w.Tag)                    // its tag record
				sender.Completed(w.ID, nil)
				continue
			}
			if err := receiver.Step(prefillPeer, op.Msg, now); err != nil {
				fmt.Println("receiver:", err)
			}
		}
		for _, o := range se.Outcomes {
			fmt.Printf("request %d on prefill: %v\n", o.Request, o.Err)
		}
		re := receiver.Effects()
		for _, s := range re.Sends {
			sender.Step(decodePeer, s.Msg)
		}
		for _, id := range re.Verified {
			refs, err := receiver.Acquire(id) // the read-time epoch check
			if err != nil {
				fmt.Println("acquire:", err)
				continue
			}
			fmt.Printf("request %d verified: decode reads %d pages\n", id, len(refs))
			receiver.Finish(id)
		}
		for _, o := range receiver.Effects().Outcomes {
			fmt.Printf("request %d on decode: %v\n", o.Request, o.Err)
		}
	}
	fmt.Println("decode pages free:", receiver.Pool().Free(), "of", receiver.Pool().Len())
	// Output:
	// request 42 verified: decode reads 3 pages
	// request 42 on decode: <nil>
	// request 42 on prefill: <nil>
	// decode pages free: 8 of 8
}

package protocol

import (
	"testing"
	"time"
)

// nullMemory is KV memory with no payload: the benchmark measures the state
// machines, not the bytes. Tag records are kept, so verification still parses
// and checks every one.
type nullMemory struct{ tags [][]byte }

func (m *nullMemory) TagRecord(p uint32) []byte { return m.tags[p] }
func (m *nullMemory) Payload(uint32) []byte     { return nil }
func (m *nullMemory) Page(uint32) []byte        { return nil }

// BenchmarkHandoff is payload-free handoffs per second through Sender and
// Receiver together: Submit, Bootstrap, Grant, 4 WRITEs with tag records, Done,
// verification, Acquire and Finish, with every message encoded and decoded.
// Every record is kept (no Horizon), as in the first version of this
// benchmark: the maps and the heap grow with b.N.
func BenchmarkHandoff(b *testing.B) { benchmarkHandoffs(b, 0) }

// BenchmarkHandoffSteady is BenchmarkHandoff in a steady state, as a node
// runs: a Horizon on both sides, and a Tick every 256 handoffs a horizon
// apart, so ended records are forgotten and the maps stay small; and each
// direction's frames decoded by a Decoder, as a receive loop does.
func BenchmarkHandoffSteady(b *testing.B) { benchmarkHandoffs(b, time.Second) }

func benchmarkHandoffs(b *testing.B, horizon time.Duration) {
	const pages = 4
	src := &nullMemory{}
	dst := &nullMemory{tags: make([][]byte, 64)}
	for i := range dst.tags {
		dst.tags[i] = make([]byte, TagSize)
	}
	s, _ := NewSender(SenderConfig{Pages: 64, PageTokens: 16, Memory: src, TagKeys: testKeys, Horizon: horizon})
	maxRecords := 0
	if horizon == 0 {
		maxRecords = 1 << 30 // every record kept, as in the first version
	}
	r, _ := NewReceiver(ReceiverConfig{Pages: 64, PageTokens: 16, Memory: dst, TagKeys: testKeys, Horizon: horizon, MaxRecords: maxRecords,
		Region: func(p uint32) (uint64, uint32) { return uint64(p), 1 }})
	now := time.Now()
	var frame []byte
	var dec Decoder
	wire := func(m Message) Message { // every message crosses the wire format
		frame, _ = AppendMessage(frame[:0], m)
		decode := DecodeMessage
		if horizon > 0 {
			decode = dec.Decode
		}
		out, _, err := decode(frame)
		if err != nil {
			b.Fatal(err)
		}
		return out
	}
	b.ReportAllocs()
	for i := range b.N {
		if horizon > 0 && i%256 == 0 {
			now = now.Add(horizon)
			s.Tick(now)
			r.Tick(now)
		}
		id := RequestID(i + 1)
		if _, err := s.Submit(id, 1, pages*16); err != nil {
			b.Fatal(err)
		}
		s.Computed(id)
		for done := false; !done; {
			for _, op := range s.Effects().Ops {
				if w := op.Write; w != nil {
					copy(dst.tags[w.Remote.Page], w.Tag)
					s.Completed(w.ID, nil)
				} else if err := r.Step(1, wire(op.Msg), now); err != nil {
					b.Fatal(err)
				}
			}
			e := r.Effects()
			for _, snd := range e.Sends {
				s.Step(1, wire(snd.Msg))
			}
			for _, v := range e.Verified {
				if _, err := r.Acquire(v); err != nil {
					b.Fatal(err)
				}
				r.Finish(v)
				done = true
			}
		}
		r.Effects()
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "handoffs/s")
	if horizon > 0 && (s.Records() > 1024 || r.Records() > 1024) {
		b.Fatalf("records are not forgotten: %d on the sender, %d on the receiver", s.Records(), r.Records())
	}
}

// BenchmarkReadCheck is the read-time check of one page (rule 8, rule 23):
// private, Pool.Check(owner, ref) of a page the request owns; shared,
// Pool.CheckShared(scope, ref) of a pinned cached page, which compares the
// scope as well. Pages are spread over a pool of 4,096, as a decode node's.
func BenchmarkReadCheck(b *testing.B) {
	const pages = 4096
	chain := make([]ChainHash, pages)
	for i := range chain {
		chain[i][0], chain[i][1] = byte(i), byte(i>>8)
	}
	p := NewPool(pages)
	refs, _ := p.Allocate(1, pages)
	for i := range pages / 2 {
		p.Insert(1, refs[i], 7, chain[i])
	}
	shared := p.Pin(reader, 7, chain[:pages/2])
	private := refs[pages/2:]
	b.Run("private", func(b *testing.B) {
		for i := range b.N {
			if err := p.Check(1, private[i%len(private)]); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("shared", func(b *testing.B) {
		for i := range b.N {
			if err := p.CheckShared(7, shared[i%len(shared)]); err != nil {
				b.Fatal(err)
			}
		}
	})
}

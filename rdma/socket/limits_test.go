package socket

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/rdmatest"
	"github.com/kvhandoff/kvhandoff/rdma/throughput"
)

// flakyListener fails Accept with EMFILE, as a process out of file
// descriptors does, for the first failures calls.
type flakyListener struct {
	net.Listener
	failures atomic.Int32
}

func (l *flakyListener) Accept() (net.Conn, error) {
	if l.failures.Add(-1) >= 0 {
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: syscall.EMFILE}
	}
	return l.Listener.Accept()
}

// A device whose accept fails (EMFILE in a connection flood) goes on
// accepting once the error passes: queue pairs connect to it afterwards.
func TestAcceptGoesOnAfterEMFILE(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	flaky := &flakyListener{Listener: ln}
	flaky.failures.Store(5)
	cfg := nodeConfig(t, "b")
	b, err := Serve(flaky, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	a, _ := devices(t, "tcp")
	x := rdmatest.NewPair(t, a, b) // B's device takes A's connection after five failed accepts
	src, _ := x.PDA.Alloc(64, rdma.LocalWrite)
	dst, _ := x.PDB.Alloc(64, rdma.LocalWrite|rdma.RemoteWrite)
	copy(src.Bytes(), "after the flood")
	if err := x.A.PostSend(rdma.WorkRequest{ID: 1, Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: 64}, RemoteAddr: dst.Addr(), RKey: dst.RKey()}); err != nil {
		t.Fatal(err)
	}
	if c := x.ASend.Wait(1, 10*time.Second); len(c) != 1 || c[0].Status != rdma.Success || string(dst.Bytes()[:15]) != "after the flood" {
		t.Fatalf("WRITE after the accept errors: %+v", c)
	}
	if flaky.failures.Load() >= 0 {
		t.Fatal("the listener's failures were never hit")
	}
}

// Listen refuses to run without TLS unless plaintext is asked for.
func TestListenRefusesPlaintextUnlessAsked(t *testing.T) {
	if _, err := Listen("tcp", "127.0.0.1:0", Config{}); !errors.Is(err, ErrNoTLS) {
		t.Fatalf("Listen with no TLS: %v, want ErrNoTLS", err)
	}
	a, b := devices(t, "tcp")
	_, _, qa := newQP(t, a)
	info := b.qps[anyQPN(t, b)].Info()
	info.Node = ""
	if err := qa.Connect(info); !errors.Is(err, rdma.ErrBadRequest) {
		t.Fatalf("Connect with no identity to expect: %v, want ErrBadRequest", err)
	}
}

func newQP(t *testing.T, d *Device) (rdma.ProtectionDomain, rdma.CompletionQueue, rdma.QueuePair) {
	t.Helper()
	pd, _ := d.AllocPD()
	cq, _ := d.CreateCQ(16)
	qp, err := pd.CreateQP(cq, cq, 8)
	if err != nil {
		t.Fatal(err)
	}
	return pd, cq, qp
}

func anyQPN(t *testing.T, d *Device) uint32 {
	newQP(t, d)
	d.mu.Lock()
	defer d.mu.Unlock()
	for n := range d.qps {
		return n
	}
	return 0
}

// fuzzDevice is the responder device of FuzzFrames, plaintext: the fuzzer
// speaks after the handshake, straight into a queue pair's request stream.
var fuzzDevice *Device

// FuzzFrames feeds arbitrary bytes to a queue pair's responder as the
// peer's request stream: it never panics, lands bytes only inside the
// region the frames name, answers no more requests than were sent, and
// leaves the queue pair in the error state once the stream ends.
func FuzzFrames(f *testing.F) {
	w := wire{}
	f.Add(append(w.Header(rdma.OpWrite, 0, 0, 4), "abcd"...), uint16(0))
	f.Add(w.Header(rdma.OpWrite, 0, 0, 1<<30), uint16(0))
	f.Add(append(w.Header(rdma.OpSend, 0, 0, 8), "12345678"...), uint16(0))
	f.Add(append(w.Header(rdma.OpWriteImm, 0, 0, 2), "xy"...), uint16(4090))
	f.Add([]byte{1, 0, 0}, uint16(0))
	f.Fuzz(func(t *testing.T, stream []byte, offset uint16) {
		if fuzzDevice == nil {
			d, err := Listen("tcp", "127.0.0.1:0", Config{Insecure: true, FrameTimeout: 20 * time.Millisecond, Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			fuzzDevice = d
		}
		pd, cq, q := newQP(t, fuzzDevice)
		_, _, peer := newQP(t, fuzzDevice)
		dst, _ := pd.Alloc(4096, rdma.LocalWrite|rdma.RemoteWrite)
		canary, _ := pd.Alloc(4096, rdma.LocalWrite|rdma.RemoteWrite)
		inbox, _ := pd.Alloc(64, rdma.LocalWrite)
		q.PostRecv(rdma.WorkRequest{ID: 1, Op: rdma.OpRecv, Local: rdma.SGE{MR: inbox, Length: 64}})
		if err := q.Connect(peer.Info()); err != nil {
			t.Fatal(err)
		}
		defer peer.ToError()
		// Aim the fuzzer's frames at dst: a header's rkey and address
		// fields, where present, are rewritten to dst's, offset by offset.
		s := append([]byte(nil), stream...)
		if len(s) >= headerLen && s[0] != 0 && s[0]%2 == 1 {
			copy(s[4:], w.Header(0, dst.RKey(), dst.Addr()+uint64(offset), 0)[4:16])
		}
		mine, theirs := net.Pipe()
		done := make(chan struct{})
		go func() { q.(*QP).respond(theirs); close(done) }()
		answers := make(chan int)
		go func() { n, _ := io.Copy(io.Discard, mine); answers <- int(n) }()
		mine.Write(s)
		mine.Close()
		<-done
		if n := <-answers; n > len(s)/headerLen {
			t.Fatalf("%d answers to a stream of %d bytes", n, len(s))
		}
		for _, b := range canary.Bytes() {
			if b != 0 {
				t.Fatal("bytes landed in a region no frame named")
			}
		}
		deadline := time.Now().Add(5 * time.Second)
		for q.State() != rdma.StateError && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if st := q.State(); st != rdma.StateError {
			t.Fatalf("the stream ended and the queue pair is in state %d", st)
		}
		cq.Poll(64)
	})
}

// BenchmarkWrite moves WRITEs of 4 KiB and 256 KiB through one queue pair
// over TLS and in plaintext, in the same run: the cost of authentication and
// encryption as a ratio (go test -bench Write -run '^$' ./rdma/socket/).
func BenchmarkWrite(b *testing.B) {
	for _, page := range []int{4 << 10, 256 << 10} {
		for _, mode := range []string{"tls", "plaintext"} {
			b.Run(fmt.Sprintf("%dKiB/%s", page>>10, mode), func(b *testing.B) {
				open := func(name string) *Device {
					cfg := Config{Insecure: true, Logger: quiet}
					if mode == "tls" {
						cfg = nodeConfig(b, name)
					}
					d, err := Listen("tcp", "127.0.0.1:0", cfg)
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { d.Close() })
					return d
				}
				x, y := open("a"), open("b")
				b.SetBytes(int64(page))
				b.ResetTimer()
				bps, _, err := throughput.Write(x, y, page, max(b.N, throughput.Depth)*page, 1)
				if err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(bps*8/1e9, "Gbit/s")
			})
		}
	}
}

package inproc

import (
	"fmt"
	"time"

	"github.com/kvhandoff/kvhandoff/rdma"
)

// Throughput measures WRITEs of pageBytes each through one queue pair of a
// fresh fabric, moving about total bytes, and a plain copy of the same bytes
// between the same buffers in the same run: the baseline. Both are in bytes per
// second; each is the best of reps timed rounds, to dampen a noisy machine.
func Throughput(pageBytes, total, reps int) (provider, memcpy float64, err error) {
	f := NewFabric("bench")
	a, b := f.Device("a"), f.Device("b")
	pdA, _ := a.AllocPD()
	pdB, _ := b.AllocPD()
	cqA, _ := a.CreateCQ(1 << 16)
	cqB, _ := b.CreateCQ(1 << 16)
	qa, err := pdA.CreateQP(cqA, cqA, 1<<14)
	if err != nil {
		return 0, 0, err
	}
	qb, _ := pdB.CreateQP(cqB, cqB, 1<<14)
	if err := qa.Connect(qb.Info()); err != nil {
		return 0, 0, err
	}
	if err := qb.Connect(qa.Info()); err != nil {
		return 0, 0, err
	}
	defer qa.ToError()
	defer qb.ToError()
	pages := max(1, total/pageBytes)
	src, _ := pdA.Register(make([]byte, pageBytes), rdma.LocalWrite)
	dst, _ := pdB.Register(make([]byte, pages*pageBytes), rdma.LocalWrite|rdma.RemoteWrite)
	for i := range src.Bytes() {
		src.Bytes()[i] = byte(i)
	}
	bytes := float64(pages * pageBytes)
	for range reps {
		start := time.Now()
		for i := 0; i < pages; i++ {
			copy(dst.Bytes()[i*pageBytes:(i+1)*pageBytes], src.Bytes())
		}
		memcpy = max(memcpy, bytes/time.Since(start).Seconds())

		start = time.Now()
		for i := 0; i < pages; i++ {
			wr := rdma.WorkRequest{ID: uint64(i), Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: pageBytes},
				RemoteAddr: dst.Addr() + uint64(i*pageBytes), RKey: dst.RKey()}
			for {
				err := qa.PostSend(wr)
				if err == nil {
					break
				}
				if err != rdma.ErrQueueFull {
					return 0, 0, err
				}
				cqA.Wait(1, time.Second) // the send queue is full: let completions drain it
			}
		}
		for done := 0; done < pages; {
			cs := cqA.Wait(1<<12, 10*time.Second)
			if len(cs) == 0 {
				return 0, 0, fmt.Errorf("inproc: completions stopped after %d of %d WRITEs", done, pages)
			}
			for _, c := range cs {
				if c.Status != rdma.Success {
					return 0, 0, fmt.Errorf("inproc: WRITE completed with %v", c.Status)
				}
			}
			done += len(cs)
		}
		provider = max(provider, bytes/time.Since(start).Seconds())
	}
	return provider, memcpy, nil
}

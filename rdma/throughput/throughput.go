// Package throughput measures a provider's WRITE throughput between two of
// its devices, next to a plain memory copy of the same bytes in the same run:
// the numbers of `kvhandoff bench transfer`.
package throughput

import (
	"fmt"
	"time"

	"github.com/kvhandoff/kvhandoff/rdma"
)

// Depth is the send queue depth of the measured queue pair.
const Depth = 1024

// Write measures WRITEs of pageBytes each from device a to device b through
// one queue pair, moving about total bytes, and a plain copy of the same bytes
// between the same buffers in the same run: the baseline. Both are in bytes
// per second; each is the best of reps timed rounds, to dampen a noisy machine.
func Write(a, b rdma.Device, pageBytes, total, reps int) (provider, memcpy float64, err error) {
	pdA, err := a.AllocPD()
	if err != nil {
		return 0, 0, err
	}
	pdB, err := b.AllocPD()
	if err != nil {
		return 0, 0, err
	}
	cqA, err := a.CreateCQ(2 * Depth)
	if err != nil {
		return 0, 0, err
	}
	cqB, err := b.CreateCQ(2 * Depth)
	if err != nil {
		return 0, 0, err
	}
	qa, err := pdA.CreateQP(cqA, cqA, Depth)
	if err != nil {
		return 0, 0, err
	}
	qb, err := pdB.CreateQP(cqB, cqB, Depth)
	if err != nil {
		return 0, 0, err
	}
	if err := qa.Connect(qb.Info()); err != nil {
		return 0, 0, err
	}
	if err := qb.Connect(qa.Info()); err != nil {
		return 0, 0, err
	}
	defer qa.ToError()
	defer qb.ToError()
	pages := max(1, total/pageBytes)
	src, err := pdA.Alloc(pageBytes, rdma.LocalWrite)
	if err != nil {
		return 0, 0, err
	}
	dst, err := pdB.Alloc(pages*pageBytes, rdma.LocalWrite|rdma.RemoteWrite)
	if err != nil {
		return 0, 0, err
	}
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
		posted, done := 0, 0
		for done < pages {
			for posted < pages && posted-done < Depth {
				wr := rdma.WorkRequest{ID: uint64(posted), Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: pageBytes},
					RemoteAddr: dst.Addr() + uint64(posted*pageBytes), RKey: dst.RKey()}
				if err := qa.PostSend(wr); err != nil {
					return 0, 0, fmt.Errorf("throughput: post WRITE %d: %w", posted, err)
				}
				posted++
			}
			cs := cqA.Wait(Depth, 30*time.Second)
			if len(cs) == 0 {
				return 0, 0, fmt.Errorf("throughput: completions stopped after %d of %d WRITEs", done, pages)
			}
			for _, c := range cs {
				if c.Status != rdma.Success {
					return 0, 0, fmt.Errorf("throughput: WRITE completed with %v", c.Status)
				}
			}
			done += len(cs)
		}
		provider = max(provider, bytes/time.Since(start).Seconds())
	}
	// A measurement of WRITEs that moved nothing would be fast and wrong.
	for _, i := range []int{0, pages - 1} {
		if got := dst.Bytes()[i*pageBytes : (i+1)*pageBytes]; string(got) != string(src.Bytes()) {
			return 0, 0, fmt.Errorf("throughput: page %d did not arrive", i)
		}
	}
	return provider, memcpy, nil
}

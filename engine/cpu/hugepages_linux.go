//go:build linux

package cpu

import (
	"cmp"
	"runtime"
	"slices"
	"unsafe"

	"golang.org/x/sys/unix"
)

// hugePage is the size of an x86-64 or arm64 transparent huge page.
const hugePage = 2 << 20

// adviseHugePages asks Linux to back the arrays with transparent huge pages:
// MADV_HUGEPAGE on the hugePage-aligned part of each run of adjacent arrays
// (llama.Alloc puts a model's arrays in one run), then MADV_COLLAPSE, which
// moves the pages already there onto huge pages now rather than whenever
// khugepaged gets to them. It returns the bytes advised and the bytes
// collapsed.
//
// Why: a decode step streams every weight from memory once (stories15M's 61
// MB do not fit the L3 cache), and over 4 KiB pages that is a TLB miss every
// 4 KiB, a two-level page walk under a hypervisor. Both calls are hints:
// where transparent huge pages are off, the kernel predates MADV_COLLAPSE
// (6.1) or no huge page is free, the memory stays as it was and nothing else
// changes, so their errors are not the caller's concern. Only the arrays'
// own bytes are advised.
func adviseHugePages(arrays ...[]float32) (advised, collapsed int) {
	for _, r := range runs(arrays) {
		lo, hi := (r.lo+hugePage-1)&^(hugePage-1), r.hi&^(hugePage-1)
		if hi <= lo {
			continue
		}
		if madvise(lo, hi-lo, unix.MADV_HUGEPAGE) != nil {
			continue
		}
		advised += int(hi - lo)
		if madvise(lo, hi-lo, unix.MADV_COLLAPSE) == nil {
			collapsed += int(hi - lo)
		}
	}
	runtime.KeepAlive(arrays)
	return advised, collapsed
}

func madvise(addr, length uintptr, advice int) error {
	if _, _, errno := unix.Syscall(unix.SYS_MADVISE, addr, length, uintptr(advice)); errno != 0 {
		return errno
	}
	return nil
}

// span is the bytes [lo, hi) of the address space.
type span struct{ lo, hi uintptr }

// runs is the arrays' bytes as runs of adjacent (or overlapping: a shared
// classifier is the embedding) arrays, in address order.
func runs(arrays [][]float32) []span {
	var spans []span
	for _, a := range arrays {
		if len(a) > 0 {
			p := uintptr(unsafe.Pointer(unsafe.SliceData(a)))
			spans = append(spans, span{p, p + uintptr(len(a))*4})
		}
	}
	slices.SortFunc(spans, func(a, b span) int { return cmp.Compare(a.lo, b.lo) })
	var out []span
	for _, s := range spans {
		if n := len(out); n > 0 && s.lo <= out[n-1].hi {
			out[n-1].hi = max(out[n-1].hi, s.hi)
			continue
		}
		out = append(out, s)
	}
	return out
}

package cpu

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// Load asks Linux to back a model's weights with huge pages: the aligned
// part of the model's one allocation is advised (the mapping carries the
// hg flag) and, where MADV_COLLAPSE succeeded, the kernel reports that much
// of it on huge pages.
func TestLoadBacksTheWeightsWithHugePages(t *testing.T) {
	mode, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	if err != nil || strings.Contains(string(mode), "[never]") {
		t.Skipf("transparent huge pages are off here (%q, %v): the advice changes nothing", mode, err)
	}
	m, err := llama.Alloc(llama.Config{Dim: 288, HiddenDim: 768, Layers: 2, Heads: 6, KVHeads: 6, Vocab: 8192, SeqLen: 64})
	if err != nil {
		t.Fatal(err)
	}
	llama.Randomize(m, 1) // the pages exist before the advice: collapse must move them
	b := New()
	if err := b.Load(m); err != nil {
		t.Fatal(err)
	}
	lo := uintptr(unsafe.Pointer(&m.TokenEmbedding[0]))
	hi := uintptr(unsafe.Pointer(&m.Classifier[len(m.Classifier)-1])) + 4
	lo, hi = (lo+hugePage-1)&^(hugePage-1), hi&^(hugePage-1)
	if b.hugeAdvised != int(hi-lo) {
		t.Fatalf("advised %d bytes, want the model's aligned %d", b.hugeAdvised, hi-lo)
	}
	flags, huge := mapping(t, lo, hi)
	if !strings.Contains(" "+flags+" ", " hg ") {
		t.Fatalf("the weights' mapping has flags %q, without hg (MADV_HUGEPAGE)", flags)
	}
	t.Logf("%d bytes advised, %d collapsed, %d on huge pages", b.hugeAdvised, b.hugeCollapsed, huge)
	if huge < b.hugeCollapsed {
		t.Fatalf("collapse succeeded on %d bytes but %d are on huge pages", b.hugeCollapsed, huge)
	}
}

// mapping reads /proc/self/smaps for the mappings inside [lo, hi): the
// VmFlags of the first and the sum of their AnonHugePages.
func mapping(t *testing.T, lo, hi uintptr) (flags string, huge int) {
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	in, found := false, false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		if r := strings.Split(fields[0], "-"); len(r) == 2 && !strings.HasSuffix(fields[0], ":") {
			a, err1 := strconv.ParseUint(r[0], 16, 64)
			z, err2 := strconv.ParseUint(r[1], 16, 64)
			if err1 == nil && err2 == nil {
				in = uintptr(a) < hi && uintptr(z) > lo
				found = found || in
				continue
			}
		}
		switch {
		case in && fields[0] == "AnonHugePages:" && len(fields) > 1:
			kb, _ := strconv.Atoi(fields[1])
			huge += kb << 10
		case in && fields[0] == "VmFlags:" && flags == "":
			flags = strings.Join(fields[1:], " ")
		}
	}
	if err := sc.Err(); err != nil || !found {
		t.Fatalf("no mapping of [%#x, %#x) in /proc/self/smaps (%v)", lo, hi, err)
	}
	return flags, huge
}

// The huge-page advice covers the arrays' own bytes: adjacent arrays (a
// model's, laid out by llama.Alloc) as one run, an array listed twice (a
// shared classifier) once, and never the gap between two arrays. (Weights
// live on the heap, where nothing moves; runs reads addresses as integers.)
func TestHugePageRunsCoverTheArraysAndNothingBetween(t *testing.T) {
	all := make([]float32, 100<<10) // on the heap (too big for a stack, which moves)
	base := uintptr(unsafe.Pointer(&all[0]))
	got := runs([][]float32{all[40:60], all[0:10], all[10:25], all[0:10], all[60:60], all[55:70]})
	want := []span{{base, base + 25*4}, {base + 40*4, base + 70*4}}
	if len(got) != len(want) {
		t.Fatalf("runs %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("run %d is [%#x, %#x), want [%#x, %#x)", i, got[i].lo, got[i].hi, want[i].lo, want[i].hi)
		}
	}
}

package node

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// deviceLike is the CPU backend with a device backend's contract checked: a
// page the transport wrote into host memory must be uploaded (UploadPages)
// before a step reads it, since a device reads its own copy. Pages past the
// transport's (the decode node's own, for generated tokens) are the
// device's from the start.
type deviceLike struct {
	backend.Backend
	transportPages uint32
	mu             sync.Mutex
	uploads        map[uint32]int    // UploadPages calls naming the page
	seen           map[uint32]uint64 // the epoch a step last read the page at
	seenUploads    map[uint32]int    // uploads when that epoch was first read
	missed         []string
}

func newDeviceLike(transportPages uint32) *deviceLike {
	return &deviceLike{Backend: cpu.New(), transportPages: transportPages,
		uploads: map[uint32]int{}, seen: map[uint32]uint64{}, seenUploads: map[uint32]int{}}
}

func (d *deviceLike) UploadPages(pages []uint32) error {
	d.mu.Lock()
	for _, p := range pages {
		d.uploads[p]++
	}
	d.mu.Unlock()
	return d.Backend.UploadPages(pages)
}

// Forward checks, for each transport page a step reads (one holding
// positions before Pos), that it was uploaded since it came to the request
// at its current epoch: a page reused by a later request needs a new upload.
func (d *deviceLike) Forward(s *backend.Step) error {
	d.mu.Lock()
	for i, ref := range s.Table {
		if ref.Page >= d.transportPages || i*pageTokensArrived >= s.Pos {
			continue
		}
		if e, ok := d.seen[ref.Page]; !ok || e != ref.Epoch {
			if d.uploads[ref.Page] == d.seenUploads[ref.Page] {
				d.missed = append(d.missed, fmt.Sprintf("page %d at epoch %d (index %d) read at position %d, not uploaded since it arrived", ref.Page, ref.Epoch, i, s.Pos))
			}
			d.seen[ref.Page], d.seenUploads[ref.Page] = ref.Epoch, d.uploads[ref.Page]
		}
	}
	d.mu.Unlock()
	return d.Backend.Forward(s)
}

const pageTokensArrived = 16

// A decode node hands every page that arrived over the transport to its
// backend (engine.Arrived: UploadPages) before the first step reads it, so a
// device backend never decodes from pages it does not hold. Removing the
// node's Arrived call fails this test.
func TestDecodeNodeUploadsEveryArrivedPageBeforeReadingIt(t *testing.T) {
	m := llama.Builtin(5)
	const pages = 64
	dev := newDeviceLike(pages)
	l, err := StartLocal(LocalConfig{PrefillPages: pages, DecodePages: pages, PageTokens: pageTokensArrived, Model: m, Timeout: time.Minute, Log: quietLog(),
		decodeBackend: func(int) backend.Backend { return dev }})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	for i, p := range prompts(24, 3) { // enough to reuse pages (64) at new epochs
		a, err := complete(context.Background(), l.API, "tenant-0", p, 8)
		if err != nil || a.code != http.StatusOK {
			t.Fatalf("request %d: %v %d %s", i, err, a.code, a.err)
		}
	}
	dev.mu.Lock()
	defer dev.mu.Unlock()
	for _, m := range dev.missed {
		t.Error(m)
	}
	reused := 0
	for p := range dev.seen {
		if dev.uploads[p] > 1 {
			reused++
		}
	}
	if reused == 0 {
		t.Error("no page was uploaded twice: the run never reused a page, so a stale upload would go unseen")
	}
}

package kv

import (
	"errors"
	"testing"
	"unsafe"

	"github.com/kvhandoff/kvhandoff/protocol"
)

var geom = Geometry{Layers: 2, KVHeads: 3, HeadDim: 4, PageTokens: 5}

// The region has transfer's layout: page p's payload at p*(PageBytes+TagSize),
// its tag record right after, and the float32 view aliases the payload.
func TestPagesSitAtTransfersStrideWithTheirTagRecordAfter(t *testing.T) {
	c, err := New(geom, 4)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := geom.PageBytes(), 2*2*5*12*4; got != want {
		t.Fatalf("PageBytes = %d, want %d", got, want)
	}
	base := &c.Region()[0]
	for p := uint32(0); p < 4; p++ {
		pay, tag := c.Payload(p), c.TagRecord(p)
		if off := offset(base, &pay[0]); off != int(p)*geom.Stride() {
			t.Fatalf("page %d payload at %d", p, off)
		}
		if off := offset(base, &tag[0]); off != int(p)*geom.Stride()+geom.PageBytes() || len(tag) != protocol.TagSize {
			t.Fatalf("page %d tag at %d (len %d)", p, off, len(tag))
		}
		f := c.Floats(p)
		f[geom.ValueOffset(1, 4)+11] = 1 // the last float of the page
		if pay[len(pay)-1] == 0 && pay[len(pay)-2] == 0 && pay[len(pay)-3] == 0 && pay[len(pay)-4] == 0 {
			t.Fatalf("page %d: the float view does not alias the payload's end", p)
		}
		if tag[0] != 0 {
			t.Fatalf("page %d: writing the payload's last float touched its tag record", p)
		}
	}
}

func offset(base, p *byte) int {
	return int(uintptr(unsafe.Pointer(p)) - uintptr(unsafe.Pointer(base)))
}

// A page freed and allocated again is at a new epoch: the old tag fails the
// read-time check with an error naming the page, matching ErrTagMismatch.
func TestReadOfAReallocatedPageFailsNamingThePage(t *testing.T) {
	c, err := New(geom, 2)
	if err != nil {
		t.Fatal(err)
	}
	refs, err := c.Pool().Allocate(1, 2)
	if err != nil {
		t.Fatal(err)
	}
	table := Table(refs)
	for i := range table {
		if err := c.Check(table, i); err != nil {
			t.Fatalf("own page %d: %v", i, err)
		}
	}
	c.Pool().Release(1, refs[1:])
	if _, err := c.Pool().Allocate(2, 1); err != nil {
		t.Fatal(err)
	}
	err = c.Check(table, 1)
	var te *TagError
	if !errors.As(err, &te) || !errors.Is(err, protocol.ErrTagMismatch) {
		t.Fatalf("stale read: %v", err)
	}
	if te.Index != 1 || te.Page != refs[1].Page || te.Held != refs[1].Epoch || te.Current != refs[1].Epoch+1 {
		t.Fatalf("error names %+v, want page %d index 1", te, refs[1].Page)
	}
	if got := c.Epochs(nil, table); got[0] != refs[0].Epoch || got[1] != refs[1].Epoch+1 {
		t.Fatalf("Epochs = %v", got)
	}
}

func TestOverRefusesARegionTooSmallOrAPageTableOutsideThePool(t *testing.T) {
	if _, err := Over(geom, make([]byte, 3*geom.Stride()-1), protocol.NewPool(3)); !errors.Is(err, ErrGeometry) {
		t.Fatalf("short region: %v", err)
	}
	if _, err := New(Geometry{Layers: 1, KVHeads: 1, HeadDim: 0, PageTokens: 1}, 1); !errors.Is(err, ErrGeometry) {
		t.Fatalf("zero head size: %v", err)
	}
	c, _ := New(geom, 2)
	if err := c.ValidTable(Table{{Page: 2}}); !errors.Is(err, ErrGeometry) {
		t.Fatalf("page 2 of 2: %v", err)
	}
}

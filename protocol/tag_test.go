package protocol

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"github.com/kvhandoff/kvhandoff/protocol/checksum"
)

func pageWithTag(size int, t Tag) (payload, record []byte) {
	payload = make([]byte, size)
	for i := range payload {
		payload[i] = byte(i*31 + int(t.Index))
	}
	t.Sum = checksum.Sum(payload)
	return payload, t.Append(nil)
}

var want = Expect{Request: 42, Index: 3, Epoch: 9, Tokens: 16}

func TestTagRoundTrips(t *testing.T) {
	in := Tag{Request: 42, Epoch: 9, Index: 3, Tokens: 16, Sum: 0xfeed}
	rec := in.Append(nil)
	if len(rec) != TagSize {
		t.Fatalf("%d bytes", len(rec))
	}
	out, err := ParseTag(rec)
	if err != nil || out != in {
		t.Fatalf("%+v %v", out, err)
	}
}

func TestVerifyPageAcceptsTheGrantedPage(t *testing.T) {
	payload, rec := pageWithTag(4096, Tag{Request: 42, Epoch: 9, Index: 3, Tokens: 16})
	if err := VerifyPage(rec, payload, want); err != nil {
		t.Fatal(err)
	}
}

// A page whose record was written for anything else is another request's page.
func TestVerifyPageRejectsForeignStaleOrMisplacedRecords(t *testing.T) {
	for name, tag := range map[string]Tag{
		"another request":   {Request: 41, Epoch: 9, Index: 3, Tokens: 16},
		"an older epoch":    {Request: 42, Epoch: 8, Index: 3, Tokens: 16},
		"another index":     {Request: 42, Epoch: 9, Index: 2, Tokens: 16},
		"other token count": {Request: 42, Epoch: 9, Index: 3, Tokens: 1},
	} {
		payload, rec := pageWithTag(4096, tag)
		err := VerifyPage(rec, payload, want)
		wantErr := ErrTagMismatch
		if name == "other token count" {
			wantErr = ErrTokenMismatch
		}
		if !errors.Is(err, wantErr) {
			t.Errorf("%s: got %v, want %v", name, err, wantErr)
		}
	}
}

func TestVerifyPageRejectsCorruptPayloadAndGarbageRecords(t *testing.T) {
	payload, rec := pageWithTag(4096, Tag{Request: 42, Epoch: 9, Index: 3, Tokens: 16})
	payload[1000] ^= 0x10
	if err := VerifyPage(rec, payload, want); !errors.Is(err, ErrChecksumMismatch) {
		t.Fatalf("corrupted payload: %v", err)
	}
	payload[1000] ^= 0x10
	for i := 0; i < TagSize; i++ { // any damaged byte of the record
		bad := bytes.Clone(rec)
		bad[i] ^= 0x01
		if err := VerifyPage(bad, payload, want); !errors.Is(err, ErrTagMalformed) {
			t.Fatalf("record byte %d damaged: %v", i, err)
		}
	}
	if err := VerifyPage(make([]byte, TagSize), payload, want); !errors.Is(err, ErrTagMalformed) {
		t.Fatalf("a zeroed record: %v", err)
	}
	if err := VerifyPage(rec[:TagSize-1], payload, want); !errors.Is(err, ErrTagMalformed) {
		t.Fatalf("a short record: %v", err)
	}
}

// FuzzParseTag: any input yields a record or ErrTagMalformed, never a panic, and
// a record that parses re-encodes to the same bytes.
func FuzzParseTag(f *testing.F) {
	_, rec := pageWithTag(64, Tag{Request: 1, Epoch: 2, Index: 3, Tokens: 4})
	f.Add(rec)
	f.Add(make([]byte, TagSize))
	f.Add(rec[:10])
	f.Fuzz(func(t *testing.T, b []byte) {
		tag, err := ParseTag(b)
		if err != nil {
			if !errors.Is(err, ErrTagMalformed) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		if !bytes.Equal(tag.Append(nil), b[:TagSize]) {
			t.Fatal("re-encoding differs")
		}
	})
}

var sinkErr error

// BenchmarkVerify measures, per page size and in the same run: a plain copy of
// the page (the baseline), the tag check alone (parse and compare the record),
// and full verification (tag check plus payload checksum). Compare MB/s.
func BenchmarkVerify(b *testing.B) {
	for _, size := range []int{4 << 10, 256 << 10, 4 << 20} {
		payload, rec := pageWithTag(size, Tag{Request: 42, Epoch: 9, Index: 3, Tokens: 16})
		dst := make([]byte, size)
		name := fmt.Sprintf("%dKiB", size>>10)
		b.Run("copy/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			for range b.N {
				copy(dst, payload)
			}
		})
		b.Run("tag/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			for range b.N {
				tag, err := ParseTag(rec)
				if err == nil {
					err = CheckTag(tag, want)
				}
				sinkErr = err
			}
		})
		b.Run("full/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			for range b.N {
				sinkErr = VerifyPage(rec, payload, want)
			}
		})
	}
}

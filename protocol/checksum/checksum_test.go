package checksum

import (
	"fmt"
	"hash/crc32"
	"testing"
)

func TestSumDetectsEverySingleBitFlip(t *testing.T) {
	page := make([]byte, 4096)
	for i := range page {
		page[i] = byte(i*131 + 7)
	}
	want := Sum(page)
	for bit := 0; bit < len(page)*8; bit++ {
		page[bit/8] ^= 1 << (bit % 8)
		if Sum(page) == want {
			t.Fatalf("flipping bit %d went unnoticed", bit)
		}
		page[bit/8] ^= 1 << (bit % 8)
	}
	if Sum(page) != want {
		t.Fatal("Sum is not a function of the bytes")
	}
}

func TestSumIsStableAcrossReleases(t *testing.T) {
	// Tag records written by one build are verified by another: the function
	// must never change. XXH3-64 of "kvhandoff", seed 0.
	if got := Sum([]byte("kvhandoff")); got != pinned {
		t.Fatalf("Sum changed: %#x, pinned %#x", got, pinned)
	}
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

var sink uint64

// BenchmarkPage measures the checksum next to a plain copy of the same bytes
// and CRC-32C, the alternative, in the same run: compare MB/s.
func BenchmarkPage(b *testing.B) {
	for _, size := range []int{4 << 10, 256 << 10, 4 << 20} {
		src := make([]byte, size)
		dst := make([]byte, size)
		for i := range src {
			src[i] = byte(i * 7)
		}
		name := fmt.Sprintf("%dKiB", size>>10)
		b.Run("copy/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			for range b.N {
				copy(dst, src)
			}
		})
		b.Run("xxh3/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			for range b.N {
				sink = Sum(src)
			}
		})
		b.Run("crc32c/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			for range b.N {
				sink = uint64(crc32.Checksum(src, castagnoli))
			}
		})
	}
}

const pinned = 0x3665aac8c4cb2050

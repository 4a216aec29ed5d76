package transfer

import (
	"encoding/binary"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// GenerateKV fills page with the KV of request id's page index: bytes derived
// from the request, the page and each token in it (pageTokens tokens share the
// page equally, the last one taking the remainder). It stands in for an
// engine's KV until one is linked, and stays as the benchmarks' source: every
// page of every request differs, so a page that landed in the wrong place, or
// a stale one, never compares equal.
func GenerateKV(id protocol.RequestID, index, pageTokens int, page []byte) {
	per := max(1, len(page)/max(1, pageTokens))
	var word [8]byte
	for off := 0; off < len(page); off += 8 {
		token := min(off/per, pageTokens-1)
		binary.LittleEndian.PutUint64(word[:], mix(uint64(id), uint64(index), uint64(token), uint64(off)))
		copy(page[off:], word[:])
	}
}

// mix is splitmix64's finalizer over the four coordinates of a word.
func mix(a, b, c, d uint64) uint64 {
	x := a*0x9E3779B97F4A7C15 ^ b*0xBF58476D1CE4E5B9 ^ c*0x94D049BB133111EB ^ d*0xD6E8FEB86659FD93
	x ^= x >> 30
	x *= 0xBF58476D1CE4E5B9
	x ^= x >> 27
	x *= 0x94D049BB133111EB
	return x ^ x>>31
}

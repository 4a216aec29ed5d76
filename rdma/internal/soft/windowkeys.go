package soft

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/binary"
)

// windowKeys draws window keys that are unguessable and never repeat within
// 2^32 binds, without remembering the keys issued (a set of every key ever
// issued grew by one entry a bind: 19 MB after a million): the key of the
// n-th bind is a secret-keyed permutation of n, a four-round Feistel network
// over the two 16-bit halves whose round function is AES under a key from
// crypto/rand. A peer that saw its own windows' keys learns nothing it can
// use of another's, and a window only takes WRITEs from the queue pair it is
// bound on anyway.
type windowKeys struct {
	round cipher.Block
	n     uint32
}

func newWindowKeys() *windowKeys {
	var k [16]byte
	rand.Read(k[:]) // never fails (crypto/rand's contract since Go 1.24)
	b, err := aes.NewCipher(k[:])
	if err != nil {
		panic(err) // a 16-byte key is always valid
	}
	return &windowKeys{round: b}
}

// next is the key of the next bind. The caller skips 0 and keys in use.
func (k *windowKeys) next() uint32 {
	k.n++
	return k.permute(k.n)
}

// permute is the Feistel network: a bijection of uint32.
func (k *windowKeys) permute(x uint32) uint32 {
	l, r := uint16(x>>16), uint16(x)
	var in, out [16]byte
	for i := range 4 {
		in[0] = byte(i)
		binary.BigEndian.PutUint16(in[1:], r)
		k.round.Encrypt(out[:], in[:])
		l, r = r, l^binary.BigEndian.Uint16(out[:])
	}
	return uint32(l)<<16 | uint32(r)
}

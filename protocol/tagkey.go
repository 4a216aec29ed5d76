package protocol

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvhandoff/kvhandoff/protocol/checksum"
)

// ErrNoPeerKey: there is no tag key for the peer (its queue pair has not been
// set up, or the engine never handed the key over). Nothing is written to or
// accepted from a peer without one.
var ErrNoPeerKey = errors.New("protocol: no tag key for the peer")

// TagKeySecretSize is the length of the secret a TagKey is made from.
const TagKeySecretSize = 32

// PayloadSum says what the payload sum of a tag record is.
type PayloadSum uint8

const (
	// SumXXH3 is checksum.Sum, XXH3-64: fast, and catches accidents (torn,
	// stale or misplaced payloads), but not a stranger who can WRITE to the
	// page: anyone can compute it, and so write a payload that matches.
	SumXXH3 PayloadSum = iota
	// SumKeyed is a keyed digest of the payload, HMAC-SHA256 under a key
	// derived from the queue pair's secret, truncated to 64 bits: for
	// fabrics a stranger can WRITE to. It costs far more than SumXXH3
	// (docs/protocol.md, "Tag records").
	SumKeyed
)

func (s PayloadSum) String() string {
	switch s {
	case SumXXH3:
		return "xxh3"
	case SumKeyed:
		return "keyed"
	}
	return fmt.Sprintf("PayloadSum(%d)", uint8(s))
}

// TagKey is the key one queue pair's two ends share for their tag records:
// the sender MACs each record with it, and the receiver accepts only records
// whose MAC verifies, so a WRITE from anyone without the key (another peer,
// a stranger on the fabric) fails verification with ErrTagMismatch however
// well-formed the record it writes. Make it from a secret the two nodes agree
// on over their authenticated connection setup (for TLS 1.3, 32 bytes of
// ExportKeyingMaterial), one per queue pair: a new queue pair, a new secret.
//
// The record's MAC is AES-128-CMAC (RFC 4493), truncated to 64 bits, chosen
// by measurement over HMAC-SHA256 (BenchmarkVerify). A TagKey is immutable
// and safe for concurrent use.
type TagKey struct {
	block  cipher.Block // AES-128 under the record key
	k1, k2 [16]byte     // CMAC's subkeys
	sum    PayloadSum
	digest []byte // HMAC key of the keyed payload digest
}

// NewTagKey makes a queue pair's tag key from the secret its two ends agreed
// on (TagKeySecretSize bytes, uniformly random) and the payload sum both ends
// use. Two independent keys are derived from the secret with HKDF-SHA256: one
// for the records' MAC and one for the payload digest.
func NewTagKey(secret []byte, sum PayloadSum) (*TagKey, error) {
	if len(secret) != TagKeySecretSize {
		return nil, fmt.Errorf("protocol: a tag key secret is %d bytes, not %d", TagKeySecretSize, len(secret))
	}
	if sum != SumXXH3 && sum != SumKeyed {
		return nil, fmt.Errorf("protocol: unknown payload sum %v", sum)
	}
	// The record key is bound to the payload sum kind: a record written for
	// another kind fails the MAC.
	recordKey, err := hkdf.Key(sha256.New, secret, nil, "kvhandoff tag record MAC v2 "+sum.String(), 16)
	if err != nil {
		return nil, err
	}
	digestKey, err := hkdf.Key(sha256.New, secret, nil, "kvhandoff payload digest v2", 32)
	if err != nil {
		return nil, err
	}
	k, err := newCMAC(recordKey)
	if err != nil {
		return nil, err
	}
	k.sum, k.digest = sum, digestKey
	return k, nil
}

// newCMAC returns a key whose record MAC is AES-CMAC under key (16 bytes).
func newCMAC(key []byte) (*TagKey, error) {
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	k := &TagKey{block: block}
	var l [16]byte
	block.Encrypt(l[:], l[:])
	k.k1 = cmacDouble(l)
	k.k2 = cmacDouble(k.k1)
	return k, nil
}

// cmacDouble is multiplication by x in GF(2^128), RFC 4493's subkey step.
func cmacDouble(in [16]byte) [16]byte {
	hi, lo := binary.BigEndian.Uint64(in[:8]), binary.BigEndian.Uint64(in[8:])
	carry := hi >> 63
	hi, lo = hi<<1|lo>>63, lo<<1^0x87*carry
	var out [16]byte
	binary.BigEndian.PutUint64(out[:8], hi)
	binary.BigEndian.PutUint64(out[8:], lo)
	return out
}

// cmac computes AES-CMAC of msg into out, using x as scratch (callers on the
// hot path pass their own, so nothing escapes to the heap per record).
func (k *TagKey) cmac(msg []byte, x *[16]byte) {
	*x = [16]byte{}
	for len(msg) > 16 {
		xor16(x, msg)
		k.block.Encrypt(x[:], x[:])
		msg = msg[16:]
	}
	var last [16]byte
	if len(msg) == 16 {
		copy(last[:], msg)
		xor16(&last, k.k1[:])
	} else {
		copy(last[:], msg)
		last[len(msg)] = 0x80
		xor16(&last, k.k2[:])
	}
	xor16(x, last[:])
	k.block.Encrypt(x[:], x[:])
}

func xor16(x *[16]byte, b []byte) {
	binary.NativeEndian.PutUint64(x[:8], binary.NativeEndian.Uint64(x[:8])^binary.NativeEndian.Uint64(b[:8]))
	binary.NativeEndian.PutUint64(x[8:], binary.NativeEndian.Uint64(x[8:])^binary.NativeEndian.Uint64(b[8:16]))
}

// PayloadSum is the payload sum this key's records carry.
func (k *TagKey) PayloadSum() PayloadSum { return k.sum }

// Sum is the payload sum of p under this key: checksum.Sum for SumXXH3, the
// keyed digest for SumKeyed.
func (k *TagKey) Sum(p []byte) uint64 {
	if k.sum == SumXXH3 {
		return checksum.Sum(p)
	}
	h := hmac.New(sha256.New, k.digest)
	h.Write(p)
	var out [sha256.Size]byte
	return binary.BigEndian.Uint64(h.Sum(out[:0]))
}

package protocol

import (
	"crypto/subtle"
	"encoding/binary"
	"fmt"
)

// TagSize is the size of an encoded tag record.
const TagSize = 48

// Tag is the record the sender writes after each page's payload, on the same
// queue pair (docs/protocol.md rule 5). Reliable-connected queue pairs place writes
// in order, so an intact tag record for the expected (request, index, epoch)
// means its payload has landed.
type Tag struct {
	Request RequestID
	Epoch   uint64 // the epoch the page was granted at
	Index   uint32 // the page's index within the request
	Tokens  uint32 // tokens of KV in this page
	Sum     uint64 // the payload's sum under the queue pair's key (TagKey.Sum)
}

// The layout (48 bytes, big-endian): magic "KVTG", version, the payload sum's
// kind (PayloadSum), 2 reserved zero bytes, then the 32 bytes the MAC covers
// (request, epoch, index, tokens, payload sum), then the first 8 bytes of
// their AES-CMAC under the queue pair's TagKey. The MAC tells a record this
// queue pair's sender wrote for this page from anything else: garbage an
// earlier tenant left, a torn record, another peer's record, or a stranger's
// forgery. The header is outside it, because the MAC key is derived for one
// version and one payload sum kind: a record of another is refused either
// way. Two AES blocks a record, not three (BenchmarkVerify).
const tagVersion = 2

const (
	tagFieldsOffset = 8  // where the MACed fields start
	tagMACOffset    = 40 // where the MAC starts
)

var tagMagic = [4]byte{'K', 'V', 'T', 'G'}

// Append appends the record, MACed under key, to dst. Sum must be key.Sum of
// the payload.
func (t Tag) Append(dst []byte, key *TagKey) []byte {
	var x [16]byte
	return t.appendMAC(dst, key, &x)
}

// appendMAC is Append with the caller's scratch block, so a state machine
// that keeps one allocates nothing but the record.
func (t Tag) appendMAC(dst []byte, key *TagKey, x *[16]byte) []byte {
	start := len(dst)
	dst = append(dst, tagMagic[:]...)
	dst = append(dst, tagVersion, byte(key.sum), 0, 0)
	dst = binary.BigEndian.AppendUint64(dst, uint64(t.Request))
	dst = binary.BigEndian.AppendUint64(dst, t.Epoch)
	dst = binary.BigEndian.AppendUint32(dst, t.Index)
	dst = binary.BigEndian.AppendUint32(dst, t.Tokens)
	dst = binary.BigEndian.AppendUint64(dst, t.Sum)
	key.cmac(dst[start+tagFieldsOffset:], x)
	return append(dst, x[:8]...)
}

// ParseTag decodes the tag record in the first TagSize bytes of b and checks
// its MAC under key. A record that is not one (too short, no magic, another
// version) is ErrTagMalformed; one whose MAC fails under key, or of another
// payload sum kind than key's, was not written by this queue pair's sender
// and is ErrTagMismatch. It never panics and does not allocate past its
// scratch block.
func ParseTag(b []byte, key *TagKey) (Tag, error) {
	var x [16]byte
	return parseTag(b, key, &x)
}

func parseTag(b []byte, key *TagKey, x *[16]byte) (Tag, error) {
	if len(b) < TagSize {
		return Tag{}, fmt.Errorf("%w: %d bytes, need %d", ErrTagMalformed, len(b), TagSize)
	}
	b = b[:TagSize]
	switch {
	case [4]byte(b[0:4]) != tagMagic:
		return Tag{}, fmt.Errorf("%w: no magic", ErrTagMalformed)
	case b[4] != tagVersion || b[6]|b[7] != 0 || PayloadSum(b[5]) > SumKeyed:
		return Tag{}, fmt.Errorf("%w: version %d, payload sum %d", ErrTagMalformed, b[4], b[5])
	case key == nil:
		return Tag{}, fmt.Errorf("%w: cannot check the record's MAC", ErrNoPeerKey)
	case PayloadSum(b[5]) != key.sum:
		return Tag{}, fmt.Errorf("%w: the record's payload sum is %v, this queue pair's is %v", ErrTagMismatch, PayloadSum(b[5]), key.sum)
	}
	key.cmac(b[tagFieldsOffset:tagMACOffset], x)
	if subtle.ConstantTimeCompare(x[:8], b[tagMACOffset:TagSize]) != 1 {
		return Tag{}, fmt.Errorf("%w: the record's MAC fails: not written by this queue pair's sender", ErrTagMismatch)
	}
	return Tag{
		Request: RequestID(binary.BigEndian.Uint64(b[8:])),
		Epoch:   binary.BigEndian.Uint64(b[16:]),
		Index:   binary.BigEndian.Uint32(b[24:]),
		Tokens:  binary.BigEndian.Uint32(b[28:]),
		Sum:     binary.BigEndian.Uint64(b[32:]),
	}, nil
}

// Expect is what the receiver knows a page must be: the ownership tag it granted
// and the tokens the page holds.
type Expect struct {
	Request RequestID
	Index   uint32
	Epoch   uint64
	Tokens  uint32
}

// VerifyPage checks one page the way the receiver must before anything reads
// it: its tag record is intact, MACed under the queue pair's key, names the
// expected request, page index, epoch and token count, and the payload matches
// the record's payload sum. The error wraps ErrTagMalformed, ErrTagMismatch,
// ErrTokenMismatch, ErrChecksumMismatch or (with a nil key) ErrNoPeerKey.
func VerifyPage(record, payload []byte, want Expect, key *TagKey) error {
	var x [16]byte
	return verifyPage(record, payload, want, key, &x)
}

func verifyPage(record, payload []byte, want Expect, key *TagKey, x *[16]byte) error {
	t, err := parseTag(record, key, x)
	if err != nil {
		return err
	}
	if err := CheckTag(t, want); err != nil {
		return err
	}
	if got := key.Sum(payload); got != t.Sum {
		return fmt.Errorf("%w: page %d of request %d: payload sums to %#x, tag record says %#x",
			ErrChecksumMismatch, want.Index, want.Request, got, t.Sum)
	}
	return nil
}

// CheckTag compares a parsed tag record with what the receiver expects.
func CheckTag(t Tag, want Expect) error {
	if t.Request != want.Request || t.Index != want.Index || t.Epoch != want.Epoch {
		return fmt.Errorf("%w: page %d of request %d at epoch %d holds a record for page %d of request %d at epoch %d",
			ErrTagMismatch, want.Index, want.Request, want.Epoch, t.Index, t.Request, t.Epoch)
	}
	if t.Tokens != want.Tokens {
		return fmt.Errorf("%w: page %d of request %d holds %d tokens, expected %d",
			ErrTokenMismatch, want.Index, want.Request, t.Tokens, want.Tokens)
	}
	return nil
}

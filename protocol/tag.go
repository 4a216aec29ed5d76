package protocol

import (
	"encoding/binary"
	"fmt"

	"github.com/kvhandoff/kvhandoff/protocol/checksum"
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
	Sum     uint64 // checksum.Sum of the payload
}

// The layout: magic "KVTG", version, 3 reserved zero bytes, request, epoch, index,
// tokens, payload checksum, and a checksum of the 40 bytes before it. The self
// check tells a torn or never-written record (garbage an earlier tenant left)
// from one written for another request.
const tagVersion = 1

var tagMagic = [4]byte{'K', 'V', 'T', 'G'}

// Append appends the encoded record to dst.
func (t Tag) Append(dst []byte) []byte {
	start := len(dst)
	dst = append(dst, tagMagic[:]...)
	dst = append(dst, tagVersion, 0, 0, 0)
	dst = binary.BigEndian.AppendUint64(dst, uint64(t.Request))
	dst = binary.BigEndian.AppendUint64(dst, t.Epoch)
	dst = binary.BigEndian.AppendUint32(dst, t.Index)
	dst = binary.BigEndian.AppendUint32(dst, t.Tokens)
	dst = binary.BigEndian.AppendUint64(dst, t.Sum)
	return binary.BigEndian.AppendUint64(dst, checksum.Sum(dst[start:]))
}

// ParseTag decodes a tag record from the first TagSize bytes of b. It never
// panics and does not allocate.
func ParseTag(b []byte) (Tag, error) {
	if len(b) < TagSize {
		return Tag{}, fmt.Errorf("%w: %d bytes, need %d", ErrTagMalformed, len(b), TagSize)
	}
	b = b[:TagSize]
	switch {
	case [4]byte(b[0:4]) != tagMagic:
		return Tag{}, fmt.Errorf("%w: no magic", ErrTagMalformed)
	case b[4] != tagVersion || b[5]|b[6]|b[7] != 0:
		return Tag{}, fmt.Errorf("%w: version %d", ErrTagMalformed, b[4])
	case binary.BigEndian.Uint64(b[40:]) != checksum.Sum(b[:40]):
		return Tag{}, fmt.Errorf("%w: self-check fails", ErrTagMalformed)
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
// it: its tag record is intact, names the expected request, page index, epoch
// and token count, and the payload matches the record's checksum. The error
// wraps ErrTagMalformed, ErrTagMismatch, ErrTokenMismatch or ErrChecksumMismatch.
func VerifyPage(record, payload []byte, want Expect) error {
	t, err := ParseTag(record)
	if err != nil {
		return err
	}
	if err := CheckTag(t, want); err != nil {
		return err
	}
	if got := checksum.Sum(payload); got != t.Sum {
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

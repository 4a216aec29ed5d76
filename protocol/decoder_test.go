package protocol

import (
	"reflect"
	"testing"
)

// A Decoder decodes a stream of frames exactly as DecodeMessage does, and
// once warm allocates nothing: not even for a Grant's pages.
func TestDecoderDecodesLikeDecodeMessageWithoutAllocating(t *testing.T) {
	var stream []byte
	for _, m := range sampleMessages() {
		stream, _ = AppendMessage(stream, m)
	}
	big := &Grant{Request: 8, Tokens: 300, Pages: make([]PageGrant, 300)}
	for i := range big.Pages {
		big.Pages[i] = PageGrant{Page: uint32(i), Epoch: 1, Addr: uint64(i) << 12, Key: 3}
	}
	stream, _ = AppendMessage(stream, big)
	stream, _ = AppendMessage(stream, sampleMessages()[1]) // a smaller Grant after a larger one
	var d Decoder
	decodeAll := func(check bool) {
		for b := stream; len(b) > 0; {
			want, wn, werr := DecodeMessage(b)
			got, n, err := d.Decode(b)
			if check && (err != nil || werr != nil || n != wn || !reflect.DeepEqual(got, want)) {
				t.Fatalf("Decode: %+v %d %v, DecodeMessage: %+v %d %v", got, n, err, want, wn, werr)
			}
			b = b[n:]
		}
	}
	decodeAll(true)
	allocs := testing.AllocsPerRun(100, func() {
		for b := stream; len(b) > 0; {
			_, n, err := d.Decode(b)
			if err != nil {
				t.Fatal(err)
			}
			b = b[n:]
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per stream", allocs)
	}
	if _, _, err := d.Decode(stream[:3]); err != ErrShortFrame {
		t.Fatalf("a short frame: %v", err)
	}
}

package llama

import (
	"bytes"
	"testing"
)

// The checkpoint reader takes any bytes without panicking, and whatever it
// accepts is a valid model that writes back to the same bytes.
func FuzzReadCheckpoint(f *testing.F) {
	f.Add(llama2cFile([7]int32{8, 12, 2, 4, 2, 5, 6}))
	f.Add(llama2cFile([7]int32{8, 12, 1, 2, 1, -5, 3}))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := ReadCheckpoint(bytes.NewReader(b), int64(len(b)))
		if err != nil {
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("accepted an invalid model: %v", err)
		}
		var out bytes.Buffer
		if err := WriteCheckpoint(&out, m); err != nil {
			t.Fatal(err)
		}
		if out.Len() != len(b) {
			t.Fatalf("read %d bytes, wrote back %d", len(b), out.Len())
		}
	})
}

// The tokenizer reader takes any bytes without panicking, and encoding any
// text with what it accepts yields tokens of the vocabulary.
func FuzzReadTokenizer(f *testing.F) {
	var buf bytes.Buffer
	WriteTokenizer(&buf, testVocab())
	f.Add(buf.Bytes(), len(testVocab().Pieces), "hello wor\x01ld é€")
	f.Add([]byte{4, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 'a'}, 1, "aaa")
	f.Fuzz(func(t *testing.T, b []byte, vocab int, text string) {
		if vocab > 1<<16 || len(text) > 1024 {
			return
		}
		tok, err := ReadTokenizer(bytes.NewReader(b), int64(len(b)), vocab)
		if err != nil {
			return
		}
		for _, id := range tok.Encode(text, true, true) {
			if id < 0 || id >= tok.Vocab() {
				t.Fatalf("token %d outside a vocabulary of %d", id, tok.Vocab())
			}
		}
	})
}

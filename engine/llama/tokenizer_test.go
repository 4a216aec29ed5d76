package llama

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"runtime"
	"strings"
	"testing"
)

// A vocabulary in sentencepiece's shape: <unk>, <s>, </s>, the 256 byte
// tokens, then pieces with merge scores.
func testVocab() *BPE {
	t := &BPE{}
	add := func(p string, score float32) {
		t.Pieces = append(t.Pieces, []byte(p))
		t.Scores = append(t.Scores, score)
	}
	add("<unk>", 0)
	add("<s>", 0)
	add("</s>", 0)
	for b := 0; b < 256; b++ {
		add(string([]byte{'<', '0', 'x', "0123456789ABCDEF"[b>>4], "0123456789ABCDEF"[b&15], '>'}), 0)
	}
	for _, p := range []struct {
		s     string
		score float32
	}{{" ", -1}, {"h", -2}, {"e", -2}, {"l", -2}, {"o", -2}, {"w", -2}, {"r", -2}, {"d", -2},
		{"he", -3}, {"ll", -3.5}, {"hell", -4}, {"hello", -4.5}, {" hello", -5}, {"wo", -6}, {"é", -2}, {"or", -5.5}} {
		add(p.s, p.score)
	}
	return t
}

func roundTrip(t *testing.T, v *BPE) *BPE {
	t.Helper()
	var buf bytes.Buffer
	if err := WriteTokenizer(&buf, v); err != nil {
		t.Fatal(err)
	}
	got, err := ReadTokenizer(bytes.NewReader(buf.Bytes()), int64(buf.Len()), len(v.Pieces))
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// llama2.c's encode: BOS, the dummy prefix " ", code points looked up or
// byte-fallback (+3), then repeated merges of the best-scoring pair.
func TestEncodeIsLlama2csBPE(t *testing.T) {
	v := roundTrip(t, testVocab())
	id := func(s string) int { return v.lookup(s) }
	got := v.Encode("hello wor\x01ld", true, true)
	// " "+"hello" merges to " hello" (the best pairs first: he, ll, hell,
	// hello, then " hello"); "w","o" -> "wo"? no: "or" (-5.5) beats "wo" (-6).
	want := []int{BOS, id(" hello"), id(" "), id("w"), id("or"), 0x01 + 3, id("l"), id("d"), EOS}
	if !equalInts(got, want) {
		t.Fatalf("Encode = %v, want %v", got, want)
	}
	// A multi-byte code point in the vocabulary is one token; one outside it
	// falls back to its bytes.
	if got := v.Encode("é€", false, false); !equalInts(got, []int{id(" "), id("é"), 0xE2 + 3, 0x82 + 3, 0xAC + 3}) {
		t.Fatalf("Encode(é€) = %v", got)
	}
	if got := v.Encode("", true, false); !equalInts(got, []int{BOS}) {
		t.Fatalf("Encode(\"\") = %v: no dummy prefix for empty text", got)
	}
	// Decode: after BOS the leading space goes; byte tokens are their byte.
	if s := Decode(v, []int{id(" hello"), id(" "), 0x0A + 3}, BOS); s != "hello \n" {
		t.Fatalf("Decode = %q", s)
	}
}

func TestReadTokenizerRefusesMalformedFiles(t *testing.T) {
	var buf bytes.Buffer
	WriteTokenizer(&buf, testVocab())
	good := buf.Bytes()
	n := len(testVocab().Pieces)
	long := append([]byte(nil), good...)
	binary.LittleEndian.PutUint32(long[4+4:], math.MaxInt32) // token 0's length
	for name, c := range map[string]struct {
		b     []byte
		vocab int
	}{
		"truncated":       {good[:len(good)-1], n},
		"trailing bytes":  {append(append([]byte(nil), good...), 0), n},
		"more tokens":     {good, n + 1},
		"huge length":     {long, n},
		"zero vocabulary": {good, 0},
	} {
		if _, err := ReadTokenizer(bytes.NewReader(c.b), int64(len(c.b)), c.vocab); !errors.Is(err, ErrTokenizer) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// tokenizer.bin as llama2.c's tokenizer.py packs it: struct "I" for
// max_token_length, then per token "fI" (score, length) and the bytes.
func TestReadTokenizerReadsLlama2cLayout(t *testing.T) {
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, uint32(5))
	for _, tok := range []struct {
		score float32
		s     string
	}{{0, "<unk>"}, {0, "<s>"}, {-1.5, " a"}, {-2.25, "b"}} {
		binary.Write(&b, binary.LittleEndian, tok.score)
		binary.Write(&b, binary.LittleEndian, uint32(len(tok.s)))
		b.WriteString(tok.s)
	}
	v, err := ReadTokenizer(bytes.NewReader(b.Bytes()), int64(b.Len()), 4)
	if err != nil {
		t.Fatal(err)
	}
	if v.MaxTokenLength != 5 || string(v.Pieces[2]) != " a" || v.Scores[3] != -2.25 || string(v.Pieces[0]) != "<unk>" {
		t.Fatalf("read %d, %q, %v", v.MaxTokenLength, v.Pieces, v.Scores)
	}
}

// The byte vocabulary puts BOS (llama2.c's id 1) first when asked, and
// refuses text holding byte 0x01, which would be a BOS of the text's own.
func TestBytesPutBOSFirstAndRefuseTextThatHoldsIt(t *testing.T) {
	var b Bytes
	if got := b.Encode("hi", true, false); !equalInts(got, []int{BOS, 'h', 'i'}) {
		t.Fatalf("Encode(hi, bos) = %v", got)
	}
	if got := b.Encode("hi", false, true); !equalInts(got, []int{'h', 'i'}) {
		t.Fatalf("Encode(hi) = %v: a byte vocabulary has no EOS", got)
	}
	if err := b.Check("any text\x00\x02\xff é"); err != nil {
		t.Fatal(err)
	}
	err := b.Check("ab\x01cd")
	if !errors.Is(err, ErrText) || !strings.Contains(err.Error(), "offset 2") {
		t.Fatalf("Check of text holding 0x01: %v", err)
	}
	if err := testVocab().Check("ab\x01cd"); err != nil {
		t.Fatalf("llama2.c's vocabulary encodes 0x01 as a byte-fallback token: %v", err)
	}
}

// EncodeLimit is Encode up to the limit, and refuses text over it by an
// error matching ErrTooManyTokens; text no limit tokens could hold is
// refused before tokenizing: refusing a 16 MiB text allocates nothing of its
// size.
func TestEncodeLimitRefusesTextOverTheLimitBeforeTokenizing(t *testing.T) {
	v := roundTrip(t, testVocab())
	for _, tok := range []Tokenizer{Bytes{}, v} {
		text := "hello world hello"
		all := tok.Encode(text, true, false)
		got, err := tok.EncodeLimit(text, true, false, len(all))
		if err != nil || !equalInts(got, all) {
			t.Fatalf("%T at the limit: %v %v, want %v", tok, got, err, all)
		}
		if _, err := tok.EncodeLimit(text, true, false, len(all)-1); !errors.Is(err, ErrTooManyTokens) {
			t.Fatalf("%T one token over: %v", tok, err)
		}
		huge := strings.Repeat("hello ", 16<<20/6)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		_, err = tok.EncodeLimit(huge, true, false, 1024)
		runtime.ReadMemStats(&after)
		if !errors.Is(err, ErrTooManyTokens) {
			t.Fatalf("%T 16 MiB: %v", tok, err)
		}
		if n := after.TotalAlloc - before.TotalAlloc; n > 64<<10 {
			t.Fatalf("%T refusing 16 MiB of text allocated %d bytes: it tokenized", tok, n)
		}
	}
}

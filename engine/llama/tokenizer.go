package llama

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"
	"strings"
)

// Tokenizer turns text into tokens and tokens back into bytes.
type Tokenizer interface {
	// Encode tokenizes text, with the beginning-of-sequence token first if
	// bos and the end-of-sequence token last if eos (where the vocabulary
	// has them).
	Encode(text string, bos, eos bool) []int
	// Check says why text cannot be encoded faithfully (an error matching
	// ErrText), or nil: callers check untrusted text before Encode.
	Check(text string) error
	// EncodeLimit is Encode for text of at most limit tokens (BOS and EOS
	// counted); over it, an error matching ErrTooManyTokens. Text longer
	// than limit tokens of the vocabulary's longest piece is refused before
	// anything is allocated, so what untrusted text costs is bounded by
	// limit, not by the text's length.
	EncodeLimit(text string, bos, eos bool, limit int) ([]int, error)
	// Piece is token's bytes, following prev (-1 at the start).
	Piece(prev, token int) []byte
	// Vocab is the vocabulary's size.
	Vocab() int
	// EOS is the end-of-sequence token, or -1.
	EOS() int
}

// ErrText: text a tokenizer will not encode (the byte vocabulary's BOS byte).
var ErrText = errors.New("model: text the tokenizer will not encode")

// ErrTooManyTokens: text over EncodeLimit's limit.
var ErrTooManyTokens = errors.New("model: text over the token limit")

func tooManyTokens(text string, limit int, why string) error {
	return fmt.Errorf("%w: %d bytes %s, the limit is %d tokens", ErrTooManyTokens, len(text), why, limit)
}

// Bytes is the built-in model's vocabulary: token b is byte b, and token 1
// (BOS, llama2.c's id) is also the beginning of sequence, so text holding
// byte 0x01 is refused by Check: it would be a BOS the text's author placed,
// an attention sink of the built-in model in the middle of a prompt.
type Bytes struct{}

// Encode returns text's bytes, after BOS if bos; a byte vocabulary has no
// EOS. Text that Check refuses is encoded byte for byte all the same.
func (Bytes) Encode(text string, bos, eos bool) []int {
	out := make([]int, 0, len(text)+1)
	if bos {
		out = append(out, BOS)
	}
	for i := 0; i < len(text); i++ {
		out = append(out, int(text[i]))
	}
	return out
}

// EncodeLimit refuses text of more than limit tokens by its length alone
// (one token a byte) before allocating.
func (b Bytes) EncodeLimit(text string, bos, eos bool, limit int) ([]int, error) {
	n := len(text)
	if bos {
		n++
	}
	if n > limit {
		return nil, tooManyTokens(text, limit, fmt.Sprintf("are %d tokens", n))
	}
	return b.Encode(text, bos, eos), nil
}

// Check refuses text holding byte 0x01, the vocabulary's BOS.
func (Bytes) Check(text string) error {
	if i := strings.IndexByte(text, BOS); i >= 0 {
		return fmt.Errorf("%w: byte 0x01 at offset %d is the byte vocabulary's beginning of sequence", ErrText, i)
	}
	return nil
}

// Piece is the byte itself.
func (Bytes) Piece(prev, token int) []byte {
	if token < 0 || token > 255 {
		return nil
	}
	return []byte{byte(token)}
}

// Vocab is 256.
func (Bytes) Vocab() int { return 256 }

// EOS is -1: a byte vocabulary has none.
func (Bytes) EOS() int { return -1 }

// Decode is the text of tokens under t.
func Decode(t Tokenizer, tokens []int, prev int) string {
	var out []byte
	for _, tok := range tokens {
		out = append(out, t.Piece(prev, tok)...)
		prev = tok
	}
	return string(out)
}

// ErrTokenizer: a tokenizer file that is not llama2.c's layout.
var ErrTokenizer = errors.New("model: malformed tokenizer")

// The special tokens of llama2.c's (sentencepiece's) vocabulary.
const (
	BOS = 1
	EOS = 2
	// byteBase is where the byte-fallback tokens <0x00>..<0xFF> start.
	byteBase = 3
)

// BPE is llama2.c's tokenizer.bin: a vocabulary of byte strings with merge
// scores, encoded as llama2.c's encode does (dummy prefix, UTF-8 code points
// with byte fallback, then greedy merges of the best-scoring pair).
type BPE struct {
	MaxTokenLength int
	Pieces         [][]byte
	Scores         []float32
	index          map[string]int
}

// ReadTokenizer reads a tokenizer.bin of vocab tokens from r (size bytes).
func ReadTokenizer(r io.Reader, size int64, vocab int) (*BPE, error) {
	if vocab <= 0 || int64(vocab)*8+4 > size {
		return nil, fmt.Errorf("%w: %d tokens cannot fit in %d bytes", ErrTokenizer, vocab, size)
	}
	br := bufio.NewReader(r)
	var maxLen int32
	if err := binary.Read(br, binary.LittleEndian, &maxLen); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrTokenizer, err)
	}
	if maxLen <= 0 || int64(maxLen) > size {
		return nil, fmt.Errorf("%w: max_token_length %d", ErrTokenizer, maxLen)
	}
	t := &BPE{MaxTokenLength: int(maxLen), Pieces: make([][]byte, vocab), Scores: make([]float32, vocab)}
	left := size - 4
	for i := 0; i < vocab; i++ {
		var rec struct {
			Score float32
			Len   int32
		}
		if err := binary.Read(br, binary.LittleEndian, &rec); err != nil {
			return nil, fmt.Errorf("%w: token %d: %v", ErrTokenizer, i, err)
		}
		left -= 8
		if rec.Len < 0 || int64(rec.Len) > left || rec.Len > maxLen {
			return nil, fmt.Errorf("%w: token %d has length %d (max %d)", ErrTokenizer, i, rec.Len, maxLen)
		}
		t.Pieces[i] = make([]byte, rec.Len)
		if _, err := io.ReadFull(br, t.Pieces[i]); err != nil {
			return nil, fmt.Errorf("%w: token %d: %v", ErrTokenizer, i, err)
		}
		left -= int64(rec.Len)
		t.Scores[i] = rec.Score
	}
	if left != 0 {
		return nil, fmt.Errorf("%w: %d bytes after %d tokens", ErrTokenizer, left, vocab)
	}
	t.buildIndex()
	return t, nil
}

// LoadTokenizer reads the tokenizer.bin at path.
func LoadTokenizer(path string, vocab int) (*BPE, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	t, err := ReadTokenizer(f, st.Size(), vocab)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return t, nil
}

// WriteTokenizer writes t in llama2.c's layout.
func WriteTokenizer(w io.Writer, t *BPE) error {
	bw := bufio.NewWriter(w)
	maxLen := 0
	for _, p := range t.Pieces {
		maxLen = max(maxLen, len(p))
	}
	if t.MaxTokenLength > maxLen {
		maxLen = t.MaxTokenLength
	}
	if err := binary.Write(bw, binary.LittleEndian, int32(maxLen)); err != nil {
		return err
	}
	for i, p := range t.Pieces {
		var hdr [8]byte
		binary.LittleEndian.PutUint32(hdr[:], math.Float32bits(t.Scores[i]))
		binary.LittleEndian.PutUint32(hdr[4:], uint32(len(p)))
		bw.Write(hdr[:])
		bw.Write(p)
	}
	return bw.Flush()
}

// buildIndex maps each piece to its lowest token id.
func (t *BPE) buildIndex() {
	t.index = make(map[string]int, len(t.Pieces))
	for i := len(t.Pieces) - 1; i >= 0; i-- {
		t.index[string(t.Pieces[i])] = i
	}
}

// Vocab is the vocabulary's size.
func (t *BPE) Vocab() int { return len(t.Pieces) }

// EOS is token 2.
func (t *BPE) EOS() int { return EOS }

func (t *BPE) lookup(s string) int {
	if t.index == nil {
		t.buildIndex()
	}
	if id, ok := t.index[s]; ok {
		return id
	}
	return -1
}

// Check accepts every text: bytes without a piece of their own are encoded
// by the byte-fallback tokens, never as BOS or EOS.
func (t *BPE) Check(string) error { return nil }

// maxPieceBytes is the most text bytes one token stands for: its longest
// piece (a byte-fallback piece "<0xXX>" stands for one byte, and is counted
// as six: an over-estimate, which only lets more text reach Encode's count).
func (t *BPE) maxPieceBytes() int {
	n := 1
	for _, p := range t.Pieces {
		n = max(n, len(p))
	}
	return n
}

// EncodeLimit refuses text that no limit tokens can hold (each token stands
// for at most the longest piece's bytes) before tokenizing it, so the
// encoder's working set is bounded by limit; text that passes is encoded and
// its tokens counted.
func (t *BPE) EncodeLimit(text string, bos, eos bool, limit int) ([]int, error) {
	if limit < 0 || len(text) > limit*t.maxPieceBytes() {
		return nil, tooManyTokens(text, limit, "cannot fit")
	}
	toks := t.Encode(text, bos, eos)
	if len(toks) > limit {
		return nil, tooManyTokens(text, limit, fmt.Sprintf("are %d tokens", len(toks)))
	}
	return toks, nil
}

// Encode is llama2.c's encode.
func (t *BPE) Encode(text string, bos, eos bool) []int {
	var toks []int
	if bos && BOS < len(t.Pieces) {
		toks = append(toks, BOS)
	}
	if text != "" {
		if id := t.lookup(" "); id >= 0 {
			toks = append(toks, id)
		}
	}
	for i := 0; i < len(text); {
		// One code point: a lead byte and up to three continuation bytes.
		j := i + 1
		for j < len(text) && text[j]&0xC0 == 0x80 && j-i < 4 {
			j++
		}
		if id := t.lookup(text[i:j]); id >= 0 {
			toks = append(toks, id)
		} else {
			for k := i; k < j; k++ {
				if id := int(text[k]) + byteBase; id < len(t.Pieces) {
					toks = append(toks, id)
				}
			}
		}
		i = j
	}
	// Repeatedly merge the adjacent pair whose merged piece scores best (the
	// first such pair on a tie). Each pair's merge is looked up once and
	// again only when a neighbour changes.
	pair := func(i int) (int, float32) {
		id := t.lookup(string(t.Pieces[toks[i]]) + string(t.Pieces[toks[i+1]]))
		if id < 0 {
			return -1, 0
		}
		return id, t.Scores[id]
	}
	ids, scores := make([]int, max(len(toks)-1, 0)), make([]float32, max(len(toks)-1, 0))
	for i := range ids {
		ids[i], scores[i] = pair(i)
	}
	for {
		best, bestAt := float32(-1e10), -1
		for i, id := range ids {
			if id >= 0 && scores[i] > best {
				best, bestAt = scores[i], i
			}
		}
		if bestAt < 0 {
			break
		}
		toks[bestAt] = ids[bestAt]
		toks = append(toks[:bestAt+1], toks[bestAt+2:]...)
		ids = append(ids[:bestAt], ids[bestAt+1:]...)
		scores = append(scores[:bestAt], scores[bestAt+1:]...)
		if bestAt > 0 {
			ids[bestAt-1], scores[bestAt-1] = pair(bestAt - 1)
		}
		if bestAt < len(ids) {
			ids[bestAt], scores[bestAt] = pair(bestAt)
		}
	}
	if eos && EOS < len(t.Pieces) {
		toks = append(toks, EOS)
	}
	return toks
}

// Piece is llama2.c's decode: after BOS a leading space is dropped, and a
// byte token <0xXX> is that byte.
func (t *BPE) Piece(prev, token int) []byte {
	if token < 0 || token >= len(t.Pieces) {
		return nil
	}
	p := t.Pieces[token]
	if prev == BOS && len(p) > 0 && p[0] == ' ' {
		p = p[1:]
	}
	if len(p) == 6 && string(p[:3]) == "<0x" && p[5] == '>' {
		if b, err := strconv.ParseUint(string(p[3:5]), 16, 8); err == nil {
			return []byte{byte(b)}
		}
	}
	return p
}

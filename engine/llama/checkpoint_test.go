package llama

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"testing"
)

// llama2cFile lays out a checkpoint by hand, as llama2.c's legacy exporter
// does, without our writer: header, arrays in order, the two rotary tables,
// the classifier when not shared. Array k's values are k*1000 + index.
func llama2cFile(hdr [7]int32) []byte {
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, hdr)
	d, h, l, heads, kvh, seq := int(hdr[0]), int(hdr[1]), int(hdr[2]), int(hdr[3]), int(hdr[4]), int(hdr[6])
	v := int(hdr[5])
	if v < 0 {
		v = -v
	}
	hs := d / heads
	kv := kvh * hs
	sizes := []int{v * d, l * d, l * d * d, l * kv * d, l * kv * d, l * d * d, l * d, l * h * d, l * d * h, l * h * d, d,
		seq * hs / 2, seq * hs / 2}
	if hdr[5] < 0 {
		sizes = append(sizes, v*d)
	}
	for k, n := range sizes {
		for i := 0; i < n; i++ {
			binary.Write(&b, binary.LittleEndian, float32(k*1000+i))
		}
	}
	return b.Bytes()
}

// The reader reads llama2.c's layout exactly: header fields, the negative
// vocab_size for an unshared classifier, the skipped rotary tables, wk and wv
// sized by the kv heads.
func TestReaderReadsLlama2cLayoutExactly(t *testing.T) {
	for _, shared := range []bool{true, false} {
		hdr := [7]int32{8, 12, 2, 4, 2, 5, 6}
		if !shared {
			hdr[5] = -5
		}
		file := llama2cFile(hdr)
		m, err := ReadCheckpoint(bytes.NewReader(file), int64(len(file)))
		if err != nil {
			t.Fatal(err)
		}
		want := Config{Dim: 8, HiddenDim: 12, Layers: 2, Heads: 4, KVHeads: 2, Vocab: 5, SeqLen: 6, SharedClassifier: shared}
		if m.Config != want {
			t.Fatalf("config %+v, want %+v", m.Config, want)
		}
		arrays := [][]float32{m.TokenEmbedding, m.RMSAttention, m.WQ, m.WK, m.WV, m.WO, m.RMSFFN, m.W1, m.W2, m.W3, m.RMSFinal}
		for k, a := range arrays {
			if a[0] != float32(k*1000) || a[len(a)-1] != float32(k*1000+len(a)-1) {
				t.Fatalf("array %d: first %g last %g (len %d)", k, a[0], a[len(a)-1], len(a))
			}
		}
		if shared && &m.Classifier[0] != &m.TokenEmbedding[0] {
			t.Fatal("shared classifier is not the embedding")
		}
		if !shared && (m.Classifier[0] != 13000 || m.Classifier[len(m.Classifier)-1] != float32(13000+5*8-1)) {
			t.Fatalf("unshared classifier starts %g: the rotary tables were not skipped", m.Classifier[0])
		}
		// Our writer writes the same bytes, apart from the rotary tables'
		// values (ours are real cos/sin), and reads back the same model.
		var buf bytes.Buffer
		if err := WriteCheckpoint(&buf, m); err != nil {
			t.Fatal(err)
		}
		if buf.Len() != len(file) || !bytes.Equal(buf.Bytes()[:28], file[:28]) {
			t.Fatalf("writer: %d bytes, header %x; llama2.c: %d, %x", buf.Len(), buf.Bytes()[:28], len(file), file[:28])
		}
	}
}

// A file whose size is not what its header implies, a header that cannot be
// run, or one that claims an enormous model is refused before anything is
// allocated for it; so are bad trailers.
func TestReaderRefusesMalformedCheckpoints(t *testing.T) {
	good := llama2cFile([7]int32{8, 12, 2, 4, 2, -5, 6})
	trailer := func(magic string, ver, rot uint32) []byte {
		b := append(append([]byte(nil), good...), magic...)
		b = binary.LittleEndian.AppendUint32(b, ver)
		return binary.LittleEndian.AppendUint32(b, rot)
	}
	hdr := func(h [7]int32) []byte {
		var b bytes.Buffer
		binary.Write(&b, binary.LittleEndian, h)
		return b.Bytes()
	}
	for name, file := range map[string][]byte{
		"empty":                 nil,
		"short header":          good[:20],
		"truncated":             good[:len(good)-4],
		"one byte too many":     append(append([]byte(nil), good...), 0),
		"zero heads":            hdr([7]int32{8, 12, 2, 0, 2, 5, 6}),
		"dim not divisible":     hdr([7]int32{9, 12, 2, 4, 2, 5, 6}),
		"kv heads not dividing": hdr([7]int32{8, 12, 2, 4, 3, 5, 6}),
		"huge claim":            hdr([7]int32{1 << 20, 1 << 22, 1 << 10, 1 << 10, 1 << 10, 1 << 20, 1 << 20}),
		"bad trailer magic":     trailer("XXXX", 1, 2),
		"bad trailer version":   trailer("KVHX", 9, 2),
		"odd rotary dims":       trailer("KVHX", 1, 1),
	} {
		_, err := ReadCheckpoint(bytes.NewReader(file), int64(len(file)))
		if !errors.Is(err, ErrCheckpoint) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if m, err := ReadCheckpoint(bytes.NewReader(trailer("KVHX", 1, 2)), int64(len(good)+12)); err != nil || m.RotaryDims != 2 {
		t.Fatalf("good trailer: %v", err)
	}
}

// The writer's rotary tables are llama2.c's: cos and sin of pos*freq.
func TestWriterRotaryTablesAreLlama2cs(t *testing.T) {
	m, _ := Alloc(Config{Dim: 8, HiddenDim: 4, Layers: 1, Heads: 2, KVHeads: 1, Vocab: 3, SeqLen: 5, SharedClassifier: true})
	var buf bytes.Buffer
	WriteCheckpoint(&buf, m)
	b := buf.Bytes()
	floats := 3*8 + 8 + 64 + 2*32 + 64 + 8 + 3*32 + 8
	at := func(i int) float64 {
		return float64(math.Float32frombits(binary.LittleEndian.Uint32(b[28+4*(floats+i):])))
	}
	// head size 4: 2 pairs, freq 1 and 1/100; position 3, pair 1.
	if got, want := at(3*2+1), math.Cos(3.0/100); math.Abs(got-want) > 1e-6 {
		t.Fatalf("cos table at (3,1) = %g, want %g", got, want)
	}
	if got, want := at(5*2+3*2+0), math.Sin(3); math.Abs(got-want) > 1e-6 {
		t.Fatalf("sin table at (3,0) = %g, want %g", got, want)
	}
}

package llama

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"unsafe"
)

// ErrCheckpoint: a file that is not a checkpoint of the architecture its
// header claims (a short or long file, a bad header, a bad trailer).
var ErrCheckpoint = errors.New("model: malformed checkpoint")

const headerBytes = 7 * 4

// The trailer a checkpoint carries when its architecture is not llama2.c's
// (partial rotary): magic, version, rotary dims. llama2.c reads nothing past
// the arrays, so such a file still loads there (with full rotary).
var trailerMagic = [4]byte{'K', 'V', 'H', 'X'}

const (
	trailerVersion = 1
	trailerBytes   = 12
)

// legacyRotaryFloats is the size of the two rotary tables (cos, sin) that
// llama2.c's exporter writes after the final norm and its reader skips.
func (c Config) legacyRotaryFloats() int64 { return 2 * int64(c.SeqLen) * int64(c.HeadDim()) / 2 }

// arraysFloats is the number of float32 values after the header, rotary
// tables included, computed in float64 so a hostile header cannot overflow it.
func (c Config) arraysFloats() float64 {
	d, h, l, kv, v := float64(c.Dim), float64(c.HiddenDim), float64(c.Layers), float64(c.KVDim()), float64(c.Vocab)
	n := v*d + l*d + l*d*d + 2*l*kv*d + l*d*d + l*d + 3*l*h*d + d + float64(c.legacyRotaryFloats())
	if !c.SharedClassifier {
		n += v * d
	}
	return n
}

// ReadCheckpoint reads a model in llama2.c's format from r, which holds size
// bytes. It checks the header and that size is exactly what the header
// implies (plus an optional trailer) before it allocates anything.
func ReadCheckpoint(r io.Reader, size int64) (*Model, error) {
	br := bufio.NewReaderSize(r, 1<<16)
	var hdr [7]int32
	if err := binary.Read(br, binary.LittleEndian, &hdr); err != nil {
		return nil, fmt.Errorf("%w: header: %v", ErrCheckpoint, err)
	}
	c := Config{Dim: int(hdr[0]), HiddenDim: int(hdr[1]), Layers: int(hdr[2]), Heads: int(hdr[3]),
		KVHeads: int(hdr[4]), Vocab: int(hdr[5]), SeqLen: int(hdr[6]), SharedClassifier: hdr[5] > 0}
	if hdr[5] < 0 {
		c.Vocab = -int(hdr[5])
	}
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("%w: header %v: %v", ErrCheckpoint, hdr, err)
	}
	body := float64(size - headerBytes)
	want := 4 * c.arraysFloats()
	switch body {
	case want:
	case want + trailerBytes:
	default:
		return nil, fmt.Errorf("%w: header %v implies %.0f bytes of arrays, the file has %d", ErrCheckpoint, hdr, want, size-headerBytes)
	}
	m, err := Alloc(c)
	if err != nil {
		return nil, err
	}
	for _, a := range m.arrays() {
		if err := readFloats(br, *a.p); err != nil {
			return nil, err
		}
	}
	if _, err := br.Discard(int(4 * c.legacyRotaryFloats())); err != nil {
		return nil, fmt.Errorf("%w: rotary tables: %v", ErrCheckpoint, err)
	}
	if !c.SharedClassifier {
		if err := readFloats(br, m.Classifier); err != nil {
			return nil, err
		}
	}
	if body == want+trailerBytes {
		var t [trailerBytes]byte
		if _, err := io.ReadFull(br, t[:]); err != nil {
			return nil, fmt.Errorf("%w: trailer: %v", ErrCheckpoint, err)
		}
		if [4]byte(t[:4]) != trailerMagic || binary.LittleEndian.Uint32(t[4:]) != trailerVersion {
			return nil, fmt.Errorf("%w: %d bytes after the arrays are not a kvhandoff trailer", ErrCheckpoint, trailerBytes)
		}
		m.RotaryDims = int(int32(binary.LittleEndian.Uint32(t[8:])))
		if err := m.Config.Validate(); err != nil {
			return nil, fmt.Errorf("%w: trailer: %v", ErrCheckpoint, err)
		}
	}
	return m, nil
}

func readFloats(r io.Reader, dst []float32) error {
	b := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(dst))), 4*len(dst))
	if _, err := io.ReadFull(r, b); err != nil {
		return fmt.Errorf("%w: %v", ErrCheckpoint, err)
	}
	if !littleEndian {
		for i := range dst {
			dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
		}
	}
	return nil
}

var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// WriteCheckpoint writes m in llama2.c's format: the header, the arrays, the
// legacy rotary tables, the classifier if it is not shared, and the trailer
// if the architecture needs one.
func WriteCheckpoint(w io.Writer, m *Model) error {
	if err := m.Validate(); err != nil {
		return err
	}
	c := m.Config
	vocab := int32(c.Vocab)
	if !c.SharedClassifier {
		vocab = -vocab
	}
	bw := bufio.NewWriterSize(w, 1<<16)
	hdr := [7]int32{int32(c.Dim), int32(c.HiddenDim), int32(c.Layers), int32(c.Heads), int32(c.KVHeads), vocab, int32(c.SeqLen)}
	if err := binary.Write(bw, binary.LittleEndian, hdr); err != nil {
		return err
	}
	for _, a := range m.arrays() {
		if err := writeFloats(bw, *a.p); err != nil {
			return err
		}
	}
	// The tables llama2.c's exporter writes: cos, then sin, of position
	// times each pair's frequency; unrotated pairs are the identity.
	half := c.HeadDim() / 2
	for _, f := range []func(float64) float64{math.Cos, math.Sin} {
		row := make([]float32, c.SeqLen*half)
		for pos := 0; pos < c.SeqLen; pos++ {
			for i := 0; i < half; i++ {
				angle := 0.0
				if 2*i < c.Rotary() {
					angle = float64(pos) * RotaryFrequency(i, c.Rotary())
				}
				row[pos*half+i] = float32(f(angle))
			}
		}
		if err := writeFloats(bw, row); err != nil {
			return err
		}
	}
	if !c.SharedClassifier {
		if err := writeFloats(bw, m.Classifier); err != nil {
			return err
		}
	}
	if c.RotaryDims != 0 {
		var t [trailerBytes]byte
		copy(t[:], trailerMagic[:])
		binary.LittleEndian.PutUint32(t[4:], trailerVersion)
		binary.LittleEndian.PutUint32(t[8:], uint32(c.RotaryDims))
		if _, err := bw.Write(t[:]); err != nil {
			return err
		}
	}
	return bw.Flush()
}

// RotaryFrequency is the angle per position of rotary pair i when rotary
// covers dims dimensions: llama2.c's 1/10000^(2i/dims).
func RotaryFrequency(i, dims int) float64 {
	return 1 / math.Pow(RopeTheta, float64(2*i)/float64(dims))
}

func writeFloats(w io.Writer, src []float32) error {
	var buf [4096]byte
	for len(src) > 0 {
		n := min(len(src), len(buf)/4)
		for i, v := range src[:n] {
			binary.LittleEndian.PutUint32(buf[4*i:], math.Float32bits(v))
		}
		if _, err := w.Write(buf[:4*n]); err != nil {
			return err
		}
		src = src[n:]
	}
	return nil
}

// LoadCheckpoint reads the checkpoint file at path.
func LoadCheckpoint(path string) (*Model, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	m, err := ReadCheckpoint(f, st.Size())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return m, nil
}

// SaveCheckpoint writes m to the file at path.
func SaveCheckpoint(path string, m *Model) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := WriteCheckpoint(f, m); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

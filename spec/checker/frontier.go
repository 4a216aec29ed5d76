package checker

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
)

// Encoder is implemented by a model whose states can be written compactly. The
// checker then holds the BFS frontier (the states still to expand, the only
// whole states it keeps) as encodings, and spills it to disk past
// Options.FrontierMemory. Without it the frontier is a slice of states, in memory.
type Encoder[S any] interface {
	// AppendState appends a lossless encoding of *s to dst.
	AppendState(dst []byte, s *S) []byte
	// DecodeState sets *s to the state that src encodes.
	DecodeState(src []byte, s *S) error
}

// blockStates is how many frontier states a worker expands at a time.
const blockStates = 256

// block is a run of frontier states, in BFS order.
type block[S any] struct {
	idx    []int32 // state numbers
	states []S     // without an encoder
	data   []byte  // with an encoder: per state, a uvarint length and the encoding
	paths  []byte  // bitstate mode: the states' paths, the i-th ending at idx[i]
}

func (b *block[S]) len() int { return len(b.idx) }

func (b *block[S]) bytes() int {
	return 4*cap(b.idx) + cap(b.data) + cap(b.paths) + cap(b.states)*sizeOf[S]()
}

// frontier is a FIFO of blocks: a prefix spilled to a file, the rest in memory.
type frontier[S any] struct {
	encoded  bool
	budget   func() int // bytes of blocks in memory before spilling the oldest
	dir      string
	mem      []*block[S] // in order, after the spilled blocks
	memBytes int
	states   int // in memory

	spilledStates int // in the file, not yet read

	file         *os.File
	w            *bufio.Writer
	r            *bufio.Reader
	spilled      int // blocks in the file not yet read
	spilledBytes int64
	hdr          [12]byte
	pool         *blockPool[S] // shared by the frontiers of one run
}

// blockPool keeps blocks for reuse. Every block is kept: the next level's
// frontier takes them over, where dropping them would leave a level's worth
// of garbage for the collector to find, which with the default GOGC may sit in
// memory until the live heap doubles. For the same reason a new block's data
// is allocated at the size full blocks reached, not grown by appending.
// Workers fill blocks at once, so it is locked.
type blockPool[S any] struct {
	sync.Mutex
	free     []*block[S]
	dataHint int // bytes of data in the last full block
}

// get returns an empty block.
func (p *blockPool[S]) get(encoded bool) *block[S] {
	p.Lock()
	defer p.Unlock()
	if n := len(p.free); n > 0 {
		b := p.free[n-1]
		p.free = p.free[:n-1]
		b.idx, b.states, b.data, b.paths = b.idx[:0], b.states[:0], b.data[:0], b.paths[:0]
		return b
	}
	b := &block[S]{idx: make([]int32, 0, blockStates)}
	if encoded {
		b.data = make([]byte, 0, p.dataHint+p.dataHint/8)
	} else {
		b.states = make([]S, 0, blockStates)
	}
	return b
}

// put takes back a block whose states were expanded or moved on.
func (p *blockPool[S]) put(b *block[S]) {
	clear(b.states) // states may hold references
	p.Lock()
	defer p.Unlock()
	if b.len() == blockStates && len(b.data) > 0 {
		p.dataHint = len(b.data)
	}
	p.free = append(p.free, b)
}

// recycle takes back a block whose states were expanded.
func (f *frontier[S]) recycle(b *block[S]) { f.pool.put(b) }

// push appends a block, which the frontier then owns; an empty one goes back to the pool.
func (f *frontier[S]) push(b *block[S]) error {
	if b.len() == 0 {
		f.pool.put(b)
		return nil
	}
	if err := f.spillIfOver(); err != nil {
		return err
	}
	f.mem = append(f.mem, b)
	f.memBytes += b.bytes()
	f.states += b.len()
	return nil
}

// errSpill wraps a failure to write or read the frontier's spill file.
var errSpill = errors.New("checker: frontier spill file")

// spillIfOver writes the oldest full in-memory blocks to the spill file while
// the blocks in memory exceed the budget. Only encoded frontiers spill.
func (f *frontier[S]) spillIfOver() error {
	if !f.encoded {
		return nil
	}
	for budget := f.budget(); f.memBytes > budget && len(f.mem) > 0; {
		if f.file == nil {
			file, err := os.CreateTemp(f.dir, "kvhandoff-frontier-*")
			if err != nil {
				return fmt.Errorf("%w: %v", errSpill, err)
			}
			os.Remove(file.Name()) // unlinked: the space is freed when it is closed, even on a crash
			f.file, f.w = file, bufio.NewWriterSize(file, 1<<20)
		}
		b := f.mem[0]
		binary.LittleEndian.PutUint32(f.hdr[:4], uint32(len(b.idx)))
		binary.LittleEndian.PutUint32(f.hdr[4:], uint32(len(b.data)))
		binary.LittleEndian.PutUint32(f.hdr[8:], uint32(len(b.paths)))
		if _, err := f.w.Write(f.hdr[:]); err != nil {
			return fmt.Errorf("%w: %v", errSpill, err)
		}
		var n [4]byte
		for _, i := range b.idx {
			binary.LittleEndian.PutUint32(n[:], uint32(i))
			f.w.Write(n[:])
		}
		if _, err := f.w.Write(b.data); err != nil {
			return fmt.Errorf("%w: %v", errSpill, err)
		}
		if _, err := f.w.Write(b.paths); err != nil {
			return fmt.Errorf("%w: %v", errSpill, err)
		}
		f.spilled++
		f.spilledBytes += int64(len(f.hdr) + 4*len(b.idx) + len(b.data) + len(b.paths))
		f.memBytes -= b.bytes()
		f.mem = f.mem[1:]
		f.states -= b.len()
		f.spilledStates += b.len()
		f.recycle(b)
	}
	return nil
}

// take removes and returns the oldest block, or nil when the frontier is empty.
func (f *frontier[S]) take() (*block[S], error) {
	if f.spilled > 0 {
		if f.r == nil {
			if err := f.w.Flush(); err != nil {
				return nil, fmt.Errorf("%w: %v", errSpill, err)
			}
			if _, err := f.file.Seek(0, io.SeekStart); err != nil {
				return nil, fmt.Errorf("%w: %v", errSpill, err)
			}
			f.r = bufio.NewReaderSize(f.file, 1<<20)
		}
		if _, err := io.ReadFull(f.r, f.hdr[:]); err != nil {
			return nil, fmt.Errorf("%w: %v", errSpill, err)
		}
		n, size := binary.LittleEndian.Uint32(f.hdr[:4]), binary.LittleEndian.Uint32(f.hdr[4:])
		pathBytes := binary.LittleEndian.Uint32(f.hdr[8:])
		b := f.pool.get(f.encoded)
		var w [4]byte
		for range n {
			if _, err := io.ReadFull(f.r, w[:]); err != nil {
				return nil, fmt.Errorf("%w: %v", errSpill, err)
			}
			b.idx = append(b.idx, int32(binary.LittleEndian.Uint32(w[:])))
		}
		if cap(b.data) < int(size) {
			b.data = make([]byte, size)
		}
		b.data = b.data[:size]
		if _, err := io.ReadFull(f.r, b.data); err != nil {
			return nil, fmt.Errorf("%w: %v", errSpill, err)
		}
		if cap(b.paths) < int(pathBytes) {
			b.paths = make([]byte, pathBytes)
		}
		b.paths = b.paths[:pathBytes]
		if _, err := io.ReadFull(f.r, b.paths); err != nil {
			return nil, fmt.Errorf("%w: %v", errSpill, err)
		}
		f.spilled--
		f.spilledStates -= int(n)
		return b, nil
	}
	if len(f.mem) == 0 {
		return nil, nil
	}
	b := f.mem[0]
	f.mem[0] = nil
	f.mem = f.mem[1:]
	f.memBytes -= b.bytes()
	f.states -= b.len()
	return b, nil
}

// len is the number of states in the frontier.
func (f *frontier[S]) len() int { return f.states + f.spilledStates }

// close releases the spill file.
func (f *frontier[S]) close() {
	if f.file != nil {
		f.file.Close()
		f.file, f.w, f.r = nil, nil, nil
	}
}

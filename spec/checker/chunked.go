package checker

// chunkBits sets the size of a chunk: 64Ki elements.
const chunkBits = 16

// chunked is an append-only array stored in fixed-size chunks. Growing it
// never copies and leaves no garbage, unlike a slice, whose growth holds the
// old and the new array at once: for the checker's per-state arrays that was
// the difference between the live heap and the peak.
type chunked[T any] struct {
	chunks [][]T
	n      int
}

func (c *chunked[T]) len() int { return c.n }

func (c *chunked[T]) append(v T) {
	if c.n&(1<<chunkBits-1) == 0 && c.n>>chunkBits == len(c.chunks) {
		c.chunks = append(c.chunks, make([]T, 1<<chunkBits))
	}
	c.chunks[c.n>>chunkBits][c.n&(1<<chunkBits-1)] = v
	c.n++
}

// grow sets the length to n (never shrinking), allocating chunks, so that
// goroutines may then set distinct elements at once.
func (c *chunked[T]) grow(n int) {
	for len(c.chunks)<<chunkBits < n {
		c.chunks = append(c.chunks, make([]T, 1<<chunkBits))
	}
	c.n = max(c.n, n)
}

// copyAt sets the elements from i on to vs; they must be within the length.
func (c *chunked[T]) copyAt(i int, vs []T) {
	for len(vs) > 0 {
		k := copy(c.chunks[i>>chunkBits][i&(1<<chunkBits-1):], vs)
		i += k
		vs = vs[k:]
	}
}

func (c *chunked[T]) at(i int) T { return c.chunks[i>>chunkBits][i&(1<<chunkBits-1)] }

func (c *chunked[T]) ptr(i int) *T { return &c.chunks[i>>chunkBits][i&(1<<chunkBits-1)] }

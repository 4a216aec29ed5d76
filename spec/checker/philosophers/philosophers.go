// Package philosophers is the naive dining philosophers as a checker model,
// the one SPIN's comparison and the checker's parallel benchmarks run: each
// philosopher takes the left fork, then the right, eats, and puts both down.
// Every philosopher holding the left fork is a deadlock, and the reachable
// states are every assignment in which no fork is held twice (about 2.4^n).
package philosophers

import "fmt"

// MaxN is the largest table: 2 bits per philosopher in a uint64.
const MaxN = 32

// Model is n philosophers around a table. A state holds philosopher i's state
// in bits 2i and 2i+1: 0 thinking, 1 holding the left fork, 2 eating (both
// forks). Philosopher i's left fork is fork i, its right fork is fork i+1 mod n.
// An action is 3i (take the left fork), 3i+1 (take the right), 3i+2 (put both down).
type Model struct{ N int }

// New returns the table of n philosophers, 2 ≤ n ≤ MaxN.
func New(n int) (Model, error) {
	if n < 2 || n > MaxN {
		return Model{}, fmt.Errorf("philosophers: n must be 2..%d, got %d", MaxN, n)
	}
	return Model{N: n}, nil
}

// Initial is every philosopher thinking.
func (Model) Initial() []uint64 { return []uint64{0} }

func (p Model) phil(s uint64, i int) uint64 { return s >> (2 * ((i%p.N + p.N) % p.N)) & 3 }

// forkFree reports whether fork f (philosopher f's left, f-1's right) is free.
func (p Model) forkFree(s uint64, f int) bool { return p.phil(s, f) == 0 && p.phil(s, f-1) != 2 }

// Successors emits each philosopher's next step, in philosopher order.
func (p Model) Successors(s *uint64, emit func(int, *uint64)) {
	v := *s
	var next uint64 // one per call: emit takes its address
	for i := 0; i < p.N; i++ {
		set := func(x uint64) uint64 { return v&^(3<<(2*i)) | x<<(2*i) }
		switch p.phil(v, i) {
		case 0:
			if !p.forkFree(v, i) {
				continue
			}
			next = set(1)
		case 1:
			// the right fork: neither the right neighbour's left fork nor held as ours
			if p.phil(v, i+1) != 0 {
				continue
			}
			next = set(2)
		case 2:
			next = set(0)
		}
		emit(3*i+int(p.phil(v, i)), &next)
	}
}

// AppendFingerprint is the state's 2n bits, little-endian.
func (p Model) AppendFingerprint(dst []byte, s *uint64) []byte {
	for i := 0; i < (2*p.N+7)/8; i++ {
		dst = append(dst, byte(*s>>(8*i)))
	}
	return dst
}

// IsFault: philosophers have no faults.
func (Model) IsFault(int) bool { return false }

// Finished: philosophers never stop, so a state without a step is a deadlock.
func (Model) Finished(*uint64) bool { return false }

// Reachable counts, without a checker, the assignments in which no fork is
// held twice: the reachable states (every one is reachable).
func Reachable(n int) int {
	// A transfer matrix around the ring: philosopher i's state constrains only
	// fork i+1 together with philosopher i+1's state.
	ok := func(a, b int) bool { // a: philosopher i, b: philosopher i+1; fork i+1 held at most once
		holders := 0
		if a == 2 {
			holders++
		}
		if b >= 1 {
			holders++
		}
		return holders <= 1
	}
	total := 0
	for first := 0; first < 3; first++ {
		ways := [3]int{}
		ways[first] = 1
		for i := 1; i < n; i++ {
			var next [3]int
			for a := 0; a < 3; a++ {
				for b := 0; b < 3; b++ {
					if ok(a, b) {
						next[b] += ways[a]
					}
				}
			}
			ways = next
		}
		for last := 0; last < 3; last++ {
			if ok(last, first) {
				total += ways[last]
			}
		}
	}
	return total
}

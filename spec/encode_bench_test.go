package spec

import (
	"syscall"
	"testing"
	"time"
)

// cpuTime is this process's user and system time: on a shared machine, CPU
// per operation is steadier than wall time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func cpuPerOp(b *testing.B, start time.Duration) {
	b.ReportMetric(float64(cpuTime()-start)/float64(b.N), "cpu-ns/op")
}

// BenchmarkAppendState encodes a few hundred states, which stay in cache as
// the state the checker has just generated does.
func BenchmarkAppendState(b *testing.B) {
	m, states := reachable(b, NewConfig(3, 4, 2), 5000)
	states = states[len(states)-300:]
	var buf []byte
	b.ResetTimer()
	start := cpuTime()
	defer cpuPerOp(b, start)
	for i := 0; b.Loop(); i++ {
		buf = m.AppendState(buf[:0], &states[i%len(states)])
	}
}

func BenchmarkDecodeState(b *testing.B) {
	m, states := reachable(b, NewConfig(3, 4, 2), 5000)
	var encs [][]byte
	for i := range states {
		encs = append(encs, m.AppendState(nil, &states[i]))
	}
	var s State
	b.ResetTimer()
	start := cpuTime()
	defer cpuPerOp(b, start)
	for i := 0; b.Loop(); i++ {
		if err := m.DecodeState(encs[i%len(encs)], &s); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkAppendFingerprint, like BenchmarkAppendState, works on states in
// cache: the checker fingerprints the successor it has just generated.
func BenchmarkAppendFingerprint(b *testing.B) {
	m, states := reachable(b, NewConfig(3, 4, 2), 5000)
	states = states[len(states)-300:]
	var buf []byte
	b.ResetTimer()
	start := cpuTime()
	defer cpuPerOp(b, start)
	for i := 0; b.Loop(); i++ {
		buf = m.AppendFingerprint(buf[:0], &states[i%len(states)])
	}
}

// BenchmarkCopyState compares copyState with the struct assignment it
// replaces (the checker copies a State for every transition).
func BenchmarkCopyState(b *testing.B) {
	var dst State
	src := (&Model{}).Initial()[0]
	b.Run("copyState", func(b *testing.B) {
		for b.Loop() {
			copyState(&dst, &src)
		}
	})
	b.Run("assignment", func(b *testing.B) {
		for b.Loop() {
			dst = src
		}
	})
}

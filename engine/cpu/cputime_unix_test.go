//go:build unix

package cpu

import (
	"syscall"
	"time"
)

// cpuTime is the CPU time (user + system) this process has used: on a
// machine shared with other work, rates per CPU-second are what a
// benchmark of one thread can compare.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

//go:build !unix

package cpu

import "time"

var start = time.Now()

// cpuTime is wall time where getrusage is not available.
func cpuTime() time.Duration { return time.Since(start) }

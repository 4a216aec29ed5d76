//go:build cudaemu && !cuda

package cuda

import "testing"

// openTest opens the backend under test: the emulator.
func openTest(testing.TB) *Backend { return NewEmulated() }

func deviceName() string { return "emulator" }

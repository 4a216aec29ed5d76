//go:build cuda

package cuda

import "gorgonia.org/cu"

// Devices reports how many CUDA devices the driver sees.
func Devices() (int, error) { return cu.NumDevices() }

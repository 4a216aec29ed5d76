//go:build !linux

package cpu

// adviseHugePages does nothing outside Linux (see hugepages_linux.go).
func adviseHugePages(...[]float32) (advised, collapsed int) { return 0, 0 }

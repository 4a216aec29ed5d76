package checker

// prefetch asks the CPU to bring the cache line at addr into its caches,
// without waiting for it: it never faults, whatever addr is.
//
//go:noescape
func prefetch(addr uintptr)

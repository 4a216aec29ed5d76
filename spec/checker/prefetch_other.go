//go:build !amd64

package checker

// prefetch does nothing where the checker has no prefetch instruction: the
// lookups it would have hastened wait for memory instead.
func prefetch(addr uintptr) {}

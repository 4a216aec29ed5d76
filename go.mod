module github.com/kvhandoff/kvhandoff

go 1.26

require (
	github.com/zeebo/xxh3 v1.1.0
	pgregory.net/rapid v1.3.0
)

require (
	github.com/anishathalye/porcupine v1.3.1 // indirect
	github.com/klauspost/cpuid/v2 v2.2.10 // indirect
	golang.org/x/sys v0.30.0 // indirect
)

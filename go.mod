module github.com/kvhandoff/kvhandoff

go 1.26

require (
	github.com/Mellanox/rdmamap v1.1.0
	github.com/anishathalye/porcupine v1.3.1
	github.com/zeebo/xxh3 v1.1.0
	gopkg.in/yaml.v3 v3.0.1
	gorgonia.org/cu v0.9.6
	pgregory.net/rapid v1.3.0
)

require (
	github.com/google/uuid v1.1.1 // indirect
	github.com/klauspost/cpuid/v2 v2.2.10 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	github.com/vishvananda/netlink v1.1.0 // indirect
	github.com/vishvananda/netns v0.0.0-20191106174202-0a2b9b5464df // indirect
	golang.org/x/sys v0.30.0 // indirect
)

//go:build cuda

package main

import (
	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/cuda"
)

// A build with -tags cuda offers --backend cuda: the first GPU.
func init() {
	engineBackends["cuda"] = func() (backend.Backend, error) { return cuda.New(0) }
}

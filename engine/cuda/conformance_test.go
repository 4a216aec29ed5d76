//go:build cuda || cudaemu

package cuda

import (
	"testing"

	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/backend/backendtest"
)

// The CUDA backend passes the backends' conformance suite (on the GPU with -tags cuda, on the
// emulator with -tags cudaemu).
func TestCUDABackendConforms(t *testing.T) {
	backendtest.Conformance(t, func() (backend.Backend, error) { return openTest(t), nil })
}

package backendtest

import (
	"testing"

	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
)

// The CPU backend passes its own suite (the suite's stale-page checks are
// meaningful on it; the comparisons are the identity).
func TestCPUBackendConforms(t *testing.T) {
	Conformance(t, func() (backend.Backend, error) { return cpu.New(), nil })
}

package measure

import (
	"bytes"

	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// roundTrip writes m as a checkpoint and reads it back, so what is measured
// is what a checkpoint file holds.
func roundTrip(m *llama.Model) (*llama.Model, error) {
	var buf bytes.Buffer
	if err := llama.WriteCheckpoint(&buf, m); err != nil {
		return nil, err
	}
	return llama.ReadCheckpoint(bytes.NewReader(buf.Bytes()), int64(buf.Len()))
}

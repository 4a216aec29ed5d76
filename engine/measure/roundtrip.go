package measure

import (
	"bytes"

	"github.com/kvhandoff/kvhandoff/engine/model"
)

// roundTrip writes m as a checkpoint and reads it back, so what is measured
// is what a checkpoint file holds.
func roundTrip(m *model.Model) (*model.Model, error) {
	var buf bytes.Buffer
	if err := model.WriteCheckpoint(&buf, m); err != nil {
		return nil, err
	}
	return model.ReadCheckpoint(bytes.NewReader(buf.Bytes()), int64(buf.Len()))
}

//go:build verbs

package transfer

import (
	"os"
	"testing"

	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/verbs"
)

// The handoff tests run over verbs too: prefill and decode each open the
// device, as two nodes would. Without a device they skip, unless
// KVH_VERBS_REQUIRED is set (the Soft-RoCE VM sets it).
func init() {
	providers["verbs"] = func(t *testing.T) (rdma.Device, rdma.Device) {
		open := func() rdma.Device {
			d, err := verbs.Open(os.Getenv("KVH_VERBS_DEVICE"))
			if err != nil {
				if os.Getenv("KVH_VERBS_REQUIRED") != "" {
					t.Fatal(err)
				}
				t.Skip(err)
			}
			t.Cleanup(func() { d.Close() })
			return d
		}
		return open(), open()
	}
}

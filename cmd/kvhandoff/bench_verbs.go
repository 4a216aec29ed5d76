//go:build verbs

package main

import (
	"os"

	"github.com/kvhandoff/kvhandoff/rdma/throughput"
	"github.com/kvhandoff/kvhandoff/rdma/verbs"
)

// The verbs provider, measured against perftest's ib_write_bw on the same
// device in the same run. KVH_VERBS_DEVICE names the device (default: the first).
func init() {
	benchProviders["verbs"] = func(size, total, reps int) (float64, float64, string, error) {
		a, err := verbs.Open(os.Getenv("KVH_VERBS_DEVICE"))
		if err != nil {
			return 0, 0, "", err
		}
		defer a.Close()
		b, err := verbs.Open(a.Name())
		if err != nil {
			return 0, 0, "", err
		}
		defer b.Close()
		p, _, err := throughput.Write(a, b, size, total, reps)
		if err != nil {
			return 0, 0, "", err
		}
		base, err := verbs.IBWriteBW(a, size, total/size)
		return p, base, "ib_write_bw", err
	}
}

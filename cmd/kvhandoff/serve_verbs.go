//go:build verbs

package main

import (
	"crypto/tls"
	"log/slog"

	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/verbs"
)

// serve --provider verbs: the node's queue pairs on a real RDMA device,
// named by --rdma (empty or an address-like default: the first device).
// Authentication stays on the control connection that sets each queue pair
// up (transfer.Dial and Serve, mutual TLS); the device itself has none.
func init() {
	providers["verbs"] = func(_, device string, _ *tls.Config, _ bool, log *slog.Logger) (rdma.Device, error) {
		if device == "127.0.0.1:0" {
			device = ""
		}
		d, err := verbs.Open(device)
		if err == nil {
			log.Info("serve: verbs device", "device", d.Name())
		}
		return d, err
	}
}

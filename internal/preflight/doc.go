// Package preflight checks a deployment's description before it serves: the
// check the 2026 incident lacked (docs/incident.md). A deployment is a context
// length and its nodes, each with its role, KV pool, page size and model, as
// node.Member advertises them in the registry.
//
// Check names every problem at once, each as a Problem with the nodes it
// concerns:
//
//   - a prefill or decode pool that holds fewer tokens than the context length:
//     a prompt between the two passes a router that checks the context and
//     reaches a node that cannot hold it (the incident: a 1,048,576-token
//     context over a 681,280-token prefill pool);
//   - a pair of nodes whose page size (tokens or bytes) differs: a Grant names
//     pages of the decode node's geometry, which the prefill node's pages must
//     match byte for byte;
//   - a pair of nodes whose model differs: KV of one model read by another is
//     garbage served with success;
//   - a deployment without a prefill or without a decode node.
//
// Devices lists the machine's RDMA devices, their ports and each port's state
// through rdmamap (sysfs), for the operator to read beside the verdict.
//
// Usage:
//
//	d, _ := preflight.Parse(data)       // YAML or JSON
//	if problems := preflight.Check(d); len(problems) > 0 { … refuse to start … }
package preflight

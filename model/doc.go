// Package model checks the protocol implementation (package protocol) against
// the properties of the executable spec (package spec, docs/spec.md).
//
// Simulate is deterministic simulation. One seed is one run: a workload of
// requests of random lengths (some over the prefill pool, as in the incident)
// on prefill nodes and a decode node joined by in-memory queue pairs, with
// WRITEs and SENDs placed in order per queue pair but at random points, and
// faults: client cancels that reach the two legs in either order, WRITEs
// corrupted in transit, queue-pair cuts, prefill crashes that the router
// detects later, and clock jumps past every timeout. After every step it
// checks the spec's safety properties on the real state. NoForeignWrite is
// checked at every placement, Isolation and HonestOutcome at every read,
// Conservation on both pools, and every node reports every request exactly once.
// Once faults stop, the run drains, and it checks Termination and NoLeak. The
// same seed replays the same run, step for step.
//
// Still to come (issue 3): the refinement-mapped harness that runs the
// implementation and the spec side by side under rapid.
package model

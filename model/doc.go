// Package model checks the protocol implementation (package protocol) against
// the properties of the executable spec (package spec, docs/spec.md).
//
// Simulate is deterministic simulation. One seed is one run: a workload of
// requests of random lengths (some over the prefill pool, as in the incident)
// through a protocol.Router to prefill nodes and a decode node joined by
// in-memory queue pairs (a protocoltest.Network, the harness every test of
// the module shares), with each request's KV computed a page at a time
// (a streaming prefill: Sender.ComputedPages after each page, so WRITEs
// interleave with the computation), WRITEs and SENDs placed in order per
// queue pair but at random points, and
// faults: client cancels that reach the two legs in either order, WRITEs
// corrupted in transit, queue-pair cuts, prefill crashes that the router
// detects later, restarts of a crashed prefill node under a new incarnation
// (before or after the router detected the crash), with
// SimConfig.DecodeRestarts (kvhandoff sim --decode-restarts) a decode node
// crashing and coming back at once under a new incarnation (a fresh
// Receiver over the same pages; the router and every prefill node told, each
// cutting its queue pair to the old incarnation before it holds one to the
// new), and clock jumps past every timeout. After every step it
// checks the spec's safety properties on the real state. NoForeignWrite is
// checked at every placement, Isolation and HonestOutcome at every read,
// Conservation on both pools, and every node reports every request exactly once.
// Once faults stop, the run drains, and it checks Termination and NoLeak. The
// same seed replays the same run, step for step.
//
// The same world also runs as a rapid state machine (rapid_test.go). Rapid
// draws the prompts, every choice and every fault, shrinks a failure to a short
// event sequence, and saves it in a failfile that replays it. FuzzImplementation
// is the same property as a go test -fuzz target.
//
// RunSeeds streams many seeds: each result is folded in as it completes, and
// only failures are kept (the smallest failing seed with its trace).
//
// Refinement holds the implementation to the spec's transitions: it runs the
// Router, a Sender per prefill node and a Receiver per decode node of the
// spec's deployment (up to two of each, a queue pair per pair, crashes,
// restarts of either role under a new incarnation, either node's lease,
// a decode node's partition and its data plane's cut, static peers with
// RC's retry limit and the router's leg cancels, and the decode nodes'
// prefix cache: each cached page's key, pins, LRU rank
// and purge, each request's prefix hit) beside package spec, one spec
// action at a time (the spec's Compute is the engine computing the
// request's next page and Sender.ComputedPages), maps
// the implementation's state into the spec's terms after every step (View,
// SpecView) and fails on any difference; the spec's properties are then checked
// on the spec state the mapping has shown equal. refine_test.go drives it with
// seeded walks, as a rapid state machine and as a fuzz target, and shows it
// failing for every implementation switch, and for a decode restart with a
// defense off (docs/protocol.md, "Refinement").
package model

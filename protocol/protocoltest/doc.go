// Package protocoltest is the shared test harness for package protocol, in
// the style of etcd raft's rafttest: a whole deployment in memory (a
// protocol.Router, prefill nodes with their Senders and source pages, decode
// nodes with their Receivers and page memory, a reliable-connected queue pair
// between every prefill and every decode node, and in-order queues from the
// router to each node), driven one event at a time.
//
// A Network carries every effect and checks the spec's properties
// (docs/spec.md) as it goes: NoForeignWrite at every placement, Isolation and
// HonestOutcome at every read, Conservation after every event, one outcome
// per node and per client; Quiescent checks Termination and NoLeak. Each
// event is a method (Submit, DeliverRouter, Compute, Deliver, DeliverBack,
// Acquire, Finish, Cancel, Advance, Cut, Crash, Detect, CorruptNext), so a
// test can stage any race by hand; Events lists what may happen next, so a
// seeded scheduler (kvhandoff sim) or rapid can choose. With Logf set, every
// event writes what happened, one line per effect.
//
// RunScenarios runs datadriven files of those events, one command per line,
// with the output each block must produce after "----" (protocol/testdata).
// Memory and Pattern are the page memory and the recognisable KV that every
// harness in the module uses.
package protocoltest

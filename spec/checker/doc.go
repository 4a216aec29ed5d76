// Package checker is a bounded explicit-state model checker, generic over a small
// model interface so that it can check any finite model, not only kvhandoff's spec.
//
// A model gives its initial states, the actions enabled in a state with the state
// each leads to, a canonical fingerprint of a state, which actions are faults, and
// which states are legitimate end states. The checker explores every reachable
// state breadth-first, so the first violation it finds has a shortest trace:
//
//   - Safety: every [Invariant] is evaluated in every reachable state.
//   - Deadlock: a state with no enabled action that the model does not call
//     finished is a violation of the pseudo-property "Deadlock".
//   - Liveness: for every [Goal], the checker verifies that from every reachable
//     state a goal state is reachable using protocol (non-fault) actions only
//     (CTL: AG EF goal over the protocol transitions). On a finite graph this is
//     equivalent to "every execution reaches the goal" under strong fairness of
//     protocol transitions once faults stop, because an infinite fair execution
//     revisits some state infinitely often and must then take every protocol
//     transition out of it. The checker also reports whether the protocol
//     transition graph is acyclic; if it is, every execution after the last
//     fault is finite and the goal is reached with no fairness assumption.
//
// Symmetry reduction is the model's business: AppendFingerprint must return the
// same bytes for states that are equivalent under the symmetries the model
// declares (for example interchangeable pages).
//
// Memory: for each visited state the checker keeps a 128-bit fingerprint, the
// parent's number and which of the parent's successors (its index in emission
// order) led to it: 22 bytes, in chunked arrays that grow without copying. An
// open-addressing index of state numbers, in 64 shards that grow together,
// adds 5 to 11 bytes. For liveness it
// keeps the protocol transitions as a compressed sparse row graph (4 bytes per
// state and per protocol transition) and a bit per state per goal; the
// analysis at the end builds the reverse graph (4 more per state and per
// transition) after dropping the index, and a byte per state for the goals
// it reaches. Traces are rebuilt by replaying the
// recorded successor choices from an initial state, checking every
// fingerprint, which yields concrete (not canonicalised) states and detects a
// model that is not deterministic; a model that implements [Selector] builds
// only the successor each step takes. The only whole states kept are the BFS
// frontier's: a model that implements [Encoder] has them held as compact
// encodings and spilled to a file past [Options].FrontierMemory.
// [Options].MaxMemory bounds the live heap, measured with runtime/metrics; past
// it, and past [Options].MaxStates, Check returns a [LimitError] with how far
// it got. While explorations run, the collector's GOGC is 25 once the heap
// passes 256 MiB: the checker's memory is pointer-free arrays that cost the
// collector little, and the default of 100 let garbage double the peak.
// Below that it is 100: a small heap at 25 was collected every few megabytes.
//
// Speed: the model hands each successor to the checker by pointer, valid
// during the call only; the model's fingerprint is computed once per
// transition and its encoding once per new state, and those two dominate
// the checker's own costs. A successor not among its block's candidates is
// looked up in the visited set only once the next such one has been
// fingerprinted (or the block ends, or a Builder asks for the state it
// waits in), with its index slot prefetched
// meanwhile, so that the lookup's cache miss overlaps that work: the
// successor waits where it was built, if the model is a [Builder] (it
// builds each successor in one of two states the worker hands out in
// turn), or else as a copy (made by the model's CopyState if it
// implements [StateCopier]).
//
// Exploration is parallel (one worker per core) and deterministic, with no
// serial merge: a level's frontier is cut into blocks of 256 states, and a
// wave of blocks goes through three phases, each a set of independent tasks
// the workers share: expand the blocks (reading the visited set only), then
// keep the first occurrence of each new state in the wave, one shard of the
// visited set's index at a time, then record, index and enqueue the new
// states, by block and by shard. New states are numbered in the order a
// sequential search numbers them (a serial loop over an array), so two runs
// report the same counterexample whatever the core count. The liveness
// analysis runs its cycle check and one backward search for all the goals
// (up to 8) at once.
//
// Bitstate mode ([Options].Bitstate, SPIN's supertrace) replaces the visited
// set by a bit array of a fixed size, for bounds too large to store: a state
// sets a few bits, and a new state whose bits are all set is missed;
// [BitstateStats] estimates how many. Frontier states then carry their
// paths, from which traces are replayed. [Options].Shuffle gives a swarm
// member a search order of its own.
//
// [Simulate] explores by seeded random walks instead, for bounds too large to
// exhaust; a walk replays exactly from its seed.
package checker

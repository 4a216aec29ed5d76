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
// declares (for example interchangeable pages). The checker stores only 128-bit
// fingerprints of visited states plus a parent index and an action per state, so
// it can hold millions of states; traces are rebuilt by replaying the recorded
// actions from an initial state, which yields concrete (not canonicalised) states.
//
// Exploration is parallel (one worker per core) and deterministic: successors of a
// BFS level are generated concurrently, then merged in a fixed order, so two runs
// report the same counterexample.
//
// [Simulate] explores by seeded random walks instead, for bounds too large to
// exhaust; a walk replays exactly from its seed.
package checker

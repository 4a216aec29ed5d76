// Package linearizability checks that the concurrent API engines call,
// protocol.SharedReceiver, behaves as if each call happened at one instant in
// an order the protocol's sequential semantics allow. It records histories
// from real concurrent runs and checks them with porcupine.
//
// The model. Operations are Bootstrap and Done (delivered by the transport's
// poller), Cancel (the router), Status, Acquire and Finish (decode workers),
// and Cut (a queue pair fenced: a fault). Their sequential semantics per
// request are the receiver's: a small state machine over none, tombstone,
// reserved, ready, reading, quarantine, finished and closed (Step below). The
// receiver handles requests independently, so a history is linearizable iff
// each request's sub-history is, and the model partitions by request. A Cut
// touches every request on the queue pair, so it is copied into each
// request's partition with the same call and return times. That is sound
// because its effect on each request depends only on that request's state.
//
// Unknown outcomes. With faults on, some Cancels are fire-and-forget: the
// caller does not wait, so their outcome is unknown. As in etcd's robustness
// tests, such an operation is recorded as returning at infinity (it may take
// effect at any point after its call, or never), and its step allows both
// outcomes: applied and not applied. A history is illegal only if no choice
// explains it.
//
// Recording. Each client goroutine stamps call and return with the monotonic
// clock (time.Since of one start instant). A call's interval encloses its
// critical section, so the recorded intervals are sound.
//
// On an illegal history the checker writes porcupine's HTML visualization,
// annotated with the injected faults, and returns its path.
package linearizability

// Package spec is the executable specification of kvhandoff's prefill→decode
// page handoff (docs/protocol.md#the-happy-path): the whole system as one deterministic state
// machine over a global [State], small enough to read next to the design.
//
// # What is modelled
//
// A router, one prefill node (the sender) and one decode node (the receiver),
// and a few requests with fixed prompt lengths ([Config]). The default
// configuration ([DefaultConfig]) is the 2026 incident's deployment in
// miniature: the router checks only the advertised context length, which is
// larger than the prefill pool, so one request passes the router and must be
// rejected by the prefill node's own intake.
//
// The state holds, per request, the client's outcome, the sender's record
// (phase, source pages, the grant it admitted, WRITEs posted and completed)
// and the receiver's record (phase, the pages and epochs it granted, its slot);
// the decode pool (each page's epoch, owner, quarantine flag, the KV it holds
// and its tag record); the prefill pool; and four FIFO channels: router→prefill,
// router→decode, and the queue pair in both directions. The prefill→decode
// direction carries both RDMA WRITEs and SENDs (Bootstrap, Done, AbortAck) in
// one FIFO, because reliable-connected queue pairs place them in order.
//
// KV is represented by what it is, not by bytes: a [Label] says "page i of
// request r" (or an earlier tenant's data, which every page holds at the start:
// pages are never zeroed). A checksum is the label it was computed over, so a
// checksum matches exactly when the payload is what the sender meant to write.
// WRITEs read their source page when they are placed, as a NIC does, so a
// source page reused early ships its new content.
//
// # The usage loop
//
// [New] validates a configuration. [Model.Initial] gives the initial state;
// [Model.Successors] calls back once per enabled [Action] with the next state
// (a scratch state, valid during the call: copy it to keep it, never change
// it; for a step that changes nothing it is the state itself);
// [Model.AppendFingerprint] gives a canonical encoding for the checker, with
// symmetry reduction (requests of equal length are interchangeable, so are
// the nodes of one role, and so are decode pages: a page's identity is its
// content and who refers to it);
// [Invariants] and [Goals] are the properties; [Model.Describe] explains a step
// for a trace. The model checker in package checker drives this loop; package
// explore binds the two. The spec has no goroutines, clocks or I/O.
// [Model.WithCoverage] counts every action and guarded [Branch] a model takes
// into a [Coverage], so a caller can see which defenses its bounds exercise.
//
// # Actions
//
// Protocol actions: Submit (router intake), PrefillRecv (prefill takes a router
// message: intake or abort), PrefillRecvQP (prefill takes a Grant or an Abort
// from decode), DecodeRecv (decode takes a router message: Abort, or PeerFailed,
// on which it cuts the queue pair), DecodeRecvQP (the head of the queue pair is
// placed or delivered: a WRITE lands, or decode handles Bootstrap, Done or
// AbortAck), PostWrite, DecodeRead (attend over a verified request's pages and
// reply), DetectCrash (the router notices the dead prefill node) and Compute
// (the prefill node computes the next page of a request's KV: the intake
// takes the source pages and sends the Bootstrap, and the pages are computed
// one at a time while the Grant and the WRITEs come and go; a WRITE waits
// for its page, and the computation stops when the leg ends; stream.go,
// docs/spec.md#streaming-prefill).
//
// Faults, each with a budget in [Config.Faults] and all together bounded by
// [Config.MaxFaults]: Cancel (client disconnect at any time), Crash (the prefill
// node dies; WRITEs already in the network can still land), Timeout (decode's
// timer for a reserved request fires), Cut (the queue pair breaks and flushes),
// and two variants of PostWrite: Late (the WRITE stays in the network and is
// placed at any later point, still in order) and Corrupt (its payload is
// damaged in transit; with [Config.Damage], instead one field of its tag
// record, or, as the action CorruptSend, a count of a Done or a Grant), and
// Rogue (RogueWrite: a peer WRITEs any page with any key it has held, which
// lands only if the key is live and covers the page; RogueBootstrap: a
// Bootstrap for a request nobody dispatched, which decode refuses; keys.go).
// With the topology's faults, LeaseLost (a live node's registry lease
// expires), Restart, Partition (a live decode node cut off from
// everything, silently, until its lease expires and the router loses it;
// partition.go) and DataplaneCut (every queue pair to a live decode node
// breaks for good while the registry and the router still list it;
// dataplane.go). With [Config.StaticPeers] (static.go) the registry loses
// no node, so no prefill node fences one: the router cancels the prefill
// leg of every request that fails, and RetryExceeded (a protocol step,
// RC's bounded retry) breaks prefill's end of a queue pair holding work
// that a partitioned decode node will never acknowledge.
// Without the Late fault a WRITE posted on an empty queue
// pair is placed at once; that keeps the state space small without losing any
// interleaving that matters, since every in-flight WRITE a bug needs can be
// made late.
//
// # Prefix reuse
//
// With [Config.PrefixCache] a decode node keeps verified full prompt pages
// after their request, keyed by (scope, chain): a later request of the same
// tenant scope whose prompt starts with the same pages pins them, and only
// the pages past them are granted and written ([PrefixBounds], prefix.go,
// docs/spec.md#prefix-reuse). Off by default: every earlier run is unchanged.
//
// # Switches
//
// The bugs of the catalogue
// (docs/spec.md#the-switches-and-their-counterexamples), from the incident
// and the public engines' issue trackers (abort-frees-source, vLLM #21570;
// checksum-hangs, SGLang #39729; peer-by-name, Mooncake #2762 and vLLM
// #49238, among them), and the enforcement switches of remote access per
// grant (pool-wide-key, verify-before-revoke, unticketed-bootstrap), and
// those of prefix reuse (scope-dropped, SGLang #37160; client-scope,
// evict-pinned, prefix-count-mismatch, write-shared), and those of
// streaming prefill (write-uncomputed, free-computing), are
// [Switch] values with the catalogue's names; [Config.Bugs] turns them on. Each
// changes exactly the branch the catalogue describes (grep the switch's
// constant to find it). docs/spec.md tells the story of each one's
// counterexample, holds the defense matrix, and says for each report it does
// not model which rule of the protocol rules it out.
//
// # Properties
//
// Safety, checked in every reachable state: Isolation, HonestOutcome,
// NoForeignWrite, RejectedStaysOut, Conservation, OutcomeFinal (an outcome the
// client saw never changes), ReadAsVerified (a verified page does not change
// before it is freed), Ticketed (decode holds pages only for a dispatched
// request), with the prefix cache NoCrossScopeRead, PinnedNeverReallocated
// and PrefixExact (prefix.go), NoSpuriousFailure (the progress property: without
// faults, a request fails only for a reason the state gives) and WithinBounds (a
// modelling limit: a queue overflowed its fixed bound). The two that judge a step
// by the state before it read a [Ghost] that Successors records around every
// step, outside the step functions. Liveness: Termination and NoLeak (pages,
// slots and every record given back at quiescence), checked as "from every
// reachable state, a goal state is reachable by protocol actions alone" — see
// docs/spec.md for why that is the right formulation for this bounded model.
package spec

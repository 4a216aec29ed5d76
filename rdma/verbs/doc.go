// Package verbs is the rdma provider over real RDMA verbs: libibverbs through
// cgo, for InfiniBand and RoCE devices, Soft-RoCE (rxe) included. It is built
// only with the build tag verbs (go build -tags verbs), which needs
// libibverbs-dev; without the tag this package is empty, so a plain
// go build ./... needs no C library.
//
// Open opens a device by name (Devices lists them, through
// github.com/Mellanox/rdmamap); its port must be ACTIVE. The GID used is found
// by scanning the port's GID table for an IPv4-mapped entry (::ffff:a.b.c.d,
// RoCE v2), never by a fixed index. Memory from Alloc is mmap'd outside the Go
// heap, so the collector never moves what the NIC writes; Register takes
// memory the caller guarantees the same for. Queue pairs are reliable
// connected, taken through INIT, RTR and RTS by Connect with the peer's
// ConnInfo (QPN, GID, LID, PSN) exchanged out of band.
//
// Completion queues are busy-polled for a few microseconds, then wait on a
// completion channel, so an idle waiter costs no CPU. Every work request is
// signalled; completions carry the caller's work request IDs and opcodes (the
// provider keeps them, since an error completion's opcode is undefined in
// verbs). Statuses map to package rdma's: remote access, local length, flush,
// RNR retries exceeded (ReceiverNotReady), transport retries exceeded and
// anything else (TransportError).
//
// Memory windows (rdma.MemoryWindow) are the NIC's type-2 windows:
// ibv_alloc_mw(IBV_MW_TYPE_2), bound by IBV_WR_BIND_MW and invalidated by
// IBV_WR_LOCAL_INV on the queue pair whose peer may use them, Close is
// ibv_dealloc_mw. A window's key is the NIC's index (upper 24 bits) and 8
// consumer bits the provider draws from crypto/rand on every bind, different
// from the key before: 8 bits are all the randomness verbs allows.
//
// Fault hooks (rdma.Faults) are software: Pause holds work requests in the
// provider before they reach the NIC, Resume posts them in order, and
// CorruptNext sends the next WRITE from a damaged copy of its payload. ToError
// moves the queue pair to the error state; the NIC flushes what it holds and
// the provider flushes what it held back.
//
// Semantics differ from the pure-Go providers in one way: receive-not-ready
// is retried by the NIC (rnr_retry 7, unbounded) rather than failing at once,
// because on a real NIC a receive buffer reposted a moment late is normal.
// rdma/verbs/vmtest/run.sh runs the conformance suite, the handoff tests and
// the serve topology (a router, two prefill and two decode processes, every
// process traced and the traces replayed in the spec by kvhandoff trace check,
// docs/trace.md) over this provider on Soft-RoCE inside QEMU.
package verbs

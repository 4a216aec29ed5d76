// Package rdma is the transport kvhandoff's protocol needs, named as RDMA
// people expect: a device, protection domains, memory regions with local and
// remote keys, reliable-connected queue pairs connected by an out-of-band
// exchange of their connection info, and completion queues. Work requests are
// WRITE, WRITE WITH IMMEDIATE, SEND and RECV; completions carry a status that
// includes flush errors; moving a queue pair to the error state is the fence.
//
// Providers implement these interfaces: package rdma/inproc (pure Go, one
// process), package rdma/socket (pure Go, between processes over a stream
// socket) and package rdma/verbs (libibverbs through cgo, build tag verbs).
// Package rdma/rdmatest is the conformance suite every provider passes, and
// the same handoff tests run over each (package transfer).
//
// The semantics a provider guarantees, on one queue pair, are those of an RC
// queue pair on hardware:
//   - work requests are executed in the order posted; a WRITE is placed before
//     a later SEND on the same queue pair is delivered;
//   - a successful completion means the operation has been placed (a WRITE's
//     bytes are in the remote memory region);
//   - a WRITE with a wrong remote key, outside the region or into a region
//     without remote write access fails with RemoteAccessError, and breaks the
//     queue pair, as on hardware: every later work request is flushed;
//   - a memory window (type 2) bound on a queue pair to a range of a region
//     with WindowBind access lets the peer of that queue pair, and nobody
//     else, WRITE that range under the window's own key; once the window's
//     invalidate (OpInvalidate, or Close) has completed, a WRITE with that key
//     fails with RemoteAccessError and breaks only the queue pair it came on,
//     and nothing of a WRITE under it lands any more (one cut in the middle
//     may have placed its first part, as a fence would leave it);
//   - ToError flushes every outstanding work request (send and receive) with
//     FlushError completions. On the responder, the queue pair whose memory is
//     written, nothing lands after ToError returns: that is the fence a
//     receiver relies on before it reuses a page. On the requester, work
//     requests already on the wire may still be placed, as on hardware, so a
//     fence is always taken on the responder's queue pair.
//
// Memory a peer writes must never move. ProtectionDomain.Alloc returns memory
// the provider owns (for verbs, mmap'd memory outside the Go heap);
// ProtectionDomain.Register takes memory the caller owns, which for verbs must
// also lie outside the Go heap.
package rdma

import (
	"errors"
	"fmt"
	"time"
)

// Access says what a memory region allows.
type Access uint8

// Access flags.
const (
	LocalWrite Access = 1 << iota
	RemoteWrite
	RemoteRead
	// WindowBind lets memory windows be bound to the region: a region that
	// peers write only through windows has it and no RemoteWrite, so its own
	// key opens nothing.
	WindowBind
)

// MemoryRegion is registered memory: the provider never moves it.
type MemoryRegion interface {
	Addr() uint64 // the address remote peers name in WRITEs
	Len() int
	LKey() uint32
	RKey() uint32
	Bytes() []byte // the registered memory itself
}

// Opcode is a work request's or completion's operation.
type Opcode uint8

// The operations.
const (
	OpWrite Opcode = iota + 1
	OpWriteImm
	OpSend
	OpRecv
	OpRecvImm // a receive completion consumed by a WRITE WITH IMMEDIATE
	// OpBind binds WorkRequest.Window to the range Local names (a region with
	// WindowBind access), for remote WRITE by the queue pair's peer only, under
	// a fresh key (the window's RKey once PostSend returns). Local: no bytes move.
	OpBind
	// OpInvalidate invalidates WorkRequest.Window's binding (a local
	// invalidate): once it has completed, its key opens nothing.
	OpInvalidate
)

func (o Opcode) String() string {
	switch o {
	case OpWrite:
		return "WRITE"
	case OpWriteImm:
		return "WRITE_WITH_IMM"
	case OpSend:
		return "SEND"
	case OpRecv:
		return "RECV"
	case OpRecvImm:
		return "RECV_RDMA_WITH_IMM"
	case OpBind:
		return "BIND_MW"
	case OpInvalidate:
		return "LOCAL_INV"
	}
	return fmt.Sprintf("Opcode(%d)", o)
}

// Status is a completion's status.
type Status uint8

// The statuses; anything but Success means the queue pair is in the error state.
const (
	Success Status = iota
	RemoteAccessError
	LocalLengthError
	FlushError
	ReceiverNotReady
	TransportError // retries exhausted, or another error of the connection
)

func (s Status) String() string {
	if int(s) < len(statusNames) {
		return statusNames[s]
	}
	return fmt.Sprintf("Status(%d)", s)
}

var statusNames = [...]string{"success", "remote access error", "local length error", "flushed", "receiver not ready", "transport error"}

// SGE is one local buffer of a work request: part of a registered region.
type SGE struct {
	MR     MemoryRegion
	Offset int
	Length int
}

// WorkRequest is posted on a queue pair. Remote fields apply to WRITEs.
type WorkRequest struct {
	ID         uint64
	Op         Opcode
	Local      SGE
	RemoteAddr uint64
	RKey       uint32
	Imm        uint32 // OpWriteImm, OpSend (when HasImm)
	HasImm     bool
	Window     MemoryWindow // OpBind, OpInvalidate
}

// MemoryWindow is a type-2 memory window: a remote key for a byte range of a
// registered region, bound and invalidated by work requests on a queue pair
// (OpBind, OpInvalidate), usable only by the peer of the queue pair it is
// bound on, for remote WRITE only. Its address space is its region's: a WRITE
// names the region's addresses, with the window's key.
type MemoryWindow interface {
	// RKey is the key of the window's latest bind: fresh random key bits on
	// every bind (the software providers draw all 32 from crypto/rand; verbs
	// the 8 bits the consumer owns), so a key the window had before opens
	// nothing once the window is invalidated, even after it is bound again.
	RKey() uint32
	// Close invalidates the window at once, whatever the state of the queue
	// pair it is bound on (a broken one cannot execute OpInvalidate), and
	// frees it: when Close returns, its key opens nothing.
	Close() error
}

// UncheckedWindowRanges is implemented by a protection domain whose windows
// may open more than their range: WindowRangesUnchecked reports true where a
// WRITE under a window's key is checked against the window's region only
// (Soft-RoCE, rxe, as of Linux 6.1), or may be: verbs reports true for every
// device whose driver is not known to check ranges. A user that needs a window's range
// enforced there binds it on a region registered over exactly that range.
type UncheckedWindowRanges interface {
	WindowRangesUnchecked() bool
}

// Deregistrar is a protection domain that deregisters one of its regions
// before the device closes (every provider's; without it a region lives as
// long as its device). A region with a window still bound on it is refused
// (ErrBadRequest); the caller has no WRITE under the region's own key in
// flight. Its key never opens anything again.
type Deregistrar interface {
	Deregister(MemoryRegion) error
}

// WindowDomain is a protection domain that has memory windows (every
// provider's: inproc, socket, verbs).
type WindowDomain interface {
	// AllocWindow allocates an unbound memory window.
	AllocWindow() (MemoryWindow, error)
}

// Completion reports a finished work request.
type Completion struct {
	WRID   uint64
	Op     Opcode
	Status Status
	Bytes  int    // received bytes (RECV)
	Imm    uint32 // immediate data, if HasImm
	HasImm bool
}

// CompletionQueue collects completions.
type CompletionQueue interface {
	// Poll returns up to max completions without waiting.
	Poll(max int) []Completion
	// Wait returns at least one completion, or none after timeout.
	Wait(max int, timeout time.Duration) []Completion
}

// QPState is a queue pair's state.
type QPState uint8

// The states a queue pair goes through.
const (
	StateReset QPState = iota
	StateRTS           // connected: ready to send
	StateError
)

// ConnInfo is what two peers exchange out of band to connect queue pairs.
// It must travel over an authenticated channel (docs/security.md): the
// software providers draw QPN and PSN from crypto/rand, and a queue pair
// accepts as its peer only the queue pair whose QPN, PSN and Node the caller
// passed to Connect.
type ConnInfo struct {
	Fabric string   // where the queue pair lives: a fabric name, a socket address, a device name
	QPN    uint32   // queue pair number
	GID    [16]byte // verbs: the port's GID (RoCE v2: ::ffff:a.b.c.d)
	LID    uint16   // verbs: the port's LID (InfiniBand; 0 on RoCE)
	PSN    uint32   // the first packet sequence number the queue pair sends (24 bits)
	// Node is the identity the queue pair's device authenticates as: the
	// name in its certificate (socket), the device's name (inproc); empty
	// for verbs, which has none. A caller that learned a ConnInfo from peer X
	// sets Node to the name its registry knows X by before it connects, so
	// that a peer naming someone else is refused.
	Node string
}

// QueuePair is a reliable-connected queue pair.
type QueuePair interface {
	Info() ConnInfo
	// Connect takes the queue pair through INIT, RTR and RTS to the peer.
	Connect(remote ConnInfo) error
	// PostSend posts a WRITE, WRITE WITH IMMEDIATE or SEND.
	PostSend(wr WorkRequest) error
	// PostRecv posts a buffer for an incoming SEND or WRITE WITH IMMEDIATE.
	PostRecv(wr WorkRequest) error
	// ToError moves the queue pair to the error state: the fence.
	ToError() error
	State() QPState
}

// ProtectionDomain owns memory regions and queue pairs.
type ProtectionDomain interface {
	// Alloc registers size bytes of zeroed memory that the provider owns and
	// never moves, for as long as the device is open.
	Alloc(size int, access Access) (MemoryRegion, error)
	// Register registers memory the caller owns. It must never move: for the
	// verbs provider, memory outside the Go heap (mmap'd, C or device memory).
	Register(buf []byte, access Access) (MemoryRegion, error)
	CreateQP(sendCQ, recvCQ CompletionQueue, depth int) (QueuePair, error)
}

// Device is an RDMA device.
type Device interface {
	Name() string
	AllocPD() (ProtectionDomain, error)
	CreateCQ(depth int) (CompletionQueue, error)
	// Close moves every queue pair made on the device to the error state and
	// releases what the device holds. Memory from Alloc is invalid after it.
	Close() error
}

// Faults are the fault hooks every provider's queue pairs offer, for tests
// and simulations. Together with ToError (a cut) they are the transport's
// faults of the protocol's model.
type Faults interface {
	// Pause holds back the queue pair's work requests: nothing is placed and
	// nothing completes (a late WRITE) until Resume.
	Pause()
	// Resume lets the held work requests run, in order.
	Resume()
	// CorruptNext damages the payload of the next WRITE in transit, as
	// Damage does.
	CorruptNext()
}

// DamageSpan is how many bytes CorruptNext damages: a burst, as a garbled
// PCIe transaction of 256 bytes or a run of cache lines would, rather than
// one flipped byte, which in a page of float32 KV most often lands in
// mantissa bits that change no answer.
const DamageSpan = 256

// Damage is what every provider's CorruptNext does to a payload in transit:
// DamageSpan bytes from its middle (fewer where the payload ends first),
// each XORed with 0x5A.
func Damage(payload []byte) {
	for i := len(payload) / 2; i < min(len(payload), len(payload)/2+DamageSpan); i++ {
		payload[i] ^= 0x5A
	}
}

// Errors of posting and connecting; errors of execution arrive as completions.
var (
	ErrNotConnected = errors.New("rdma: queue pair is not ready to send")
	ErrQPError      = errors.New("rdma: queue pair is in the error state")
	ErrQueueFull    = errors.New("rdma: work queue full")
	ErrBadRequest   = errors.New("rdma: bad work request")
	ErrUnknownPeer  = errors.New("rdma: no such queue pair")
)

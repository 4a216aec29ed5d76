package spec

import "strconv"

// Tenant is the request id of KV left in decode pages by an earlier tenant: pages
// are never zeroed, so at the start every page holds someone else's prompt.
const Tenant int8 = -1

// Rogue is the request id of what a rogue WRITE (the rogue fault) puts in a
// page: bytes of no request's prompt.
const Rogue int8 = -2

// Free is the owner of a free page or slot.
const Free int8 = -1

// Label names a piece of KV by what it is: page Index of request Req's prompt,
// possibly corrupted in transit. Payloads are labels, not bytes: two payloads are
// equal iff their labels are, and a checksum is the label it was computed over.
type Label struct {
	Req     int8
	Index   int8
	Corrupt bool
}

func (l Label) String() string {
	// Without fmt: the refinement's views name a label per page and per read
	// at every step.
	var s string
	switch l.Req {
	case Tenant:
		s = "tenant"
	case Rogue:
		s = "rogue"
	default:
		s = "r" + strconv.Itoa(int(l.Req)) + "[" + strconv.Itoa(int(l.Index)) + "]"
	}
	if l.Corrupt {
		s += "(corrupt)"
	}
	return s
}

// Own reports whether l is exactly page i of request r, uncorrupted.
func (l Label) Own(r, i int) bool { return l == Label{Req: int8(r), Index: int8(i)} }

// PageRef is an ownership tag: a decode page and the epoch it was allocated at.
type PageRef struct {
	Page  int8
	Epoch uint8
}

// Tag is the tag record written after a page's payload (docs/protocol.md#tag-record-implemented-protocol).
type Tag struct {
	Req   int8
	Index int8
	Epoch uint8
	Sum   Label // the payload the sender computed the checksum over
}

// DecodePage is one page of the decode pool.
type DecodePage struct {
	Epoch       uint8 // advanced at every allocation
	Owner       int8  // request, or Free
	Quarantined bool  // owner aborted; kept until its writer is fenced
	Data        Label // the KV the page holds
	Tag         Tag
	// The prefix cache (prefix.go): a cached page is free of any owner and
	// holds verified KV under its key (Scope, Key); Pins counts the live
	// requests that share it; LRU is its rank among the cached pages, 1 the
	// least recently used. Doomed: its writer was caught (prefix.go,
	// purge) while it was pinned: out of the index and the LRU order (LRU
	// 0, no hit takes it), freed at its last unpin.
	Cached bool
	Scope  uint8
	Key    uint8 // the chain: Model.chain's id of the prompt's pages up to and including this one
	Pins   uint8
	LRU    uint8
	Doomed bool
}

// SourcePage is one page of the prefill node's KV pool.
type SourcePage struct {
	Owner int8
	Data  Label
}

// Outcome is what the client sees.
type Outcome uint8

// The outcomes; every one but Pending is terminal.
const (
	Pending Outcome = iota
	OK
	Rejected
	Cancelled
	Failed
)

func (o Outcome) String() string {
	return [...]string{"pending", "ok", "rejected", "cancelled", "failed"}[o]
}

// Reason says why a leg or request ended with an error.
type Reason uint8

// The reasons.
const (
	NoReason Reason = iota
	OverLimit
	NoCapacity
	TokenMismatch
	TagMismatch
	ChecksumMismatch
	TimedOut
	PeerFailed
	Flushed
	ClientCancelled
	GrantMismatch
	ScopeInBody
)

func (r Reason) String() string {
	return [...]string{"", "over limit", "no capacity", "token mismatch", "tag mismatch",
		"checksum mismatch", "timed out", "peer failed", "flushed", "cancelled", "grant mismatch", "scope in body"}[r]
}

// SenderPhase is the prefill leg's state for one request.
type SenderPhase uint8

// The sender phases. Terminal: SFinished, SAborted, SRejected, SFailed.
const (
	SNone       SenderPhase = iota
	SAwaitGrant             // source pages taken, Bootstrap sent; the KV is computed page by page (stream.go)
	SWriting                // grant admitted, posting WRITEs
	SSent                   // Done sent, waiting for WRITE completions
	SAborting               // aborted, waiting for posted WRITEs to complete before AbortAck
	SFinished
	SAborted
	SRejected
	SFailed
)

func (p SenderPhase) String() string {
	return [...]string{"-", "awaiting grant", "writing", "done sent", "aborting", "finished",
		"aborted", "rejected", "failed"}[p]
}

// Live reports whether the leg is still working.
func (p SenderPhase) Live() bool { return p >= SAwaitGrant && p <= SAborting }

// ReceiverPhase is the decode leg's state for one request.
type ReceiverPhase uint8

// The receiver phases. Terminal: RTombstone, RFinished, RClosed, RRejected.
const (
	RNone       ReceiverPhase = iota
	RTombstone                // cancelled before decode heard of it
	RReserved                 // pages granted, waiting for Done
	RReady                    // verified, waiting to decode
	RQuarantine               // ended while a writer may be live: waiting for the fence
	RFinished                 // decoded, pages released
	RClosed                   // ended with an error and fenced
	RRejected                 // decode's own intake refused it
)

func (p ReceiverPhase) String() string {
	return [...]string{"-", "tombstone", "reserved", "ready", "quarantine", "finished",
		"closed", "rejected"}[p]
}

// Live reports whether the leg is still working.
func (p ReceiverPhase) Live() bool { return p >= RReserved && p <= RQuarantine }

// Sender is the prefill node's record of one request.
type Sender struct {
	Phase       SenderPhase
	Placeholder bool  // admit-finished: a rejected prompt swapped for a one-token placeholder
	Pages       uint8 // source pages taken: the pages to compute and write (1 for a placeholder)
	Computed    uint8 // pages whose KV is computed, the first ones in order (stream.go): a WRITE waits for its page
	Src         [MaxDecodePages]int8
	SrcHeld     bool // source pages still allocated to this request
	Granted     bool
	Grant       [MaxDecodePages]PageRef
	Posted      uint8
	Completed   uint8
	Skip        uint8 // prompt pages the sender does not WRITE: the grant's prefix (prefix.go)
}

// Receiver is the decode node's record of one request. Pages and Slot are set
// once, at reservation, and never change: they are what the grant said.
type Receiver struct {
	Phase    ReceiverPhase
	Reason   Reason
	N        uint8
	Pages    [MaxDecodePages]PageRef
	Slot     int8
	Released bool  // pages given back to the pool (or, with leak-on-cancel, abandoned)
	Prefix   uint8 // Pages[:Prefix] are cached pages of the prefix hit, pinned; the rest were granted
	NoInsert bool  // its writer was caught while the record lived (prefix.go, purge): its read inserts nothing
}

// Request is everything about one request: the client's view, both legs, and
// what decode read (a history variable for Isolation).
type Request struct {
	Submitted bool
	// Dispatched: the router sent it to P and D, which name nodes from
	// then on (a request the router refused keeps 0 and 0, which name
	// none). Only the fingerprint reads it, to rename a route with the
	// nodes (node symmetry, model.go); no step does.
	Dispatched bool
	Scope      uint8 // the scope the router set (prefix.go): the tenant's, or with client-scope the body's
	P, D       int8  // the prefill and decode node the router chose (both 0 in a 1x1 deployment)
	PInc       uint8 // the incarnation of prefill node P the request was dispatched to
	DInc       uint8 // the incarnation of decode node D the request was dispatched to (Config.DecodeRestarts)
	Outcome    Outcome
	Reason     Reason
	S          Sender
	R          Receiver
	Read       bool
	ReadN      uint8
	ReadData   [MaxDecodePages]Label
}

// MsgKind is a message or work request type.
type MsgKind uint8

// The messages. Router→prefill: Prefill, Abort, PeerFailed. Router→decode:
// Abort, PeerFailed, PeerRestarted (the registry's news of a prefill node's
// new incarnation). Router→prefill also PeerRestarted, of a decode node's
// new incarnation (Config.DecodeRestarts). On the queue pair, prefill→decode: Bootstrap, Write, Done,
// AbortAck (RC: delivered in order); decode→prefill: Grant, Abort.
const (
	MPrefill MsgKind = iota
	MAbort
	MPeerFailed
	MBootstrap
	MWrite
	MDone
	MAbortAck
	MGrant
	MPeerRestarted
)

func (k MsgKind) String() string {
	return [...]string{"Prefill", "Abort", "PeerFailed", "Bootstrap", "WRITE", "Done", "AbortAck", "Grant", "PeerRestarted"}[k]
}

// Msg is a message in flight or a posted WRITE not yet placed.
type Msg struct {
	Kind   MsgKind
	Req    int8
	Index  int8    // WRITE: page index within the request
	Target PageRef // WRITE: decode page and the epoch it was granted at
	Src    int8    // WRITE: prefill source page the NIC reads at placement
	Sum    Label   // WRITE: what the checksum in the tag record covers
	Damage uint8   // WRITE: what the corrupt fault damaged in transit (Damaged*), 0 for nothing
	Tokens uint8   // Bootstrap, Grant, Done: token count
	Pages  uint8   // Grant, Done: page count
	Slot   int8    // Grant, Done: decode slot
	Peer   int8    // PeerFailed: the lost node (a prefill node to a decode node, a decode node to a prefill node); PeerRestarted: the prefill node
	Inc    uint8   // on the queue pair prefill→decode: the incarnation of the prefill node that sent it; PeerRestarted: the new incarnation
	Prefix uint8   // Grant, Done: prompt pages already present at decode (the prefix hit), not written
	Scope  uint8   // Bootstrap: the request's scope, bound by the router's ticket
	DInc   uint8   // on the queue pair: the decode incarnation at its decode end (prefill→decode: the one the sender's end is connected to; decode→prefill: the one that sent it); PeerRestarted of a decode node (Peer = DecodeNode|d): the new incarnation
}

// What a corrupt fault damaged in a WRITE (Msg.Damage).
const (
	DamagedPayload  = 1 // the payload
	DamagedTagReq   = 2 // the tag record's request
	DamagedTagIndex = 3 // the tag record's page index
	DamagedTagEpoch = 4 // the tag record's epoch
)

// Queue is a FIFO channel.
type Queue struct {
	N   uint8
	Buf [QueueCapacity]Msg
}

// Push appends m unless the queue holds bound messages already (a bound of
// the model, at most QueueCapacity); it reports whether it did.
func (q *Queue) Push(m Msg, bound int) bool {
	if int(q.N) >= min(bound, QueueCapacity) {
		return false
	}
	q.Buf[q.N] = m
	q.N++
	return true
}

// Head is the first message; the queue must not be empty.
func (q *Queue) Head() Msg { return q.Buf[0] }

// Pop removes the first message.
func (q *Queue) Pop() Msg {
	m := q.Buf[0]
	copy(q.Buf[:], q.Buf[1:q.N])
	q.N--
	q.Buf[q.N] = Msg{}
	return m
}

// Clear empties the queue.
func (q *Queue) Clear() { *q = Queue{} }

// Items is the queue's content.
func (q *Queue) Items() []Msg { return q.Buf[:q.N] }

// ForeignWrite records the first WRITE that landed in another request's page.
type ForeignWrite struct {
	Happened bool
	Req      int8 // the writer
	Page     int8
	Owner    int8 // the page's owner when it landed
	Node     int8 // the decode node of the page
}

// State is the global state of the system: every node of the deployment
// (Config.Prefills prefill and Config.Decodes decode nodes; arrays beyond them
// stay zero) and a queue pair per (prefill, decode) pair.
type State struct {
	Req            [MaxRequests]Request
	Pages          [MaxDecodes][MaxDecodePages]DecodePage // each decode node's pool
	Src            [MaxPrefills][MaxPrefillPages]SourcePage
	Slots          [MaxDecodes][MaxSlots]int8
	ToPrefill      [MaxPrefills]Queue             // router → prefill node
	ToDecode       [MaxDecodes]Queue              // router → decode node
	QP             [MaxPrefills][MaxDecodes]Queue // prefill → decode on their queue pair: WRITEs and SENDs, in order
	QPBack         [MaxPrefills][MaxDecodes]Queue // decode → prefill on their queue pair
	PrefillCrashed [MaxPrefills]bool
	CrashDetected  [MaxPrefills]bool              // the prefill node's registry lease expired: the router knows it is gone
	DecodeLost     [MaxDecodes]bool               // the decode node's registry lease expired (the node itself may live on)
	Partitioned    [MaxDecodes]bool               // the decode node is cut off from the rest of the deployment for good (the partition fault, partition.go)
	Severed        [MaxDecodes]bool               // the data plane between the decode node and every prefill node is cut for good, the node still listed (the dataplane-cut fault, dataplane.go)
	Fenced         [MaxPrefills][MaxDecodes]bool  // the queue pair was cut for good: one end was declared lost
	Unacked        [MaxPrefills][MaxDecodes]bool  // with static peers: prefill posted a SEND on the queue pair to a partitioned decode node that no one will acknowledge (static.go)
	Inc            [MaxPrefills]uint8             // each prefill node's incarnation: advanced at every restart
	QPInc          [MaxPrefills][MaxDecodes]uint8 // the incarnation of prefill node p whose queue pair decode node d holds
	DInc           [MaxDecodes]uint8              // each decode node's incarnation: advanced at every restart of it (Config.DecodeRestarts)
	PQPInc         [MaxPrefills][MaxDecodes]uint8 // the incarnation of decode node d whose queue pair prefill node p holds
	Budget         Budget                         // faults left
	Overflow       bool                           // a queue bound was hit: the bounds are too small (reported as a property)
	Foreign        ForeignWrite
	Ghost          Ghost
}

// Ghost is history for the properties that judge a step by the state before
// it. Successors records it from the states before and after every step, never
// the step functions themselves, so a wrong step cannot also hide the evidence.
type Ghost struct {
	Changed     bool // OutcomeFinal: a request's outcome changed after it was final
	ChangedReq  int8
	ChangedFrom Outcome // the outcome the client had already seen
	Spurious    bool    // NoSpuriousFailure: in a run without faults, a request ended other than ok for no reason the state gave
	SpuriousReq int8
	OldInc      bool // NoOldIncarnation: something of a replaced incarnation completed or landed
	OldIncReq   int8
	OldIncWhat  uint8 // OldIncOK, OldIncPlaced
	Tampered    bool  // ReadAsVerified: a page of a verified request changed before it was freed
	TamperedReq int8
	Pinned      bool // PinnedNeverReallocated: a pinned page was reallocated or written, or a cached one written
	PinnedPage  int8
	PinnedNode  int8
}

// What a NoOldIncarnation violation was (Ghost.OldIncWhat).
const (
	OldIncOK     = 1 // a request of a replaced incarnation reached the client as ok
	OldIncPlaced = 2 // a WRITE or SEND of a replaced incarnation landed on a decode node that had accepted its successor, or one posted to a replaced decode incarnation landed on its successor
	OldIncGrant  = 3 // a prefill node took a Grant or Abort of a decode incarnation it had replaced by its successor
)

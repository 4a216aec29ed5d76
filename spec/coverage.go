package spec

import "sync/atomic"

// Branch is one guarded branch of the spec's steps: a check that refuses, a
// path a message takes, a fault's effect. A [Coverage] counts how often each
// fired during an exploration, so that bounds under which a defense never
// fires (and so is never tested) show up as a zero.
type Branch uint8

// The branches, grouped by the node that takes them. Defense reports which are
// the protocol's defenses: the checks that refuse a request or a message.
const (
	RouterOverLimit       Branch = iota // router: the prompt is over the advertised context: rejected
	RouterPeerDead                      // router: the prefill node is known dead: failed at once
	RouterDispatch                      // router: dispatched to prefill
	PrefillOverLimit                    // prefill intake: over its pool: rejected
	PrefillPlaceholder                  // prefill intake, admit-finished: a rejected prompt handed off as a placeholder
	PrefillNoCapacity                   // prefill intake: too few free source pages: failed
	PrefillAccept                       // prefill intake: source pages taken, Bootstrap sent
	AdmitGrantMismatch                  // prefill admission: the grant differs from the sender's view: failed
	AdmitGrant                          // prefill admission: the grant matches: writing
	AdmitEndedGrant                     // prefill admission: a grant for an ended leg: answered with AbortAck
	DecodeTombstone                     // decode intake: a Bootstrap for a request cancelled first: refused
	DecodeDuplicate                     // decode intake: a second Bootstrap: ignored
	DecodeOverLimit                     // decode intake: over its pool: rejected
	DecodeNoSlot                        // decode intake: no free slot: failed
	DecodeNoPages                       // decode intake: too few free pages: failed
	DecodeReserve                       // decode intake: pages and a slot reserved, Grant sent
	DecodeExactlyFull                   // decode intake: the reservation takes every free page
	DecodeReusedSlot                    // decode intake: the slot was held by an earlier request
	DecodeReusedPage                    // decode intake: a page was held by an earlier request (epoch past 1)
	DoneFence                           // Done for a request not waiting for one: a fence
	VerifyTokens                        // verification: Done's token count differs from the reservation
	VerifyPages                         // verification: Done's page count differs from the reservation
	VerifyPageEpoch                     // verification: the pool's page epoch is not the granted one
	VerifyTagRequest                    // verification: a tag record names another request
	VerifyTagIndex                      // verification: a tag record names another page index
	VerifyTagEpoch                      // verification: a tag record carries another epoch
	VerifyChecksumFirst                 // verification: the first page's payload does not match its checksum
	VerifyChecksumLater                 // verification: a later page's payload does not match its checksum
	VerifyOK                            // verification: every check passed: ready
	ReadEpoch                           // read: a page's epoch changed since the grant: failed
	ReadOK                              // read: served ok
	FenceQuarantine                     // fence: quarantined pages released
	FenceReserved                       // fence: a request still waiting for Done ends (the sender gave up)
	FenceEnded                          // fence: for an ended request: nothing changes
	AbortQuarantine                     // decode abort: pages quarantined until the fence
	AbortReady                          // decode abort of a verified request: pages released at once
	AbortTombstone                      // decode abort of a request it has not heard of: tombstone
	WriteLanded                         // a WRITE placed in a page its request owns
	WriteLandedFree                     // a WRITE placed in a free page (its request ended)
	WriteLandedForeign                  // a WRITE placed in another request's page
	SenderAbortWaits                    // sender abort: waits for posted WRITEs before AbortAck
	CutFails                            // cut: a live request failed
	PrefillOldIncarnation               // prefill: a message for a request of an incarnation it replaced: no record, ignored
	RestartLoss                         // restart: the new registration tells the router the old incarnation is lost
	RestartFence                        // decode: the queue pair of a replaced incarnation cut before the new one's is accepted
	RogueRevoked                        // a rogue WRITE with the key of a Grant decode has revoked: refused
	RogueUncovered                      // a rogue WRITE with a live key, to a page the key does not cover: refused
	RogueLanded                         // a rogue WRITE with a live key, to a page of its request: landed (verification sees it)
	RogueLandedFree                     // a rogue WRITE landed in a free page (pool-wide-key)
	RogueLandedForeign                  // a rogue WRITE landed in another request's page (pool-wide-key)
	DecodeNoTicket                      // decode intake: a Bootstrap for a request the router did not dispatch to it: refused
	RouterScopeInBody                   // router: a request whose body names a scope: refused (the scope is the tenant's)
	PrefixHit                           // decode intake: a prefix of the request's chain is cached under its scope: pinned
	PrefixScopeMiss                     // decode intake: a page of the chain is cached under another scope only: not a hit
	PrefixEvict                         // decode intake: an unpinned cached page evicted for a fresh one
	EvictSkipsPinned                    // decode intake: eviction passes over a pinned cached page
	PrefixInsert                        // read: a written full prompt page enters the cache
	VerifyPrefix                        // verification: Done's prefix differs from the grant's
	VerifyPinned                        // verification: a pinned page is no longer cached at its epoch, scope and chain
	ReadShared                          // read: a pinned page is no longer cached at its epoch, scope and chain: failed
	PartitionLoss                       // router: a partitioned decode node's lease expired: lost (partition.go)
	LostDecodeFence                     // prefill: the queue pair to a decode node the registry declared lost cut for good
	AdmitMidStream                      // prefill admission: the Grant is admitted before every page is computed (stream.go)
	EndMidStream                        // a sender's leg ends with pages not yet computed: the computation stops (stream.go)
	ComputeEnded                        // free-computing: a page computed for a leg that has ended, into a source page it no longer holds
	PrefixPurge                         // a cut or a failed verification takes a cached page its writer wrote out of the cache
	RetryLimit                          // static peers: RC's retry limit errors prefill's end of a queue pair to a partitioned decode node (static.go)
	NumBranches
)

var branchNames = [NumBranches]string{
	"router-over-limit", "router-peer-dead", "router-dispatch",
	"prefill-over-limit", "prefill-placeholder", "prefill-no-capacity", "prefill-accept",
	"admit-grant-mismatch", "admit-grant", "admit-ended-grant",
	"decode-tombstone", "decode-duplicate", "decode-over-limit", "decode-no-slot", "decode-no-pages",
	"decode-reserve", "decode-exactly-full", "decode-reused-slot", "decode-reused-page",
	"done-fence",
	"verify-tokens", "verify-pages", "verify-page-epoch", "verify-tag-request", "verify-tag-index",
	"verify-tag-epoch", "verify-checksum-first", "verify-checksum-later", "verify-ok",
	"read-epoch", "read-ok",
	"fence-quarantine", "fence-reserved", "fence-ended",
	"abort-quarantine", "abort-ready", "abort-tombstone",
	"write-landed", "write-landed-free", "write-landed-foreign",
	"sender-abort-waits", "cut-fails",
	"prefill-old-incarnation", "restart-loss", "restart-fence",
	"rogue-revoked", "rogue-uncovered", "rogue-landed", "rogue-landed-free", "rogue-landed-foreign", "decode-no-ticket",
	"router-scope-in-body", "prefix-hit", "prefix-scope-miss", "prefix-evict", "evict-skips-pinned", "prefix-insert",
	"verify-prefix", "verify-pinned", "read-shared",
	"partition-loss", "lost-decode-fence",
	"admit-mid-stream", "end-mid-stream", "compute-ended",
	"prefix-purge", "retry-limit",
}

func (b Branch) String() string {
	if b < NumBranches {
		return branchNames[b]
	}
	return "Branch(?)"
}

// Defense reports whether b is one of the protocol's refusing checks that a
// run of the correct protocol can reach: an intake rejection, a capacity
// refusal, a verification check, the grant check at admission, the fence
// of a replaced incarnation's queue pair or of a lost decode node's, a
// remote key's check (revoked, or not covering the page) or the router's
// ticket at decode's intake. A coverage gate requires each to fire.
func (b Branch) Defense() bool {
	switch b {
	case RouterOverLimit, PrefillOverLimit, PrefillNoCapacity, AdmitGrantMismatch, DecodeOverLimit,
		DecodeNoSlot, DecodeNoPages, VerifyTokens, VerifyPages, VerifyTagRequest,
		VerifyTagIndex, VerifyTagEpoch, VerifyChecksumFirst, VerifyChecksumLater, RestartFence, LostDecodeFence,
		RogueRevoked, RogueUncovered, DecodeNoTicket, RouterScopeInBody, PrefixScopeMiss, EvictSkipsPinned:
		return true
	}
	return false
}

// Redundant reports whether b is a refusing check that the correct protocol
// cannot reach: the pool-epoch checks at Done and at read. Each refuses only
// in a state where a live request's page is no longer its own at the granted
// epoch, which violates Conservation, and the checker expands no state that
// violates a property. They are defense in depth against a bug elsewhere
// (double-free, done-unmatched), and fire in no exhaustive exploration. So
// are the prefix cache's checks of a pinned page (at Done and at read: a
// pinned page that changed violates PinnedNeverReallocated first) and of
// Done's prefix (the sender's skip is the grant's, and no fault damages it:
// prefix-count-mismatch violates PrefixExact at admission).
func (b Branch) Redundant() bool {
	switch b {
	case VerifyPageEpoch, ReadEpoch, VerifyPrefix, VerifyPinned, ReadShared:
		return true
	}
	return false
}

// Coverage counts the actions and branches taken while a model explores.
// One Coverage may be shared by concurrent explorations of one model.
type Coverage struct {
	actions  [NumActionKinds]atomic.Uint64
	branches [NumBranches]atomic.Uint64
}

// Action is how many times actions of kind k fired.
func (c *Coverage) Action(k ActionKind) uint64 { return c.actions[k].Load() }

// Branch is how many times b fired.
func (c *Coverage) Branch(b Branch) uint64 { return c.branches[b].Load() }

// WithCoverage returns a copy of m that counts every step it takes into c.
func (m *Model) WithCoverage(c *Coverage) *Model {
	cp := *m
	cp.cov = c
	return &cp
}

func (x *sys) hit(b Branch) {
	if c := x.m.cov; c != nil {
		c.branches[b].Add(1)
	}
}

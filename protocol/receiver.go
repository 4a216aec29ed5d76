package protocol

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
)

// PeerID names one queue pair of a Sender or Receiver: the connection to one
// peer node. The driver chooses it (transfer draws a new one on every
// reconnect, so a message of an old connection's requests is refused on the
// new one); it is not the peer's NodeID, which the router uses.
type PeerID uint32

// Send is a message to post on the queue pair to Peer.
type Send struct {
	Peer PeerID
	Msg  Message
}

// Outcome is a request's final result on one node: Err is nil for success, or
// wraps one of the outcome errors. Each request gets exactly one Outcome.
type Outcome struct {
	Request RequestID
	Err     error
}

// PageMemory gives the receiver read access to its own pages, so that it can
// verify them. Reading local memory is not I/O: the receiver stays sans-I/O.
type PageMemory interface {
	// TagRecord is the page's tag record slot (at least TagSize bytes).
	TagRecord(page uint32) []byte
	// Payload is the page's KV bytes.
	Payload(page uint32) []byte
}

// ReceiverConfig configures a Receiver.
type ReceiverConfig struct {
	Pages      int           // pages in the pool
	PageTokens int           // tokens of KV per page
	Slots      int           // requests held at once; 0 means Pages
	MaxTokens  int           // intake limit in tokens; 0 means Pages*PageTokens
	Timeout    time.Duration // a reserved request fails after this long without Done; 0 means never
	// Horizon is how long a request's record is kept after the request ended
	// (finished, closed, or a tombstone; a refused Bootstrap leaves none), so
	// that a late message finds it ended; Tick forgets older ones. 0 keeps
	// every record until MaxRecords forgets the oldest.
	// A message for a forgotten request is one for an unknown request: a late
	// Done or AbortAck is refused with ErrUnknownRequest and changes nothing,
	// but a Bootstrap is a new request. So Horizon must exceed the longest a
	// message can be late: the queue pair's retry time, and the race between
	// the router's cancel and the prefill node's Bootstrap.
	Horizon time.Duration
	// MaxRecords bounds the records kept, live and ended: past it the oldest
	// ended record is forgotten early, as if its horizon had passed (records
	// at work are never forgotten). 0 means 64 per slot, at least 65,536.
	MaxRecords int
	Memory     PageMemory // the pages, for verification
	// TagKeys returns the tag key of the queue pair to peer (agreed over the
	// nodes' authenticated connection setup), or nil while there is none.
	// Required: a Bootstrap from a peer without a key is refused at intake
	// (ErrRejected with ErrNoPeerKey), so an engine that forgets to hand a key
	// over finds out at its first request. A request keeps the key it was
	// bootstrapped with; only records MACed under it verify.
	TagKeys func(peer PeerID) *TagKey
	// Region says where the sender writes a page: the remote address and key of
	// its memory region.
	Region func(page uint32) (addr uint64, key uint32)
	// Authorize, if set, decides whether a Bootstrap from peer may reserve
	// anything: nil, or why not (a missing, forged, expired, misrouted or
	// replayed ticket). A refused Bootstrap leaves no record, is an outcome
	// wrapping ErrUnauthorized and the error, and its sender is told with
	// AbortUnauthorized. It is called at intake, after the limits every
	// Bootstrap is held to and before the quotas and the pool. It must not
	// keep b (a Decoder's message is reused).
	Authorize func(peer PeerID, b *Bootstrap) error
	// PeerRequests and PeerPages bound what one peer holds: its requests
	// holding a slot, and the pages of its requests not yet back in the pool
	// (reserved, verified, being read, quarantined). A Bootstrap past either
	// is refused (ErrOverQuota, AbortOverQuota) and reserves nothing. 0 means
	// no bound of its own (Slots and Pages bound every peer together).
	PeerRequests, PeerPages int
	// PrefixCache turns decode's prefix cache on (docs/protocol.md, "Prefix
	// reuse"): a Bootstrap with a scope reuses the longest run of its chain
	// cached under that scope, pinned while the request lives, and only the
	// rest is granted and written; Finish inserts the request's verified full
	// prompt pages. It needs Authorize: the scope must come authenticated
	// (the router's ticket binds it), so NewReceiver refuses it without.
	PrefixCache bool
	// PrefixScopePages, if positive, caps the cached pages of each scope
	// (Pool.SetScopeCap): a scope at its cap evicts its own least recently
	// used unpinned page to insert one. 0, the default, is one LRU over
	// every scope.
	PrefixScopePages int
	// Research turns bugs of the catalogue on. Only code inside this module can
	// set it (see internal/research); everywhere else it is the zero value.
	Research research.Switches
}

// ReceiverEffects are what the caller must do after feeding events in.
type ReceiverEffects struct {
	// Sends go to senders, in order per peer.
	Sends []Send
	// Cuts are queue pairs the caller must move to the error state (so that
	// nothing more can land), then report with QueuePairFenced.
	Cuts []PeerID
	// Verified requests may be read: Acquire, read, Finish.
	Verified []RequestID
	// Outcomes are final results, each request once.
	Outcomes []Outcome
}

type recvRequest struct {
	phase  ReceiverStatus
	ended  time.Time // the first Tick that saw the request ended; zero before
	peer   PeerID
	key    *TagKey // the queue pair's tag key when the request was bootstrapped
	tokens uint32
	refs   []PageRef // the fresh pages, owned: the request's pages len(prefix) on
	// The prefix hit: the request's scope, the cached pages it pinned (its
	// first pages), whether it holds the pins still, and its whole chain,
	// for Finish to insert its fresh full pages (chain[len(prefix):]) and
	// to touch the chain deepest first.
	scope  Scope
	prefix []PageRef
	pinned bool
	chain  []ChainHash
	// cancelled: the request was cancelled (or failed) while being read,
	// or its writer has failed since it verified, so Finish inserts
	// nothing: only a request that succeeds, from a writer not found
	// failed, gives the cache its pages (rule 24).
	cancelled bool
	deadline  time.Time
	reported  bool
	grant     Grant // the Grant sent for it, kept in the record: one allocation less
	// holding and owning say what the record counts in its peer's use: a
	// slot, and its pages until they are back in the pool.
	holding, owning bool
}

// peerUse is what one peer holds: its requests holding a slot and the pages
// of its requests not yet back (ReceiverConfig.PeerRequests, PeerPages).
type peerUse struct{ requests, pages int }

// Receiver is the decode node's side of the handoff, for every request from
// every sender: intake, reservation, verification, the read-time checks, and
// every abort path with its fence (docs/protocol.md). It is a sans-I/O state
// machine: methods take events (with the current time where it matters) and
// accumulate effects, which Effects hands over. It is not safe for concurrent use.
type Receiver struct {
	cfg     ReceiverConfig
	pool    *Pool
	reqs    map[RequestID]*recvRequest
	held    int                 // requests holding a slot
	use     map[PeerID]*peerUse // per peer, while it holds anything
	effects ReceiverEffects
	spare   ReceiverEffects // the batch before the last, whose slices the next one reuses
	// deadlines holds a timer per reserved request with a Timeout; horizon one
	// per ended record whose age has started; ending the records that ended
	// since the last Tick.
	deadlines timers[recvRequest]
	horizon   queue[recvRequest]
	ending    queue[recvRequest]
	scratch   [16]byte // the tag MAC's working block
	stats     ReceiverStats
}

// ReceiverStats counts the prefix cache's work (docs/protocol.md, "Prefix
// reuse"), for metrics.
type ReceiverStats struct {
	PrefixLookups     uint64 // reservations that looked their chain up
	PrefixHits        uint64 // reservations that reused at least one cached page
	PrefixHitPages    uint64 // cached pages reused, over every hit
	PrefixHitTokens   uint64 // prompt tokens reused (Grant.Prefix), over every hit
	PrefixInsertions  uint64 // verified pages that became cached pages
	PrefixEvictions   uint64 // cached pages evicted for fresh pages
	PrefixCachedPages int    // cached pages now, pinned or not
	PrefixPurged      uint64 // cached pages taken out because their writer failed
}

// Stats is the receiver's prefix cache counters.
func (r *Receiver) Stats() ReceiverStats {
	s := r.stats
	s.PrefixEvictions, s.PrefixCachedPages = r.pool.Evictions(), r.pool.Cached()
	s.PrefixPurged = r.pool.Purged()
	return s
}

// ErrConfig: a configuration the receiver refuses to run with.
var ErrConfig = errors.New("protocol: bad configuration")

// NewReceiver validates cfg and returns a receiver with every page free.
func NewReceiver(cfg ReceiverConfig) (*Receiver, error) {
	if cfg.Pages < 1 || cfg.PageTokens < 1 || cfg.Memory == nil || cfg.Region == nil || cfg.TagKeys == nil {
		return nil, fmt.Errorf("%w: a receiver needs Pages, PageTokens, Memory, Region and TagKeys", ErrConfig)
	}
	if cfg.PrefixCache && cfg.Authorize == nil {
		return nil, fmt.Errorf("%w: PrefixCache needs Authorize: a request's scope must come authenticated", ErrConfig)
	}
	if cfg.Slots == 0 {
		cfg.Slots = cfg.Pages
	}
	if cfg.MaxTokens == 0 {
		cfg.MaxTokens = cfg.Pages * cfg.PageTokens
	}
	if cfg.MaxRecords == 0 {
		cfg.MaxRecords = max(64*cfg.Slots, 1<<16)
	}
	pool := NewPool(cfg.Pages)
	pool.doubleFree = cfg.Research.Has(research.DoubleFree)
	pool.scopeDropped = cfg.Research.Has(research.ScopeDropped)
	pool.evictPinned = cfg.Research.Has(research.EvictPinned)
	pool.SetScopeCap(cfg.PrefixScopePages)
	return &Receiver{cfg: cfg, pool: pool, reqs: map[RequestID]*recvRequest{}, use: map[PeerID]*peerUse{}}, nil
}

func (r *Receiver) bug(sw research.Switch) bool { return r.cfg.Research.Has(sw) }

// tellSender sends a failure decided here to the sender (peer cancel).
func (r *Receiver) tellSender(peer PeerID, id RequestID, why AbortReason) {
	if !r.bug(research.NoPeerCancel) {
		r.send(peer, &Abort{Request: id, Reason: why})
	}
}

// Effects returns the effects accumulated since the last call and clears them.
// Its slices are reused from the second call after this one on: carry what
// they hold (the messages themselves are never reused) before calling Effects
// twice more.
func (r *Receiver) Effects() ReceiverEffects {
	e, old := r.effects, &r.spare
	clear(old.Sends)
	clear(old.Outcomes)
	r.effects = ReceiverEffects{Sends: old.Sends[:0], Cuts: old.Cuts[:0], Verified: old.Verified[:0], Outcomes: old.Outcomes[:0]}
	r.spare = e
	return e
}

// Pool is the receiver's page pool, for inspection (tests, metrics).
func (r *Receiver) Pool() *Pool { return r.pool }

func (r *Receiver) send(peer PeerID, m Message) {
	r.effects.Sends = append(r.effects.Sends, Send{Peer: peer, Msg: m})
}

// finish reports a request's outcome once; later outcomes are ignored.
func (r *Receiver) finish(id RequestID, q *recvRequest, err error) {
	if !q.reported {
		q.reported = true
		r.effects.Outcomes = append(r.effects.Outcomes, Outcome{Request: id, Err: err})
	}
}

// release returns q's pages (only those it still holds at its epochs) and its slot.
func (r *Receiver) release(q *recvRequest, id RequestID) {
	r.freePages(q, id)
	r.dropSlot(q, id)
}

func (r *Receiver) dropSlot(q *recvRequest, id RequestID) {
	if q.pinned { // the prefix pins end with the slot, on every path
		q.pinned = false
		r.pool.Unpin(id, q.scope, q.prefix)
	}
	q.chain = nil // only Finish inserts, before it releases: an ended record keeps no chain
	if q.phase == ReceiverReserved || q.phase == ReceiverReady || q.phase == ReceiverReading {
		r.held--
	}
	if q.holding {
		q.holding = false
		r.charge(q.peer, -1, 0)
	}
}

// freePages returns q's pages to the pool, and takes them off its peer's use.
func (r *Receiver) freePages(q *recvRequest, id RequestID) {
	r.pool.Release(id, q.refs)
	r.disown(q)
}

// disown takes q's pages off its peer's use: they are back in the pool (or,
// under leak-on-cancel, never will be, which is no fault of the peer's).
func (r *Receiver) disown(q *recvRequest) {
	if q.owning {
		q.owning = false
		r.charge(q.peer, 0, -len(q.refs))
	}
}

// charge adds to peer's use; an entry goes when its peer holds nothing.
func (r *Receiver) charge(peer PeerID, requests, pages int) {
	u := r.use[peer]
	if u == nil {
		u = &peerUse{}
		r.use[peer] = u
	}
	u.requests += requests
	u.pages += pages
	if u.requests == 0 && u.pages == 0 {
		delete(r.use, peer)
	}
}

// overQuota says why a Bootstrap of n pages from peer would take more than
// one peer may hold, or nil.
func (r *Receiver) overQuota(peer PeerID, n int) error {
	var u peerUse
	if p := r.use[peer]; p != nil {
		u = *p
	}
	switch {
	case r.cfg.PeerRequests > 0 && u.requests >= r.cfg.PeerRequests:
		return fmt.Errorf("%w: peer %d holds %d open requests, the most one peer may", ErrOverQuota, peer, u.requests)
	case r.cfg.PeerPages > 0 && u.pages+n > r.cfg.PeerPages:
		return fmt.Errorf("%w: peer %d holds %d pages; %d more would pass the %d one peer may", ErrOverQuota, peer, u.pages, n, r.cfg.PeerPages)
	}
	return nil
}

// PeerUse is what peer holds now: its requests holding a slot, and the
// pages of its requests not yet back in the pool (for tests and metrics).
func (r *Receiver) PeerUse(peer PeerID) (requests, pages int) {
	if u := r.use[peer]; u != nil {
		return u.requests, u.pages
	}
	return 0, 0
}

// Step handles a message from a sender. A message that breaks the protocol
// returns an error and changes nothing; late and duplicate fences are
// expected and return nil.
func (r *Receiver) Step(peer PeerID, m Message, now time.Time) error {
	// The limits the wire decoder enforces hold for in-process messages too.
	if err := validate(m); err != nil {
		return err
	}
	switch m := m.(type) {
	case *Bootstrap:
		return r.bootstrap(peer, m, now)
	case *Done:
		return r.done(peer, m)
	case *AbortAck:
		q, err := r.lookup(peer, m.Request)
		if err != nil {
			return err
		}
		r.fence(m.Request, q, fmt.Errorf("%w: the sender gave up", ErrPeerFailed))
		return nil
	}
	return fmt.Errorf("%w: %s to a receiver", ErrUnexpectedMessage, m.Type())
}

func (r *Receiver) lookup(peer PeerID, id RequestID) (*recvRequest, error) {
	q := r.reqs[id]
	switch {
	case q == nil:
		return nil, fmt.Errorf("%w: %d", ErrUnknownRequest, id)
	case q.phase == ReceiverTombstone:
		return q, nil
	case q.peer != peer:
		return nil, fmt.Errorf("%w: request %d is on peer %d, not %d", ErrWrongPeer, id, q.peer, peer)
	}
	return q, nil
}

// bootstrap is decode's intake and reservation (docs/protocol.md rule 3).
func (r *Receiver) bootstrap(peer PeerID, m *Bootstrap, now time.Time) error {
	id := m.Request
	if q := r.reqs[id]; q != nil {
		if q.phase == ReceiverTombstone {
			r.send(peer, &Abort{Request: id, Reason: AbortCancelled})
			return nil
		}
		return fmt.Errorf("%w: Bootstrap for request %d", ErrDuplicate, id)
	}
	// Intake comes before any record: a refused Bootstrap leaves nothing
	// behind, so no peer can grow this node's state by asking.
	n := PagesFor(m.Tokens, r.cfg.PageTokens)
	k := 0 // the prefix hit, in pages (rule 21)
	var refs, prefix []PageRef
	var err error
	why := AbortRejected
	key := r.cfg.TagKeys(peer)
	switch {
	case key == nil:
		err = fmt.Errorf("%w: %w: peer %d", ErrRejected, ErrNoPeerKey, peer)
	case int64(m.Tokens) > int64(r.cfg.MaxTokens):
		err = fmt.Errorf("%w: %w: %d tokens, this node takes %d", ErrRejected, ErrTooLong, m.Tokens, r.cfg.MaxTokens)
	case n > MaxGrantPages:
		err = fmt.Errorf("%w: %w: %d tokens need %d pages, a grant carries %d", ErrRejected, ErrTooManyPages, m.Tokens, n, MaxGrantPages)
	case m.Scope != 0 && len(m.Chain) != int(m.Tokens)/r.cfg.PageTokens || m.Scope == 0 && len(m.Chain) != 0:
		err = fmt.Errorf("%w: %w: %d hashes for %d tokens in pages of %d, scope %#x", ErrRejected, ErrBadChain,
			len(m.Chain), m.Tokens, r.cfg.PageTokens, uint64(m.Scope))
	case r.authorize(peer, m, &err):
		why = AbortUnauthorized
	}
	if err == nil && r.cfg.PrefixCache && m.Scope != 0 {
		// Rule 21: the longest run of the chain cached under the scope,
		// capped at n-1 pages so that the page with the last token is
		// always written. Only an authorized Bootstrap gets this far.
		k = r.pool.LookupPrefix(m.Scope, m.Chain[:min(len(m.Chain), n-1)])
	}
	switch {
	case err != nil:
	case r.quota(peer, n-k, &err):
		why = AbortOverQuota
	case r.held >= r.cfg.Slots:
		why, err = AbortNoCapacity, fmt.Errorf("%w: every slot is taken", ErrNoCapacity)
	default:
		why = AbortNoCapacity
		// All or nothing: the prefix is pinned first, so that making room
		// for the fresh pages cannot evict it; if they cannot be had, the
		// pins go again.
		prefix = r.pool.Pin(id, m.Scope, m.Chain[:k])
		if refs, err = r.pool.Allocate(id, n-k); err != nil {
			r.pool.Unpin(id, m.Scope, prefix)
		}
	}
	if err != nil {
		if why == AbortUnauthorized {
			r.purge(peer) // a peer sending Bootstraps its router never ticketed
		}
		r.effects.Outcomes = append(r.effects.Outcomes, Outcome{Request: id, Err: err})
		r.tellSender(peer, id, why)
		return nil
	}
	q := &recvRequest{phase: ReceiverReserved, peer: peer, key: key, tokens: m.Tokens, refs: refs, holding: true, owning: true,
		scope: m.Scope, prefix: prefix, pinned: len(prefix) > 0}
	if r.cfg.PrefixCache && m.Scope != 0 {
		r.stats.PrefixLookups++
		q.chain = slices.Clone(m.Chain) // the Bootstrap is the Decoder's: keep a copy
	}
	if k > 0 {
		r.stats.PrefixHits++
		r.stats.PrefixHitPages += uint64(k)
		r.stats.PrefixHitTokens += uint64(k * r.cfg.PageTokens)
	}
	r.remember(id, q)
	r.held++
	r.charge(peer, 1, len(refs))
	if r.cfg.Timeout > 0 {
		q.deadline = now.Add(r.cfg.Timeout)
		r.deadlines.push(timer[recvRequest]{at: q.deadline, id: id, rec: q})
	}
	g := &q.grant
	granted := refs
	*g = Grant{Request: id, Tokens: m.Tokens, Prefix: uint32(k * r.cfg.PageTokens)}
	if r.bug(research.WriteShared) && k > 0 {
		// The bug: the pinned pages are granted too, from index 0, so the
		// sender writes pages other requests read.
		granted = append(slices.Clone(prefix), refs...)
		g.Prefix = 0
	}
	g.Pages = make([]PageGrant, len(granted))
	for i, ref := range granted {
		addr, key := r.cfg.Region(ref.Page)
		g.Pages[i] = PageGrant{Page: ref.Page, Epoch: ref.Epoch, Addr: addr, Key: key}
	}
	r.send(peer, g)
	return nil
}

// authorize runs the Authorize hook on a Bootstrap: true, with *err set,
// if it refuses it. Under unticketed-bootstrap it is never asked.
func (r *Receiver) authorize(peer PeerID, m *Bootstrap, err *error) bool {
	if r.cfg.Authorize == nil || r.bug(research.UnticketedBootstrap) {
		return false
	}
	if e := r.cfg.Authorize(peer, m); e != nil {
		*err = fmt.Errorf("%w: request %d from peer %d: %w", ErrUnauthorized, m.Request, peer, e)
		return true
	}
	return false
}

// quota is true, with *err set, if a Bootstrap of n pages would take peer
// past its quota.
func (r *Receiver) quota(peer PeerID, n int, err *error) bool {
	if e := r.overQuota(peer, n); e != nil {
		*err = e
		return true
	}
	return false
}

// done handles Done (rule 7). Reliable-connected ordering puts it behind every
// WRITE of the request, so it is also the sender's fence.
func (r *Receiver) done(peer PeerID, m *Done) error {
	id := m.Request
	q, err := r.lookup(peer, id)
	if err != nil {
		return err
	}
	switch q.phase {
	case ReceiverReserved:
		if err := r.verify(id, q, m); err != nil {
			if r.bug(research.ChecksumHangs) && errors.Is(err, ErrChecksumMismatch) {
				return nil // logged, and the request waits for a Done that has come
			}
			r.release(q, id) // Done fenced the writer
			r.end(id, q, ReceiverClosed)
			r.finish(id, q, err)
			r.tellSender(peer, id, AbortVerifyFailed)
			r.purge(peer) // its KV is suspect: so is what it wrote before
			return nil
		}
		q.phase = ReceiverReady
		r.effects.Verified = append(r.effects.Verified, id)
		return nil
	case ReceiverReady, ReceiverReading:
		return fmt.Errorf("%w: second Done for request %d", ErrDuplicate, id)
	}
	r.fence(id, q, nil)
	return nil
}

// verify checks a Done against the reservation: counts and the prefix
// length, the pinned prefix pages (still cached at their epochs under the
// request's scope), then every written page's tag record and checksum
// (rule 22).
func (r *Receiver) verify(id RequestID, q *recvRequest, m *Done) error {
	if !r.bug(research.NoTokenCheck) && (m.Tokens != q.tokens || int(m.Pages) != len(q.grant.Pages)) {
		return fmt.Errorf("%w: Done says %d tokens in %d pages, the reservation is %d tokens in %d pages",
			ErrTokenMismatch, m.Tokens, m.Pages, q.tokens, len(q.grant.Pages))
	}
	if !r.bug(research.PrefixCountMismatch) && m.Prefix != q.grant.Prefix {
		return fmt.Errorf("%w: Done skipped %d prefix tokens, the Grant said %d", ErrTokenMismatch, m.Prefix, q.grant.Prefix)
	}
	for i, ref := range q.prefix {
		if err := r.pool.CheckShared(q.scope, ref); err != nil {
			return fmt.Errorf("prefix page %d of request %d: %w", i, id, err)
		}
	}
	k := int(q.grant.Prefix) / r.cfg.PageTokens
	for j, p := range q.grant.Pages {
		i := k + j // the page's index in the request
		want := Expect{Request: id, Index: uint32(i), Epoch: p.Epoch, Tokens: TokensInPage(q.tokens, r.cfg.PageTokens, i)}
		record, payload := r.cfg.Memory.TagRecord(p.Page), r.cfg.Memory.Payload(p.Page)
		if !r.bug(research.NoTagCheck) && !r.bug(research.NoChecksum) {
			if err := verifyPage(record, payload, want, q.key, &r.scratch); err != nil {
				return err
			}
			continue
		}
		t, err := parseTag(record, q.key, &r.scratch)
		if !r.bug(research.NoTagCheck) {
			if err == nil {
				err = CheckTag(t, want)
			}
			if err != nil {
				return err
			}
		}
		if !r.bug(research.NoChecksum) && (err != nil || q.key.Sum(payload) != t.Sum) {
			return fmt.Errorf("%w: page %d of request %d", ErrChecksumMismatch, i, id)
		}
	}
	return nil
}

// fence handles a sign that q's writer can write no more (AbortAck, a late Done,
// a cut). A request still waiting for Done fails with why (if why is set); a
// quarantined one is released; a terminal one ignores it: fences are idempotent.
func (r *Receiver) fence(id RequestID, q *recvRequest, why error) {
	switch q.phase {
	case ReceiverReserved:
		if why == nil {
			return
		}
		r.release(q, id)
		r.end(id, q, ReceiverClosed)
		r.finish(id, q, why)
	case ReceiverQuarantine:
		r.freePages(q, id)
		r.end(id, q, ReceiverClosed)
	case ReceiverClosed, ReceiverFinished:
		if r.bug(research.DoubleFree) {
			r.pool.Release(id, q.refs) // a second release of pages that may be someone else's now
		}
	}
}

// Cancel ends a request at the client's or router's request. Pages that a
// writer may still write stay quarantined until its fence.
func (r *Receiver) Cancel(id RequestID) {
	q := r.reqs[id]
	if q == nil {
		q = &recvRequest{reported: true}
		r.remember(id, q)
		r.end(id, q, ReceiverTombstone)
		return
	}
	r.abort(id, q, fmt.Errorf("%w", ErrCancelled), true, r.bug(research.EagerRelease))
}

// abort ends q before it was read. Pages a writer may still write stay
// quarantined until its fence, unless early is set (the eager-release and
// timeout-free bugs).
func (r *Receiver) abort(id RequestID, q *recvRequest, why error, cancelled, early bool) {
	leak := cancelled && r.bug(research.LeakOnCancel)
	switch q.phase {
	case ReceiverReserved:
		r.dropSlot(q, id)
		r.finish(id, q, why)
		switch {
		case leak: // the pages are forgotten, never returned
			r.disown(q)
			r.end(id, q, ReceiverClosed)
		case early: // the bug: the pages go back now, though the record still waits for the fence
			r.freePages(q, id)
			q.phase = ReceiverQuarantine
		default:
			q.phase = ReceiverQuarantine
			r.pool.Quarantine(id, q.refs)
		}
	case ReceiverReady:
		r.finish(id, q, why)
		if leak {
			r.dropSlot(q, id)
			r.disown(q)
			r.end(id, q, ReceiverClosed)
			return
		}
		r.release(q, id) // Done came: the writer is fenced
		r.end(id, q, ReceiverClosed)
	case ReceiverReading:
		// The pages go back when the decoder calls Finish, which then
		// inserts none of them: the request failed, and its decoder may not
		// have written the last prompt position's KV.
		q.cancelled = true
		r.finish(id, q, why)
	}
}

// Tick fails every reserved request whose deadline has passed and tells its
// sender. With a Horizon, it also forgets requests that ended at least that
// long before: a record's age counts from the first Tick that saw it ended.
// Its cost grows with what is due, not with the records kept.
func (r *Receiver) Tick(now time.Time) {
	var due []timer[recvRequest]
	for {
		t, ok := r.deadlines.popDue(now)
		if !ok {
			break
		}
		if q := r.reqs[t.id]; q == t.rec && q.phase == ReceiverReserved && q.deadline.Equal(t.at) {
			due = append(due, t)
		}
	}
	// In request order, as one pass over the records would: effects are deterministic.
	slices.SortFunc(due, func(a, b timer[recvRequest]) int { return cmp.Compare(a.id, b.id) })
	for _, t := range due {
		r.expire(t.id, t.rec)
	}
	if r.cfg.Horizon <= 0 {
		return
	}
	for {
		t, ok := r.horizon.popDue(now)
		if !ok {
			break
		}
		if r.reqs[t.id] == t.rec {
			delete(r.reqs, t.id)
		}
	}
	for { // ended since the last Tick: their age starts now
		t, ok := r.ending.pop()
		if !ok {
			break
		}
		if r.reqs[t.id] == t.rec && t.rec.ended.IsZero() {
			t.rec.ended = now
			r.horizon.push(timer[recvRequest]{at: now.Add(r.cfg.Horizon), id: t.id, rec: t.rec})
		}
	}
}

// remember keeps q as id's record, forgetting the oldest ended records while
// there are more than MaxRecords: no peer can make the records grow without
// bound, whatever the Horizon.
func (r *Receiver) remember(id RequestID, q *recvRequest) {
	r.reqs[id] = q
	for len(r.reqs) > r.cfg.MaxRecords {
		t, ok := r.horizon.pop() // the oldest ended records, then those ended since the last Tick
		if !ok {
			if t, ok = r.ending.pop(); !ok {
				return // every record is at work
			}
		}
		if r.reqs[t.id] == t.rec {
			delete(r.reqs, t.id)
		}
	}
}

// end moves q to a terminal phase and queues it, oldest first: for the next
// Tick to start its age (with a Horizon), and for remember to forget first.
func (r *Receiver) end(id RequestID, q *recvRequest, phase ReceiverStatus) {
	q.phase = phase
	r.ending.push(timer[recvRequest]{id: id, rec: q})
}

// Audit checks the pool's bookkeeping (Pool.Audit), that every request
// holding pins holds them on pages still cached at the epochs it pinned, in
// its scope, and that every cached page's pins are exactly the requests
// that hold it pinned: a pin no request holds would keep a page from
// eviction for ever, a request holding a pin the pool lost could read a
// page reallocated under it. It runs whole even when the cache is empty:
// that is when a lost pin's page is someone else's.
func (r *Receiver) Audit() error {
	if err := r.pool.Audit(); err != nil {
		return err
	}
	pins := map[uint32]int{}
	for id, q := range r.reqs {
		if !q.pinned {
			continue
		}
		for i, ref := range q.prefix {
			if !r.pool.sharedAt(q.scope, ref) {
				return fmt.Errorf("protocol: receiver: request %d holds a pin on page %d at epoch %d (its prefix page %d), no longer cached there in its scope", id, ref.Page, ref.Epoch, i)
			}
			pins[ref.Page]++
		}
	}
	for page := range r.pool.pages {
		_, n, _ := r.pool.Shared(uint32(page))
		if n != pins[uint32(page)] {
			return fmt.Errorf("protocol: receiver: page %d has %d pins, %d requests hold it pinned", page, n, pins[uint32(page)])
		}
	}
	return nil
}

// Records is the number of request records the receiver keeps, live and ended.
func (r *Receiver) Records() int { return len(r.reqs) }

// Expire times request id out now, whatever its deadline: for an engine whose
// own policy (a per-request budget, a router's deadline) decides when a
// reservation has waited too long. Only a reserved request, still waiting for
// Done, can time out; for any other it returns ErrNotReady or
// ErrUnknownRequest and changes nothing.
func (r *Receiver) Expire(id RequestID) error {
	q := r.reqs[id]
	switch {
	case q == nil:
		return fmt.Errorf("%w: %d", ErrUnknownRequest, id)
	case q.phase != ReceiverReserved:
		return fmt.Errorf("%w: request %d is not waiting for Done", ErrNotReady, id)
	}
	r.expire(id, q)
	return nil
}

func (r *Receiver) expire(id RequestID, q *recvRequest) {
	r.abort(id, q, fmt.Errorf("%w: no Done within %v", ErrTimedOut, r.cfg.Timeout), false, r.bug(research.TimeoutFree))
	r.tellSender(q.peer, id, AbortTimedOut)
}

// PeerFailed says a sender is gone (its node crashed or stopped answering).
// Nothing it posted may land once its queue pair is in the error state, so the
// receiver asks for that cut; QueuePairFenced then releases the pages.
func (r *Receiver) PeerFailed(peer PeerID) {
	r.purge(peer)
	if !r.bug(research.NoPeerCancel) {
		r.effects.Cuts = append(r.effects.Cuts, peer)
	}
}

// QueuePairFenced says the queue pair to peer is in the error state (cut by the
// caller, or broken and flushed): nothing more of it can land. Every request on
// it that was waiting for Done fails; quarantined pages are released. Records
// that ended are left alone, as the spec's cut leaves them (under double-free
// a fence of one would release its pages again).
func (r *Receiver) QueuePairFenced(peer PeerID) {
	r.purge(peer)
	var on []RequestID // the peer's requests, in request order: effects are deterministic
	for id, q := range r.reqs {
		if q.peer == peer && (q.phase == ReceiverReserved || q.phase == ReceiverQuarantine) {
			on = append(on, id)
		}
	}
	slices.Sort(on)
	for _, id := range on {
		r.fence(id, r.reqs[id], fmt.Errorf("%w: queue pair to peer %d fenced", ErrPeerFailed, peer))
	}
}

// purge takes the pages peer wrote out of the prefix cache, for a peer
// found failed or misbehaving (PeerFailed, QueuePairFenced, a verification
// failure, an unauthorized Bootstrap): verification proves who wrote a
// page, not that it is the prompt's KV, so a writer caught is no longer
// trusted for what it wrote before. Unpinned pages are freed, pinned ones
// leave the index and are freed at their last unpin (Pool.PurgeWriter),
// and its verified requests not yet finished will insert nothing.
func (r *Receiver) purge(peer PeerID) {
	r.pool.PurgeWriter(peer)
	for _, q := range r.reqs {
		if q.peer == peer && (q.phase == ReceiverReserved || q.phase == ReceiverReady || q.phase == ReceiverReading) {
			q.cancelled = true
		}
	}
}

// Acquire hands a verified request's pages to the decoder: the whole
// prompt's, the pinned prefix pages first, then the written ones. It checks
// each at read time: a written page is still the request's at the epoch it
// was granted (Pool.Check), a prefix page is still cached at the epoch it
// was pinned at, under the request's scope, and pinned (Pool.CheckShared).
// The prefix pages are shared: the decoder only reads them. The pages stay
// the request's until Finish.
func (r *Receiver) Acquire(id RequestID) ([]PageRef, error) {
	q := r.reqs[id]
	if q == nil || q.phase != ReceiverReady {
		return nil, fmt.Errorf("%w: request %d", ErrNotReady, id)
	}
	if !r.bug(research.NoTagCheck) {
		for _, ref := range q.prefix {
			if err := r.pool.CheckShared(q.scope, ref); err != nil {
				return nil, r.failRead(id, q, err)
			}
		}
		for _, ref := range q.refs {
			if err := r.pool.Check(id, ref); err != nil {
				return nil, r.failRead(id, q, err)
			}
		}
	}
	q.phase = ReceiverReading
	refs := make([]PageRef, 0, len(q.prefix)+len(q.refs))
	return append(append(refs, q.prefix...), q.refs...), nil
}

// failRead ends a request whose read-time check failed.
func (r *Receiver) failRead(id RequestID, q *recvRequest, err error) error {
	r.release(q, id)
	r.end(id, q, ReceiverClosed)
	r.finish(id, q, err)
	return err
}

// Finish ends a read: the prefix pins are dropped, the request's written
// full prompt pages whose keys are not cached yet become cached pages of its
// scope (rule 24), the other pages go back to the pool, and the request
// succeeds. A request cancelled (or timed out, or failed) while being read
// keeps its outcome and inserts nothing: its pins go and its pages are
// released.
func (r *Receiver) Finish(id RequestID) error {
	q := r.reqs[id]
	if q == nil || q.phase != ReceiverReading {
		return fmt.Errorf("%w: request %d is not being read", ErrNotReady, id)
	}
	if !q.cancelled && len(q.chain) > 0 && !r.pool.anyPurged(q.prefix) {
		insert := q.chain[min(len(q.prefix), len(q.chain)):]
		for j, ref := range q.refs[:min(len(q.refs), len(insert))] {
			if r.pool.InsertFrom(id, ref, q.scope, insert[j], q.peer) {
				r.stats.PrefixInsertions++
			}
		}
		r.pool.TouchChain(q.scope, q.chain) // root most recent: evicted leaf first
	}
	q.chain = nil
	r.release(q, id)
	r.end(id, q, ReceiverFinished)
	r.finish(id, q, nil)
	return nil
}

// ReceiverStatus is a request's state on a Receiver, as Status reports it.
type ReceiverStatus uint8

// The receiver's request states. A request a Receiver has no record of
// (never bootstrapped, refused at intake, or forgotten after its Horizon) is
// ReceiverNone.
const (
	ReceiverNone       ReceiverStatus = iota
	ReceiverTombstone                 // cancelled before its Bootstrap came
	ReceiverReserved                  // pages granted, waiting for Done
	ReceiverReady                     // verified, waiting to be read
	ReceiverReading                   // acquired by the decoder
	ReceiverQuarantine                // ended while its writer may still write: waiting for the fence
	ReceiverFinished                  // read and released
	ReceiverClosed                    // ended with an error, pages released
)

func (s ReceiverStatus) String() string {
	if int(s) < len(receiverStatusNames) {
		return receiverStatusNames[s]
	}
	return fmt.Sprintf("ReceiverStatus(%d)", uint8(s))
}

var receiverStatusNames = [...]string{"none", "tombstone", "reserved", "ready", "reading", "quarantine", "finished", "closed"}

// Pages is request id's pages as its record holds them: the cached pages
// of its prefix hit (pinned while it lives), then the fresh pages it was
// granted, each at its epoch; nil for a request without a record. For
// audits and the refinement mapping (package model).
func (r *Receiver) Pages(id RequestID) (prefix, fresh []PageRef) {
	if q := r.reqs[id]; q != nil {
		return q.prefix, q.refs
	}
	return nil, nil
}

// Status is request id's state on this node.
func (r *Receiver) Status(id RequestID) ReceiverStatus {
	q := r.reqs[id]
	if q == nil {
		return ReceiverNone
	}
	return q.phase
}

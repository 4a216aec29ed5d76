package protocol

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
)

// SourceMemory gives the sender read access to its source pages, to checksum
// them into tag records.
type SourceMemory interface {
	Page(page uint32) []byte
}

// SenderConfig configures a Sender.
type SenderConfig struct {
	Pages       int // source pages: the prefill node's own KV pool
	PageTokens  int // tokens of KV per page
	MaxTokens   int // intake limit in tokens; 0 means Pages*PageTokens
	MaxInFlight int // WRITEs posted and not completed, per request; 0 means 8
	// Horizon is how long a request's record is kept after it ended
	// (finished, aborted or failed, with every WRITE completed); Tick forgets
	// older ones. 0 keeps every record forever. A Grant for a forgotten
	// request is answered with AbortAck, as for any unknown one.
	Horizon time.Duration
	Memory  SourceMemory // the source pages, for checksums
	// TagKeys returns the tag key of the queue pair to peer (agreed over the
	// nodes' authenticated connection setup), or nil while there is none.
	// Required: a request for a peer without a key is refused with
	// ErrNoPeerKey, so an engine that forgets to hand a key over finds out at
	// its first request. A request keeps the key it was submitted with.
	TagKeys func(peer PeerID) *TagKey
	// Research turns bugs of the catalogue on. Only code inside this module can
	// set it (see internal/research); everywhere else it is the zero value.
	Research research.Switches
}

// Write is an RDMA WRITE to post: the source page's payload to the granted
// remote page, then the tag record to the page's tag slot, in that order on
// the queue pair. Report its completion with Completed(ID, err).
type Write struct {
	ID      uint64
	Request RequestID
	Index   uint32    // page index within the request
	Source  uint32    // local source page
	Remote  PageGrant // the granted page: tag, address, key
	Tag     []byte    // the tag record, TagSize bytes
	record  [TagSize]byte
}

// Op is one operation on the queue pair to Peer: a Write or a Send (exactly one
// is set). Ops must be posted in order: a Done goes behind its WRITEs.
type Op struct {
	Peer  PeerID
	Write *Write
	Msg   Message
}

// SenderEffects are what the caller must do after feeding events in.
type SenderEffects struct {
	Ops      []Op
	Outcomes []Outcome
}

type sendRequest struct {
	phase     SenderStatus
	ended     time.Time // the first Tick that saw the request ended; zero before
	peer      PeerID
	key       *TagKey // the queue pair's tag key when the request was submitted
	tokens    uint32
	src       []PageRef // source pages, in request order
	chain     int       // full pages the request's chain names: the most decode can have cached
	skip      int       // pages decode has (the Grant's prefix): WRITEs start at this index
	computed  int       // pages 0..computed-1 hold complete KV (ComputedPages): only they may be written
	posted    int
	completed int
	failed    error // a WRITE failed: the queue pair is broken
	reported  bool
	// The request's messages and WRITEs live in its record: one allocation
	// per request, not one per message and page.
	bootstrap Bootstrap
	done      Done
	writes    []Write // per page written (index skip+j), from the grant on: where it goes (Remote), then the WRITE
	// placeholder: admit-finished kept a rejected prompt as one token of KV.
	placeholder bool
}

// Sender is the prefill node's side of the handoff, for every request: intake,
// admission of grants, WRITEs with tag records under a bounded window, Done,
// and the abort paths. Source pages are held until every WRITE that reads them
// has completed. Sans-I/O like Receiver; not safe for concurrent use.
type Sender struct {
	cfg     SenderConfig
	pool    *Pool
	reqs    map[RequestID]*sendRequest
	writes  map[uint64]writeKey
	nextID  uint64
	effects SenderEffects
	spare   SenderEffects // the batch before the last, whose slices the next one reuses
	// horizon holds a timer per ended record whose age has started; ending
	// the records that ended since the last Tick.
	horizon queue[sendRequest]
	ending  []timer[sendRequest]
	scratch [16]byte // the tag MAC's working block
}

type writeKey struct {
	req   RequestID
	index uint32
}

// NewSender validates cfg and returns a sender with every source page free.
func NewSender(cfg SenderConfig) (*Sender, error) {
	if cfg.Pages < 1 || cfg.PageTokens < 1 || cfg.Memory == nil || cfg.TagKeys == nil {
		return nil, errors.New("protocol: sender needs Pages, PageTokens, Memory and TagKeys")
	}
	if cfg.MaxTokens == 0 {
		cfg.MaxTokens = cfg.Pages * cfg.PageTokens
	}
	if cfg.MaxInFlight == 0 {
		cfg.MaxInFlight = 8
	}
	return &Sender{cfg: cfg, pool: NewPool(cfg.Pages), reqs: map[RequestID]*sendRequest{}, writes: map[uint64]writeKey{}}, nil
}

// Effects returns the effects accumulated since the last call and clears them.
// Its slices are reused from the second call after this one on: carry what
// they hold (the Ops and Outcomes themselves are never reused) before calling
// Effects twice more.
func (s *Sender) Effects() SenderEffects {
	e := s.effects
	clear(s.spare.Ops)
	clear(s.spare.Outcomes)
	s.effects = SenderEffects{Ops: s.spare.Ops[:0], Outcomes: s.spare.Outcomes[:0]}
	s.spare = e
	return e
}

// Pool is the sender's source page pool, for inspection.
func (s *Sender) Pool() *Pool { return s.pool }

func (s *Sender) finish(id RequestID, q *sendRequest, err error) {
	if !q.reported {
		q.reported = true
		s.effects.Outcomes = append(s.effects.Outcomes, Outcome{Request: id, Err: err})
	}
}

func (s *Sender) send(peer PeerID, m Message) {
	s.effects.Ops = append(s.effects.Ops, Op{Peer: peer, Msg: m})
}

// Submit is the prefill node's intake (docs/protocol.md rule 2): a prompt over its limit is
// rejected for good, never bootstrapped. Otherwise it takes source pages for the
// KV, which it returns in request order for the engine to compute into (then
// call Computed), and announces the request to the receiver at peer.
func (s *Sender) Submit(id RequestID, peer PeerID, tokens int) ([]uint32, error) {
	return s.SubmitTicket(id, peer, tokens, nil)
}

// SubmitTicket is Submit with the router's ticket for the request, which
// its Bootstrap carries to the receiver (a copy: the caller keeps ticket).
// A ticket over MaxTicket bytes is refused (ErrRejected), never sent.
func (s *Sender) SubmitTicket(id RequestID, peer PeerID, tokens int, ticket []byte) ([]uint32, error) {
	return s.SubmitWith(id, peer, tokens, SubmitOptions{Ticket: ticket})
}

// SubmitOptions is what the router dispatched with a request, beyond its
// length, for its Bootstrap to carry.
type SubmitOptions struct {
	// Ticket is the router's signed ticket (at most MaxTicket bytes).
	Ticket []byte
	// Scope is the request's cache scope, from the authenticated tenant (0:
	// no reuse), and Chain its prompt's PrefixChain at this node's page size:
	// empty without a scope, else one hash per full page. Decode reuses the
	// longest run it has cached under Scope and grants only the rest.
	Scope Scope
	Chain []ChainHash
}

// SubmitWith is Submit with what the router dispatched: the ticket, the
// scope and the prompt's chain, which its Bootstrap carries (copies: the
// caller keeps them). A ticket over MaxTicket bytes, or a chain that is not
// one hash per full page (or one without a scope), is refused
// (ErrRejected), never sent.
func (s *Sender) SubmitWith(id RequestID, peer PeerID, tokens int, o SubmitOptions) ([]uint32, error) {
	ticket := o.Ticket
	if len(ticket) > MaxTicket {
		return nil, fmt.Errorf("%w: a ticket of %d bytes, at most %d", ErrRejected, len(ticket), MaxTicket)
	}
	if o.Scope == 0 && len(o.Chain) != 0 || o.Scope != 0 && tokens >= 0 && len(o.Chain) != tokens/s.cfg.PageTokens {
		return nil, fmt.Errorf("%w: %w: %d hashes for %d tokens in pages of %d, scope %#x", ErrRejected, ErrBadChain,
			len(o.Chain), tokens, s.cfg.PageTokens, uint64(o.Scope))
	}
	if s.reqs[id] != nil {
		return nil, fmt.Errorf("%w: request %d", ErrDuplicate, id)
	}
	placeholder := false
	if tokens < 1 || tokens > s.cfg.MaxTokens || tokens > MaxTokens {
		if !s.cfg.Research.Has(research.AdmitFinished) || tokens < 1 || tokens > MaxTokens {
			return nil, fmt.Errorf("%w: %w: %d tokens, this node takes 1..%d", ErrRejected, ErrTooLong, tokens, s.cfg.MaxTokens)
		}
		// The incident: marked rejected, swapped for a one-token placeholder,
		// and admitted anyway because admission asks "finished?".
		placeholder = true
	}
	n := PagesFor(uint32(tokens), s.cfg.PageTokens)
	if n > MaxGrantPages {
		return nil, fmt.Errorf("%w: %w: %d tokens need %d pages, a grant carries %d", ErrRejected, ErrTooManyPages, tokens, n, MaxGrantPages)
	}
	if placeholder {
		n = 1
	}
	key := s.cfg.TagKeys(peer)
	if key == nil {
		return nil, fmt.Errorf("%w: peer %d", ErrNoPeerKey, peer)
	}
	src, err := s.pool.Allocate(id, n)
	if err != nil {
		return nil, err
	}
	q := &sendRequest{phase: SenderAwaitGrant, peer: peer, key: key, tokens: uint32(tokens), src: src, placeholder: placeholder}
	s.reqs[id] = q
	q.bootstrap = Bootstrap{Request: id, Tokens: uint32(tokens), Scope: o.Scope}
	if len(ticket) > 0 {
		q.bootstrap.Ticket = slices.Clone(ticket)
	}
	if placeholder {
		q.bootstrap.Scope = 0 // the placeholder's KV is not the prompt's: nothing of it may be shared
	} else if len(o.Chain) > 0 {
		q.chain = len(o.Chain)
		q.bootstrap.Chain = slices.Clone(o.Chain)
	}
	s.send(peer, &q.bootstrap)
	pages := make([]uint32, n)
	for i, ref := range src {
		pages[i] = ref.Page
	}
	return pages, nil
}

// Computed says the request's KV is in its source pages, every page of it:
// ComputedPages(id, all). WRITEs start once the grant is admitted too. For a
// request that has ended it changes nothing.
func (s *Sender) Computed(id RequestID) error {
	q := s.reqs[id]
	if q == nil {
		return fmt.Errorf("%w: %d", ErrUnknownRequest, id)
	}
	return s.ComputedPages(id, len(q.src))
}

// ComputedPages says the first n source pages of request id, in request
// order, now hold complete KV in every layer (rule 25): a prefill that
// computes the prompt a chunk at a time calls it after each chunk, and each
// granted page's WRITE is posted as soon as its page is computed, so the
// transfer runs behind the computation instead of after it. Done goes only
// once every page is computed and every WRITE posted. n counts every page
// of the prompt, the prefix a Grant says decode holds included (those pages
// are computed, never written). n only grows: 1 <= n <= the request's source
// pages, and not below an earlier n (repeating it changes nothing); anything
// else is ErrBadComputed and changes nothing. An unknown request is
// ErrUnknownRequest. For a request that has ended (aborted, failed,
// finished, or aborting behind its posted WRITEs) it changes nothing and
// returns nil: a driver that computes in chunks asks Status whether the
// request is still live before the next chunk, and stops when it is not.
//
// Between two calls the driver must not feed the Sender an event that could
// end the request (a Grant, an Abort, a Cancel, a flush) while a chunk is
// being computed: hold those until the chunk is done, as for Computed.
func (s *Sender) ComputedPages(id RequestID, n int) error {
	q := s.reqs[id]
	if q == nil {
		return fmt.Errorf("%w: %d", ErrUnknownRequest, id)
	}
	switch q.phase {
	case SenderAwaitGrant, SenderWriting, SenderDoneSent:
	default:
		return nil // ended: nothing of it is written any more
	}
	if n < 1 || n > len(q.src) || n < q.computed {
		return fmt.Errorf("%w: request %d: %d pages computed, it has %d and %d were computed before", ErrBadComputed, id, n, len(q.src), q.computed)
	}
	q.computed = n
	s.post(id, q)
	return nil
}

// Step handles a message from the receiver at peer.
func (s *Sender) Step(peer PeerID, m Message) error {
	if err := validate(m); err != nil {
		return err
	}
	switch m := m.(type) {
	case *Grant:
		return s.admit(peer, m)
	case *Abort:
		q := s.reqs[m.Request]
		if q == nil {
			return fmt.Errorf("%w: %d", ErrUnknownRequest, m.Request)
		}
		if q.peer != peer {
			return fmt.Errorf("%w: request %d", ErrWrongPeer, m.Request)
		}
		s.abort(m.Request, q, fmt.Errorf("%w: %w", ErrPeerFailed, m.Reason))
		return nil
	}
	return fmt.Errorf("%w: %s to a sender", ErrUnexpectedMessage, m.Type())
}

// admit checks a grant against the sender's own view of the request (rule 4).
func (s *Sender) admit(peer PeerID, g *Grant) error {
	id := g.Request
	q := s.reqs[id]
	if q == nil {
		// Nothing of ours will ever write these pages: say so, or the
		// receiver keeps them until a timeout.
		s.send(peer, &AbortAck{Request: id})
		return fmt.Errorf("%w: Grant for request %d", ErrUnknownRequest, id)
	}
	if q.peer != peer {
		return fmt.Errorf("%w: Grant for request %d", ErrWrongPeer, id)
	}
	switch q.phase {
	case SenderAwaitGrant:
	case SenderAborted, SenderFailed:
		s.send(peer, &AbortAck{Request: id}) // nothing was posted
		return nil
	default:
		return fmt.Errorf("%w: second Grant for request %d", ErrDuplicate, id)
	}
	var refuse error
	pt := s.cfg.PageTokens
	k, n := int(g.Prefix)/pt, PagesFor(q.tokens, pt)
	skip := k
	if s.cfg.Research.Has(research.PrefixCountMismatch) && k > 0 {
		skip = k + 1 // the bug: the sender counts the prefix a page longer, and checks nothing
	}
	if g.Tokens != q.tokens || g.Prefix == 0 && len(g.Pages) != n {
		refuse = fmt.Errorf("%w: Grant for %d tokens in %d pages, the request is %d tokens in %d pages",
			ErrTokenMismatch, g.Tokens, len(g.Pages), q.tokens, len(q.src))
	} else if s.cfg.Research.Has(research.PrefixCountMismatch) {
		if len(g.Pages) < n-skip || skip > n { // only what indexing needs: a skip of every page posts Done at once
			refuse = fmt.Errorf("%w: Grant of %d pages, %d to write", ErrBadGrant, len(g.Pages), n-skip)
		}
	} else if int(g.Prefix)%pt != 0 || k > q.chain || len(g.Pages) != n-k {
		// Rule 4: decode can only have whole pages of the chain this request
		// sent, and must grant every page past them.
		refuse = fmt.Errorf("%w: Grant for request %d says %d tokens are present in %d pages of %d tokens (%d full), and grants %d of the %d pages past them",
			ErrBadGrant, id, g.Prefix, n, pt, q.chain, len(g.Pages), n-k)
	}
	if i, j, ok := repeatedPage(g.Pages); ok && refuse == nil {
		refuse = fmt.Errorf("%w: Grant for request %d names page %d (address %#x, key %#x) twice, at indices %d and %d",
			ErrBadGrant, id, g.Pages[j].Page, g.Pages[j].Addr, g.Pages[j].Key, i, j)
	}
	if refuse != nil {
		// Nothing was posted: AbortAck is the receiver's fence, and its leg fails too.
		s.pool.Release(id, q.src)
		s.end(id, q, SenderFailed)
		s.finish(id, q, refuse)
		s.send(peer, &AbortAck{Request: id})
		return nil
	}
	q.skip = skip
	q.writes = make([]Write, len(q.src)-skip) // len(q.src) is n but for admit-finished's placeholder
	for i := range q.writes {
		q.writes[i].Remote = g.Pages[i]
	}
	q.phase = SenderWriting
	s.post(id, q)
	return nil
}

// repeatedPage finds two grants of one page, by page number or by remote
// address and key: their WRITEs would land on one page, and one page's KV
// would be read as two.
func repeatedPage(pages []PageGrant) (i, j int, found bool) {
	if len(pages) <= 16 { // the common small grant: no allocation
		for j := range pages {
			for i := range j {
				if pages[i].Page == pages[j].Page || pages[i].Addr == pages[j].Addr && pages[i].Key == pages[j].Key {
					return i, j, true
				}
			}
		}
		return 0, 0, false
	}
	type place struct {
		addr uint64
		key  uint32
	}
	byPage := make(map[uint32]int, len(pages))
	byPlace := make(map[place]int, len(pages))
	for j, p := range pages {
		if i, ok := byPage[p.Page]; ok {
			return i, j, true
		}
		if i, ok := byPlace[place{p.Addr, p.Key}]; ok {
			return i, j, true
		}
		byPage[p.Page], byPlace[place{p.Addr, p.Key}] = j, j
	}
	return 0, 0, false
}

// post posts the WRITEs of computed pages up to the in-flight bound (rule
// 25), then Done once every page is computed and its WRITE posted.
func (s *Sender) post(id RequestID, q *sendRequest) {
	if q.phase != SenderWriting || q.computed == 0 || q.failed != nil { // nothing more on a broken queue pair
		return
	}
	computed := q.computed
	if s.cfg.Research.Has(research.WriteUncomputed) {
		computed = len(q.src) // the bug: the first chunk's completion taken for the prompt's
	}
	for q.posted < len(q.writes) && q.skip+q.posted < computed && q.posted-q.completed < s.cfg.MaxInFlight {
		w := &q.writes[q.posted]
		i := q.skip + q.posted // the page's index in the request: the prefix is not written
		src := q.src[i].Page
		payload := s.cfg.Memory.Page(src)
		tokens := TokensInPage(q.tokens, s.cfg.PageTokens, i)
		if q.placeholder {
			tokens = 1
		}
		tag := Tag{Request: id, Epoch: w.Remote.Epoch, Index: uint32(i), Tokens: tokens, Sum: q.key.Sum(payload)}
		s.nextID++
		w.ID, w.Request, w.Index, w.Source = s.nextID, id, uint32(i), src
		w.Tag = tag.appendMAC(w.record[:0], q.key, &s.scratch)
		s.writes[w.ID] = writeKey{id, uint32(i)}
		s.effects.Ops = append(s.effects.Ops, Op{Peer: q.peer, Write: w})
		q.posted++
	}
	if q.posted == len(q.writes) && q.computed == len(q.src) {
		s.sendDone(id, q)
	}
}

// sendDone posts Done behind the request's WRITEs (rule 6).
func (s *Sender) sendDone(id RequestID, q *sendRequest) {
	tokens := q.tokens
	if q.placeholder {
		tokens = 1
	}
	q.done = Done{Request: id, Tokens: tokens, Pages: uint32(len(q.writes)), Prefix: uint32(q.skip * s.cfg.PageTokens)}
	s.send(q.peer, &q.done)
	q.phase = SenderDoneSent
	if s.cfg.Research.Has(research.PrefillEarlyFree) {
		s.pool.Release(id, q.src) // before the WRITEs that read them complete
	}
	s.settle(id, q)
}

// Completed reports a WRITE's completion; err is non-nil for a failed or
// flushed WRITE, which means the queue pair is broken.
func (s *Sender) Completed(writeID uint64, err error) error {
	k, ok := s.writes[writeID]
	if !ok {
		return fmt.Errorf("%w: completion for unknown WRITE %d", ErrUnknownRequest, writeID)
	}
	delete(s.writes, writeID)
	q := s.reqs[k.req]
	q.completed++
	if err != nil && q.failed == nil {
		q.failed = fmt.Errorf("%w: WRITE of page %d: %w", ErrPeerFailed, k.index, err)
	}
	s.post(k.req, q)
	s.settle(k.req, q)
	return nil
}

// settle ends a leg once every WRITE it posted has completed: only then may its
// source pages be reused.
func (s *Sender) settle(id RequestID, q *sendRequest) {
	if q.completed != q.posted {
		return
	}
	switch {
	case q.failed != nil && (q.phase == SenderWriting || q.phase == SenderDoneSent || q.phase == SenderAborting):
		s.pool.Release(id, q.src)
		s.end(id, q, SenderFailed)
		s.finish(id, q, q.failed)
	case q.phase == SenderDoneSent:
		s.pool.Release(id, q.src)
		s.end(id, q, SenderFinished)
		s.finish(id, q, nil)
	case q.phase == SenderAborting:
		s.pool.Release(id, q.src)
		s.end(id, q, SenderAborted)
		s.send(q.peer, &AbortAck{Request: id})
	}
}

// Tick forgets, with a Horizon, requests that ended at least that long before
// now: a record's age counts from the first Tick that saw it ended with every
// WRITE completed. The sender has no timers of its own; Tick is only this, and
// it costs what is due, not a visit of every record.
func (s *Sender) Tick(now time.Time) {
	if s.cfg.Horizon <= 0 {
		return
	}
	for {
		t, ok := s.horizon.popDue(now)
		if !ok {
			break
		}
		if s.reqs[t.id] == t.rec {
			delete(s.reqs, t.id)
		}
	}
	waiting := s.ending[:0]
	for _, t := range s.ending {
		switch q := t.rec; {
		case s.reqs[t.id] != q || !q.ended.IsZero():
		case q.completed != q.posted: // not settled yet: look again next Tick
			waiting = append(waiting, t)
		default:
			q.ended = now
			s.horizon.push(timer[sendRequest]{at: now.Add(s.cfg.Horizon), id: t.id, rec: q})
		}
	}
	clear(s.ending[len(waiting):])
	s.ending = waiting
}

// end moves q to a terminal phase and, with a Horizon, queues it for the next
// Tick to start its age.
func (s *Sender) end(id RequestID, q *sendRequest, phase SenderStatus) {
	q.phase = phase
	if s.cfg.Horizon > 0 {
		s.ending = append(s.ending, timer[sendRequest]{id: id, rec: q})
	}
}

// Records is the number of request records the sender keeps, live and ended.
func (s *Sender) Records() int { return len(s.reqs) }

// Cancel stops a request at the client's or router's request.
func (s *Sender) Cancel(id RequestID) {
	if q := s.reqs[id]; q != nil {
		s.abort(id, q, fmt.Errorf("%w", ErrCancelled))
	}
}

func (s *Sender) abort(id RequestID, q *sendRequest, why error) {
	switch q.phase {
	case SenderAwaitGrant:
		// No grant, no WRITE: a grant that comes later is answered AbortAck.
		s.pool.Release(id, q.src)
		s.end(id, q, SenderAborted)
		s.finish(id, q, why)
	case SenderWriting, SenderDoneSent:
		s.finish(id, q, why)
		if q.phase == SenderWriting && s.cfg.Research.Has(research.AbortStillSends) {
			s.sendDone(id, q) // stops writing, but claims the transfer is complete
			return
		}
		if q.completed != q.posted && s.cfg.Research.Has(research.AbortFreesSource) {
			s.pool.Release(id, q.src) // the producer's timeout frees what posted WRITEs still read
		}
		q.phase = SenderAborting
		s.settle(id, q)
	case SenderFinished:
		s.send(q.peer, &AbortAck{Request: id}) // idempotent: Done is already on its way
	}
}

// Flushed says the queue pair to peer broke and every WRITE on it has completed
// (with flush errors, reported through Completed or not at all): every request
// on it fails, and its source pages are free again.
func (s *Sender) Flushed(peer PeerID) {
	live := func(q *sendRequest) bool {
		return q != nil && q.peer == peer && (q.phase == SenderAwaitGrant || q.phase == SenderWriting || q.phase == SenderDoneSent || q.phase == SenderAborting)
	}
	var on []RequestID // the peer's live requests, in request order: effects are deterministic
	for id, q := range s.reqs {
		if live(q) {
			on = append(on, id)
		}
	}
	if len(on) == 0 {
		return
	}
	slices.Sort(on)
	for wid, k := range s.writes { // one pass: the flush completes their WRITEs
		if live(s.reqs[k.req]) {
			delete(s.writes, wid)
		}
	}
	for _, id := range on {
		q := s.reqs[id]
		q.completed = q.posted // the flush completes every posted WRITE
		s.pool.Release(id, q.src)
		s.end(id, q, SenderFailed)
		s.finish(id, q, fmt.Errorf("%w: queue pair to peer %d flushed", ErrPeerFailed, peer))
	}
}

// SenderStatus is a request's state on a Sender, as Status reports it.
type SenderStatus uint8

// The sender's request states. A request a Sender has no record of (never
// submitted, refused at intake, or forgotten after its Horizon) is
// SenderNone.
const (
	SenderNone       SenderStatus = iota
	SenderAwaitGrant              // Bootstrap sent
	SenderWriting                 // grant admitted; each page's WRITE posted once the page is computed
	SenderDoneSent                // Done posted, WRITEs completing
	SenderAborting                // stopped; waiting for posted WRITEs before AbortAck
	SenderFinished                // handed off, every WRITE completed
	SenderAborted                 // stopped on a cancel or the receiver's Abort
	SenderFailed                  // failed (a WRITE, a flush, a bad grant)
)

func (s SenderStatus) String() string {
	if int(s) < len(senderStatusNames) {
		return senderStatusNames[s]
	}
	return fmt.Sprintf("SenderStatus(%d)", uint8(s))
}

var senderStatusNames = [...]string{"none", "awaiting-grant", "writing", "done-sent", "aborting", "finished", "aborted", "failed"}

// Status is request id's state on this node.
func (s *Sender) Status(id RequestID) SenderStatus {
	q := s.reqs[id]
	if q == nil {
		return SenderNone
	}
	return q.phase
}

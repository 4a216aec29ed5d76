package node

import (
	"bytes"
	"crypto/ed25519"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// A ticket is the router's signed word that it dispatched a request: which
// request, of how many tokens, in which prefix cache scope with which prompt
// chain, from which prefill node to which decode node, until when
// (docs/security.md). The router signs one for each dispatch
// with the deployment's ticket key (pki.WriteTicketKey; ed25519), the
// prefill node carries it in the request's Bootstrap (protocol.Bootstrap's
// Ticket), and the decode node, which holds only the public half, reserves
// pages only for a Bootstrap whose ticket is valid, for it, from the queue
// pair's own peer, and seen for the first time, and whose scope and chain
// are the ones the router set (a prefill node cannot claim another
// tenant's scope, nor a chain the router did not compute).
//
// Encoding (big-endian), all of it signed:
//
//	"KVT2" | request u64 | tokens u32 | expires (Unix ns) i64 |
//	scope u64 | chain digest (32 bytes) |
//	len u8 | prefill | len u8 | decode | ed25519 signature (64 bytes)
type Ticket struct {
	Request protocol.RequestID
	Tokens  uint32
	Prefill string // the prefill node the router dispatched it to
	Decode  string // the decode node it reserves on
	Expires time.Time
	// Scope is the request's prefix cache scope (0: no reuse), and Chain
	// the SHA-256 over its prompt's chain hashes, concatenated, or zero
	// for a request without a chain (scope.go).
	Scope protocol.Scope
	Chain [32]byte
}

// ticketMagic names the encoding; a KVT1 ticket (without scope and chain)
// is refused as forged: its requests were never scoped by this router.
const ticketMagic = "KVT2"

// ticketFixed is the encoding's fixed part: magic, request, tokens,
// expiry, scope, chain digest.
const ticketFixed = len(ticketMagic) + 8 + 4 + 8 + 8 + 32

// Why a decode node refuses a Bootstrap's ticket: each wraps ErrTicket.
var (
	// ErrTicket: the Bootstrap has no valid ticket from the router.
	ErrTicket = errors.New("node: no valid ticket")
	// ErrNoTicket: the Bootstrap carries none.
	ErrNoTicket = fmt.Errorf("%w: the Bootstrap carries no ticket", ErrTicket)
	// ErrTicketForged: not a ticket, or its signature is not the router's.
	ErrTicketForged = fmt.Errorf("%w: not signed by the router's ticket key", ErrTicket)
	// ErrTicketExpired: the ticket's time is past.
	ErrTicketExpired = fmt.Errorf("%w: expired", ErrTicket)
	// ErrTicketMisrouted: the ticket is for another decode node, or was
	// given to another prefill node than the one that sent it.
	ErrTicketMisrouted = fmt.Errorf("%w: for another node", ErrTicket)
	// ErrTicketMismatch: the ticket is for another request or token count.
	ErrTicketMismatch = fmt.Errorf("%w: for another request or token count", ErrTicket)
	// ErrTicketReplayed: a ticket for a request this node has seen one for.
	ErrTicketReplayed = fmt.Errorf("%w: replayed (a request already seen)", ErrTicket)
	// ErrTicketScope: the Bootstrap's cache scope or prefix chain is not
	// the one the router dispatched the request with.
	ErrTicketScope = fmt.Errorf("%w: for another cache scope or prompt chain", ErrTicket)
)

func (t Ticket) body() ([]byte, error) {
	if len(t.Prefill) > 255 || len(t.Decode) > 255 {
		return nil, fmt.Errorf("node: ticket: node names of %d and %d bytes, at most 255", len(t.Prefill), len(t.Decode))
	}
	b := make([]byte, 0, ticketFixed+2+len(t.Prefill)+len(t.Decode)+ed25519.SignatureSize)
	b = append(b, ticketMagic...)
	b = binary.BigEndian.AppendUint64(b, uint64(t.Request))
	b = binary.BigEndian.AppendUint32(b, t.Tokens)
	b = binary.BigEndian.AppendUint64(b, uint64(t.Expires.UnixNano()))
	b = binary.BigEndian.AppendUint64(b, uint64(t.Scope))
	b = append(b, t.Chain[:]...)
	b = append(b, byte(len(t.Prefill)))
	b = append(b, t.Prefill...)
	b = append(b, byte(len(t.Decode)))
	return append(b, t.Decode...), nil
}

// SignTicket encodes t and signs it with the router's ticket key.
func SignTicket(key ed25519.PrivateKey, t Ticket) ([]byte, error) {
	b, err := t.body()
	if err != nil {
		return nil, err
	}
	out := append(b, ed25519.Sign(key, b)...)
	if len(out) > protocol.MaxTicket {
		return nil, fmt.Errorf("node: ticket of %d bytes, a Bootstrap carries %d", len(out), protocol.MaxTicket)
	}
	return out, nil
}

// OpenTicket checks b's signature against the ticket key's public half and
// decodes it; anything else is ErrTicketForged. Nothing is allocated on
// b's word but the two names, at most 255 bytes each.
func OpenTicket(pub ed25519.PublicKey, b []byte) (Ticket, error) {
	var t Ticket
	if len(b) < ticketFixed+2+ed25519.SignatureSize || !bytes.HasPrefix(b, []byte(ticketMagic)) {
		return t, fmt.Errorf("%w (%d bytes)", ErrTicketForged, len(b))
	}
	body, sig := b[:len(b)-ed25519.SignatureSize], b[len(b)-ed25519.SignatureSize:]
	if !ed25519.Verify(pub, body, sig) {
		return t, ErrTicketForged
	}
	r := body[len(ticketMagic):]
	t.Request = protocol.RequestID(binary.BigEndian.Uint64(r))
	t.Tokens = binary.BigEndian.Uint32(r[8:])
	t.Expires = time.Unix(0, int64(binary.BigEndian.Uint64(r[12:])))
	t.Scope = protocol.Scope(binary.BigEndian.Uint64(r[20:]))
	copy(t.Chain[:], r[28:60])
	r = r[60:]
	str := func() (string, bool) {
		if len(r) < 1 || len(r) < 1+int(r[0]) {
			return "", false
		}
		s := string(r[1 : 1+int(r[0])])
		r = r[1+int(r[0]):]
		return s, true
	}
	var ok1, ok2 bool
	t.Prefill, ok1 = str()
	t.Decode, ok2 = str()
	if !ok1 || !ok2 || len(r) != 0 {
		// Signed by the key, yet not a ticket: not one this code signs.
		return Ticket{}, fmt.Errorf("%w: malformed", ErrTicketForged)
	}
	return t, nil
}

// DefaultTicketSkew is how far a decode node's clock may run ahead of the
// router's before a fresh ticket reads as expired.
const DefaultTicketSkew = 5 * time.Second

// maxTicketsSeen bounds the request ids a TicketChecker remembers: each is
// one the router signed and this node took, kept until its ticket expires;
// past the bound a Bootstrap is refused (ErrTicketReplayed) rather than a
// replay let through or memory grown: 2^20 ids are 2^20 requests within
// one ticket's life.
const maxTicketsSeen = 1 << 20

// TicketChecker is a decode node's ticket check (transfer.Admission's
// Authorize): the ticket is the router's, for this node, from the queue
// pair's own prefill node, for this request and token count, in the
// Bootstrap's scope with its chain (or none: no reuse), unexpired, and its
// request is seen here for the first time. Safe for concurrent use.
type TicketChecker struct {
	pub  ed25519.PublicKey
	self string
	skew time.Duration
	now  func() time.Time

	mu    sync.Mutex
	seen  map[protocol.RequestID]time.Time // until when each is kept
	order []seenTicket                     // oldest first: tickets expire in about the order they come
	head  int
}

type seenTicket struct {
	id    protocol.RequestID
	until time.Time
}

// NewTicketChecker checks tickets for the decode node self against the
// ticket key's public half.
func NewTicketChecker(pub ed25519.PublicKey, self string) *TicketChecker {
	return &TicketChecker{pub: pub, self: self, skew: DefaultTicketSkew, now: time.Now, seen: map[protocol.RequestID]time.Time{}}
}

// Check is nil if b may reserve on this node, coming from the prefill node
// named peer; else why not, wrapping ErrTicket.
func (c *TicketChecker) Check(peer string, b *protocol.Bootstrap) error {
	if len(b.Ticket) == 0 {
		return ErrNoTicket
	}
	t, err := OpenTicket(c.pub, b.Ticket)
	if err != nil {
		return err
	}
	now := c.now()
	switch {
	case t.Decode != c.self:
		return fmt.Errorf("%w: for decode node %q, this is %q", ErrTicketMisrouted, t.Decode, c.self)
	case t.Prefill != peer:
		return fmt.Errorf("%w: given to prefill node %q, sent by %q", ErrTicketMisrouted, t.Prefill, peer)
	case t.Request != b.Request || t.Tokens != b.Tokens:
		return fmt.Errorf("%w: the ticket is request %d of %d tokens, the Bootstrap request %d of %d", ErrTicketMismatch, t.Request, t.Tokens, b.Request, b.Tokens)
	case (b.Scope != 0 || len(b.Chain) != 0) && (t.Scope != b.Scope || t.Chain != chainDigest(b.Chain)):
		// A Bootstrap without a scope asks for no reuse (it neither reads
		// nor fills the cache: the placeholder of admit-finished is one), so
		// only a scope or chain it does carry must be the router's.
		return fmt.Errorf("%w: the ticket is scope %#x, the Bootstrap scope %#x (or its chain of %d hashes is not the router's)", ErrTicketScope, uint64(t.Scope), uint64(b.Scope), len(b.Chain))
	case now.After(t.Expires.Add(c.skew)):
		return fmt.Errorf("%w: at %v, %v ago", ErrTicketExpired, t.Expires.UTC().Format(time.RFC3339Nano), now.Sub(t.Expires).Round(time.Millisecond))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.forget(now)
	if _, ok := c.seen[t.Request]; ok {
		return fmt.Errorf("%w: request %d", ErrTicketReplayed, t.Request)
	}
	if len(c.seen) >= maxTicketsSeen {
		return fmt.Errorf("%w: %d live tickets remembered, the most this node keeps", ErrTicketReplayed, len(c.seen))
	}
	until := t.Expires.Add(c.skew)
	c.seen[t.Request] = until
	c.order = append(c.order, seenTicket{t.Request, until})
	return nil
}

// forget drops the ids whose tickets have expired (from the oldest on; one
// that expires later than a newer one stays a little longer, harmlessly).
func (c *TicketChecker) forget(now time.Time) {
	for c.head < len(c.order) && now.After(c.order[c.head].until) {
		delete(c.seen, c.order[c.head].id)
		c.head++
	}
	if c.head > len(c.order)/2 && c.head > 1024 {
		c.order = append(c.order[:0], c.order[c.head:]...)
		c.head = 0
	}
}

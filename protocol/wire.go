package protocol

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
)

// Version is the wire format version this package speaks. Version 4's
// messages are version 3's; its queue pair's hello (transfer's setup) names
// the node's incarnation, so that a cut of a lost life spares the next
// one's queue pair. Version 3's Bootstrap carries the request's cache scope
// and prefix chain, its Grant and Done the prefix length (docs/protocol.md,
// "Prefix reuse"); version 2's carried a ticket but no prefix. A frame of
// any other version is refused (ErrVersion), never read as this one.
const Version = 4

// Limits on every length the wire carries. A frame that exceeds one is an error,
// and nothing larger than these is ever allocated while decoding.
const (
	HeaderSize    = 6             // version, type, body length (uint32)
	MaxBody       = 4 << 20       // bytes in one frame's body
	MaxGrantPages = 1 << 17       // pages in one grant: 131072
	MaxTokens     = 1<<31 - 1     // tokens in one request
	MaxTicket     = 1024          // bytes of a Bootstrap's ticket
	grantPageSize = 4 + 8 + 8 + 4 // page, epoch, address, key
	chainHashSize = 16
)

// Scope is the prefix cache's namespace: decode shares cached pages only
// between requests of one scope. The router derives it from the
// authenticated tenant (or a declared public prefix); a request never names
// its own. 0 means "no reuse": such a request neither hits nor is inserted.
type Scope uint64

// ChainHash names a prompt's whole prefix up to and including one full page
// (see PrefixChain): two requests whose prompts agree on their first i+1
// pages have equal hashes at index i, like a path in a radix tree.
type ChainHash [chainHashSize]byte

// chainDomain separates the chain's hashes from every other use of SHA-256.
const chainDomain = "kvhandoff/chain/v1"

// PrefixChain is the chain of a prompt: one hash per full page of
// pageTokens tokens, in order (a last partial page has none, so it is never
// shared). h_0 = SHA-256(domain | pageTokens | page 0's tokens)[:16] and
// h_i = SHA-256(h_{i-1} | page i's tokens)[:16], tokens as 4-byte
// big-endian. The router, prefill and decode all compute it with this one
// function.
func PrefixChain(tokens []uint32, pageTokens int) []ChainHash {
	if pageTokens < 1 {
		return nil
	}
	chain := make([]ChainHash, len(tokens)/pageTokens)
	buf := make([]byte, 0, max(len(chainDomain)+4, chainHashSize)+4*pageTokens)
	for i := range chain {
		buf = buf[:0]
		if i == 0 {
			buf = append(buf, chainDomain...)
			buf = binary.BigEndian.AppendUint32(buf, uint32(pageTokens))
		} else {
			buf = append(buf, chain[i-1][:]...)
		}
		for _, t := range tokens[i*pageTokens : (i+1)*pageTokens] {
			buf = binary.BigEndian.AppendUint32(buf, t)
		}
		sum := sha256.Sum256(buf)
		chain[i] = ChainHash(sum[:chainHashSize])
	}
	return chain
}

// PagesFor is the number of pages a request of the given tokens fills at
// pageTokens tokens per page. Both ends of the wire compute a request's pages
// with it: a Grant and a Done are checked against it.
func PagesFor(tokens uint32, pageTokens int) int {
	if pageTokens < 1 {
		return 0
	}
	return int((uint64(tokens) + uint64(pageTokens) - 1) / uint64(pageTokens))
}

// TokensInPage is the number of tokens page index of such a request holds:
// pageTokens for every page but the last, which holds the rest. It is the
// Tokens field of the page's tag record.
func TokensInPage(tokens uint32, pageTokens int, index int) uint32 {
	if pageTokens < 1 || index < 0 {
		return 0
	}
	before := uint64(index) * uint64(pageTokens)
	if before >= uint64(tokens) {
		return 0
	}
	return uint32(min(uint64(pageTokens), uint64(tokens)-before))
}

// MsgType is a message's type on the wire.
type MsgType uint8

// The messages between a prefill node (sender) and a decode node (receiver).
const (
	TypeBootstrap MsgType = 1 + iota // sender → receiver: a request the sender admitted
	TypeGrant                        // receiver → sender: the pages reserved for it
	TypeDone                         // sender → receiver: every WRITE is posted (sent behind them)
	TypeAbort                        // either way: stop working on a request
	TypeAbortAck                     // sender → receiver: stopped, and every posted WRITE has completed
)

func (t MsgType) String() string {
	switch t {
	case TypeBootstrap:
		return "Bootstrap"
	case TypeGrant:
		return "Grant"
	case TypeDone:
		return "Done"
	case TypeAbort:
		return "Abort"
	case TypeAbortAck:
		return "AbortAck"
	}
	return fmt.Sprintf("MsgType(%d)", uint8(t))
}

// RequestID names a request across both nodes. It is never reused.
type RequestID uint64

// Message is one of Bootstrap, Grant, Done, Abort, AbortAck.
type Message interface {
	Type() MsgType
	appendBody(dst []byte) []byte
	decodeBody(b []byte) error
}

// Bootstrap announces a request the sender's own intake accepted.
type Bootstrap struct {
	Request RequestID
	Tokens  uint32
	// Scope is the request's cache scope, as the router set it (0: no reuse).
	Scope Scope
	// Chain is the prompt's PrefixChain, one hash per full page (at most
	// MaxGrantPages): empty when Scope is 0, else exactly Tokens/pageTokens
	// long (the receiver refuses anything else at intake). A Decoder's
	// Bootstrap reuses its memory, like a Grant's pages.
	Chain []ChainHash
	// Ticket is the router's signed word that it dispatched this request,
	// opaque to the protocol (at most MaxTicket bytes): the receiver's
	// Authorize checks it before anything is reserved. A Decoder's Bootstrap
	// reuses its memory, like a Grant's pages.
	Ticket []byte
}

// PageGrant is one granted page: its ownership tag (page, epoch) and where to
// write it (remote address and key of its memory region).
type PageGrant struct {
	Page  uint32
	Epoch uint64
	Addr  uint64
	Key   uint32
}

// Grant gives the sender the pages the receiver reserved, in request order.
// With a prefix hit, Prefix tokens (whole pages) of the prompt are already in
// decode's cache, and Pages are only the fresh pages, for the request's
// pages Prefix/pageTokens on: the sender writes nothing of the prefix.
type Grant struct {
	Request RequestID
	Tokens  uint32
	Prefix  uint32 // prompt tokens already present at decode; less than Tokens
	Pages   []PageGrant
}

// Done says every WRITE of the request has been posted, with the counts the
// sender computed: the request's tokens, the prefix tokens it skipped, and
// the pages it wrote. Sent on the queue pair behind the WRITEs.
type Done struct {
	Request RequestID
	Tokens  uint32
	Pages   uint32 // pages written: those past the prefix
	Prefix  uint32 // prompt tokens skipped as already present; less than Tokens
}

// AbortReason says why a leg gave up. It is an error too: the outcome of a
// leg its peer aborted wraps ErrPeerFailed and the reason, so the prefill side
// tells a decode rejection from a timeout with errors.Is(err, AbortRejected).
type AbortReason uint8

// The reasons an Abort carries.
const (
	AbortCancelled    AbortReason = 1 + iota // the client or router cancelled the request
	AbortRejected                            // decode's intake refused it (over its limit, too many pages, no key)
	AbortNoCapacity                          // decode had no slot or pages for it
	AbortTimedOut                            // decode waited too long for Done
	AbortVerifyFailed                        // decode's verification failed (counts, tag records, checksums)
	AbortPeerFailed                          // the other leg failed
	AbortUnauthorized                        // decode's Authorize refused the Bootstrap (its ticket)
	AbortOverQuota                           // the sender holds as much of decode as one peer may
	maxAbortReason    = AbortOverQuota
)

var abortReasonNames = [...]string{"", "cancelled", "rejected", "no capacity", "timed out", "verification failed", "peer failed",
	"unauthorized", "over quota"}

func (r AbortReason) String() string {
	if r >= 1 && r <= maxAbortReason {
		return abortReasonNames[r]
	}
	return fmt.Sprintf("AbortReason(%d)", uint8(r))
}

// Error makes a reason an error that outcomes wrap.
func (r AbortReason) Error() string { return "peer aborted: " + r.String() }

// Abort asks the peer to stop working on a request.
type Abort struct {
	Request RequestID
	Reason  AbortReason
}

// AbortAck says the sender stopped and every WRITE it posted has completed: the
// receiver's fence.
type AbortAck struct {
	Request RequestID
}

// Type implements Message.
func (*Bootstrap) Type() MsgType { return TypeBootstrap }

// Type implements Message.
func (*Grant) Type() MsgType { return TypeGrant }

// Type implements Message.
func (*Done) Type() MsgType { return TypeDone }

// Type implements Message.
func (*Abort) Type() MsgType { return TypeAbort }

// Type implements Message.
func (*AbortAck) Type() MsgType { return TypeAbortAck }

// AppendMessage appends m's frame to dst. It refuses a message that breaks a
// limit, so every frame it writes decodes.
func AppendMessage(dst []byte, m Message) ([]byte, error) {
	if err := validate(m); err != nil {
		return dst, err
	}
	start := len(dst)
	dst = append(dst, Version, byte(m.Type()), 0, 0, 0, 0)
	dst = m.appendBody(dst)
	binary.BigEndian.PutUint32(dst[start+2:], uint32(len(dst)-start-HeaderSize))
	return dst, nil
}

// DecodeMessage decodes the frame at the start of b and returns it with the
// number of bytes it took. If b holds only part of a frame it returns
// ErrShortFrame (read more and call again); every other error means the stream
// is broken and must be closed. It never panics and allocates at most the
// frame's body bounds allow. The message is the caller's to keep.
func DecodeMessage(b []byte) (Message, int, error) {
	return decodeInto(b, nil)
}

// Decoder decodes frames like DecodeMessage into messages of its own, which it
// reuses: a message it returns is valid until its next Decode. For a
// connection's receive loop that hands each message to Step before reading
// the next (Sender and Receiver keep nothing of a message they are given).
// A Grant's page list keeps its memory too, so a stream of frames decodes
// without allocating. The zero value is ready to use; not safe for
// concurrent use.
type Decoder struct {
	bootstrap Bootstrap
	ticket    []byte      // the Bootstrap's ticket's memory, kept while a Bootstrap carries none
	chain     []ChainHash // the Bootstrap's chain's memory, likewise
	grant     Grant
	done      Done
	abort     Abort
	abortAck  AbortAck
}

// Decode decodes the frame at the start of b (see DecodeMessage).
func (d *Decoder) Decode(b []byte) (Message, int, error) {
	return decodeInto(b, d)
}

func decodeInto(b []byte, d *Decoder) (Message, int, error) {
	if len(b) < HeaderSize {
		return nil, 0, ErrShortFrame
	}
	if b[0] != Version {
		return nil, 0, fmt.Errorf("%w: %d, this side speaks %d", ErrVersion, b[0], Version)
	}
	n := binary.BigEndian.Uint32(b[2:])
	if n > MaxBody {
		return nil, 0, fmt.Errorf("%w: body of %d bytes, limit %d", ErrFrameTooLong, n, MaxBody)
	}
	var m Message
	switch t := MsgType(b[1]); {
	case d == nil:
		switch t {
		case TypeBootstrap:
			m = new(Bootstrap)
		case TypeGrant:
			m = new(Grant)
		case TypeDone:
			m = new(Done)
		case TypeAbort:
			m = new(Abort)
		case TypeAbortAck:
			m = new(AbortAck)
		}
	case t == TypeBootstrap:
		d.bootstrap.Ticket, d.bootstrap.Chain = d.ticket[:0], d.chain[:0]
		m = &d.bootstrap
	case t == TypeGrant:
		d.grant.Pages = d.grant.Pages[:0]
		m = &d.grant
	case t == TypeDone:
		m = &d.done
	case t == TypeAbort:
		m = &d.abort
	case t == TypeAbortAck:
		m = &d.abortAck
	}
	if m == nil {
		return nil, 0, fmt.Errorf("%w: %d", ErrUnknownType, b[1])
	}
	if uint64(len(b)) < HeaderSize+uint64(n) {
		return nil, 0, ErrShortFrame
	}
	err := m.decodeBody(b[HeaderSize : HeaderSize+int(n)])
	if b, ok := m.(*Bootstrap); ok && d != nil {
		if b.Ticket != nil {
			d.ticket = b.Ticket[:0]
		}
		if b.Chain != nil {
			d.chain = b.Chain[:0]
		}
	}
	if err != nil {
		return nil, 0, fmt.Errorf("%s: %w", m.Type(), err)
	}
	if err := validate(m); err != nil {
		return nil, 0, err
	}
	return m, HeaderSize + int(n), nil
}

// validate checks the limits that the encoding itself does not bound.
func validate(m Message) error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrMalformed, m.Type(), fmt.Sprintf(format, a...))
	}
	if isNil(m) {
		return fmt.Errorf("%w: nil message", ErrMalformed)
	}
	switch m := m.(type) {
	case *Bootstrap:
		if m.Tokens == 0 || m.Tokens > MaxTokens {
			return bad("tokens %d outside 1..%d", m.Tokens, MaxTokens)
		}
		if len(m.Ticket) > MaxTicket {
			return bad("a ticket of %d bytes, at most %d", len(m.Ticket), MaxTicket)
		}
		if len(m.Chain) > MaxGrantPages || len(m.Chain) > int(m.Tokens) {
			return bad("a chain of %d hashes for %d tokens, at most %d", len(m.Chain), m.Tokens, MaxGrantPages)
		}
		if m.Scope == 0 && len(m.Chain) > 0 {
			return bad("a chain of %d hashes without a scope", len(m.Chain))
		}
	case *Grant:
		if m.Tokens == 0 || m.Tokens > MaxTokens {
			return bad("tokens %d outside 1..%d", m.Tokens, MaxTokens)
		}
		if m.Prefix >= m.Tokens {
			return bad("a prefix of %d of %d tokens: the last token is always written", m.Prefix, m.Tokens)
		}
		if len(m.Pages) == 0 || len(m.Pages) > MaxGrantPages {
			return bad("%d pages outside 1..%d", len(m.Pages), MaxGrantPages)
		}
	case *Done:
		if m.Tokens == 0 || m.Tokens > MaxTokens || m.Pages == 0 || m.Pages > MaxGrantPages || m.Prefix >= m.Tokens {
			return bad("tokens %d, pages %d or prefix %d out of range", m.Tokens, m.Pages, m.Prefix)
		}
	case *Abort:
		if m.Reason == 0 || m.Reason > maxAbortReason {
			return bad("unknown reason %d", m.Reason)
		}
	}
	return nil
}

// isNil reports whether m is nil or a nil pointer of one of the message types.
func isNil(m Message) bool {
	switch m := m.(type) {
	case *Bootstrap:
		return m == nil
	case *Grant:
		return m == nil
	case *Done:
		return m == nil
	case *Abort:
		return m == nil
	case *AbortAck:
		return m == nil
	}
	return m == nil
}

// body is a cursor over a frame's body that records the first shortfall.
type body struct {
	b   []byte
	err error
}

func (r *body) take(n int) []byte {
	if r.err != nil || len(r.b) < n {
		r.err = fmt.Errorf("%w: body ends early", ErrMalformed)
		return zeros[:n] // read as zeros, ignored because err is set
	}
	p := r.b[:n]
	r.b = r.b[n:]
	return p
}

var zeros [chainHashSize]byte

func (r *body) u8() uint8   { return r.take(1)[0] }
func (r *body) u32() uint32 { return binary.BigEndian.Uint32(r.take(4)) }
func (r *body) u64() uint64 { return binary.BigEndian.Uint64(r.take(8)) }

// end fails if bytes are left over: one encoding per message.
func (r *body) end() error {
	if r.err == nil && len(r.b) != 0 {
		r.err = fmt.Errorf("%w: %d trailing bytes", ErrMalformed, len(r.b))
	}
	return r.err
}

// A Bootstrap's body: request, tokens, scope, the chain's length (uint32)
// and hashes, the ticket's length (uint16) and bytes.
func (m *Bootstrap) appendBody(dst []byte) []byte {
	dst = binary.BigEndian.AppendUint64(dst, uint64(m.Request))
	dst = binary.BigEndian.AppendUint32(dst, m.Tokens)
	dst = binary.BigEndian.AppendUint64(dst, uint64(m.Scope))
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(m.Chain)))
	for _, h := range m.Chain {
		dst = append(dst, h[:]...)
	}
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(m.Ticket)))
	return append(dst, m.Ticket...)
}

func (m *Bootstrap) decodeBody(b []byte) error {
	r := body{b: b}
	m.Request, m.Tokens, m.Scope = RequestID(r.u64()), r.u32(), Scope(r.u64())
	count := r.u32()
	if r.err != nil {
		return r.err
	}
	// The chain's length must fit in what is left (with the ticket's
	// length), and in MaxGrantPages, before anything is allocated for it.
	if count > MaxGrantPages || uint64(count)*chainHashSize+2 > uint64(len(r.b)) {
		return fmt.Errorf("%w: a chain of %d hashes in %d bytes", ErrMalformed, count, len(r.b))
	}
	chain := m.Chain[:0] // a Decoder's Bootstrap: its chain's memory is reused
	m.Chain = nil
	if count > 0 {
		if cap(chain) >= int(count) {
			chain = chain[:count]
		} else {
			chain = make([]ChainHash, count)
		}
		for i := range chain {
			chain[i] = ChainHash(r.take(chainHashSize))
		}
		m.Chain = chain
	}
	n := int(binary.BigEndian.Uint16(r.take(2)))
	if r.err != nil {
		return r.err
	}
	// The length must fit in what is left, and in MaxTicket, before anything is
	// allocated for it.
	if n > MaxTicket || n != len(r.b) {
		return fmt.Errorf("%w: a ticket of %d bytes in %d", ErrMalformed, n, len(r.b))
	}
	buf := m.Ticket[:0] // a Decoder's Bootstrap: its ticket's memory is reused
	m.Ticket = nil
	if n > 0 {
		m.Ticket = append(buf, r.b...)
	}
	return nil
}

func (m *Grant) appendBody(dst []byte) []byte {
	dst = binary.BigEndian.AppendUint64(dst, uint64(m.Request))
	dst = binary.BigEndian.AppendUint32(dst, m.Tokens)
	dst = binary.BigEndian.AppendUint32(dst, m.Prefix)
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(m.Pages)))
	for _, p := range m.Pages {
		dst = binary.BigEndian.AppendUint32(dst, p.Page)
		dst = binary.BigEndian.AppendUint64(dst, p.Epoch)
		dst = binary.BigEndian.AppendUint64(dst, p.Addr)
		dst = binary.BigEndian.AppendUint32(dst, p.Key)
	}
	return dst
}

func (m *Grant) decodeBody(b []byte) error {
	r := body{b: b}
	m.Request, m.Tokens, m.Prefix = RequestID(r.u64()), r.u32(), r.u32()
	count := r.u32()
	if r.err != nil {
		return r.err
	}
	// The count must fit in what is left before anything is allocated for it.
	if count > MaxGrantPages || uint64(count)*grantPageSize != uint64(len(r.b)) {
		return fmt.Errorf("%w: %d pages in %d bytes", ErrMalformed, count, len(r.b))
	}
	if cap(m.Pages) >= int(count) { // a Decoder's Grant: its page list is reused
		m.Pages = m.Pages[:count]
	} else {
		m.Pages = make([]PageGrant, count)
	}
	// The length is checked: each page's 24 bytes are read straight.
	for i, b := 0, r.b; i < len(m.Pages); i, b = i+1, b[grantPageSize:] {
		m.Pages[i] = PageGrant{Page: binary.BigEndian.Uint32(b), Epoch: binary.BigEndian.Uint64(b[4:]),
			Addr: binary.BigEndian.Uint64(b[12:]), Key: binary.BigEndian.Uint32(b[20:])}
	}
	return nil
}

func (m *Done) appendBody(dst []byte) []byte {
	dst = binary.BigEndian.AppendUint64(dst, uint64(m.Request))
	dst = binary.BigEndian.AppendUint32(dst, m.Tokens)
	dst = binary.BigEndian.AppendUint32(dst, m.Pages)
	return binary.BigEndian.AppendUint32(dst, m.Prefix)
}

func (m *Done) decodeBody(b []byte) error {
	r := body{b: b}
	m.Request, m.Tokens, m.Pages, m.Prefix = RequestID(r.u64()), r.u32(), r.u32(), r.u32()
	return r.end()
}

func (m *Abort) appendBody(dst []byte) []byte {
	dst = binary.BigEndian.AppendUint64(dst, uint64(m.Request))
	return append(dst, byte(m.Reason))
}

func (m *Abort) decodeBody(b []byte) error {
	r := body{b: b}
	m.Request, m.Reason = RequestID(r.u64()), AbortReason(r.u8())
	return r.end()
}

func (m *AbortAck) appendBody(dst []byte) []byte {
	return binary.BigEndian.AppendUint64(dst, uint64(m.Request))
}

func (m *AbortAck) decodeBody(b []byte) error {
	r := body{b: b}
	m.Request = RequestID(r.u64())
	return r.end()
}

package protocol

import "errors"

// Errors of the wire format. Every decoding error wraps exactly one of them, so
// callers can tell a frame that is merely incomplete from a broken stream.
var (
	// ErrShortFrame: the buffer holds only part of a frame; read more.
	ErrShortFrame = errors.New("protocol: incomplete frame")
	// ErrVersion: the frame is of a wire version this side does not speak.
	ErrVersion = errors.New("protocol: unsupported wire version")
	// ErrUnknownType: the frame's type is not a message of this version.
	ErrUnknownType = errors.New("protocol: unknown message type")
	// ErrFrameTooLong: the frame's body exceeds MaxBody.
	ErrFrameTooLong = errors.New("protocol: frame too long")
	// ErrMalformed: the body does not hold a valid message of its type.
	ErrMalformed = errors.New("protocol: malformed message")
)

// Errors of page verification: why a page, or a whole transfer, was refused.
var (
	// ErrTagMalformed: the tag record is not a tag record (torn, never written,
	// or garbage an earlier tenant left).
	ErrTagMalformed = errors.New("protocol: malformed tag record")
	// ErrTagMismatch: the tag record is intact but was written for another
	// request, page index or epoch: the page is not this request's.
	ErrTagMismatch = errors.New("protocol: tag mismatch")
	// ErrChecksumMismatch: the payload is not what its tag record's checksum covers.
	ErrChecksumMismatch = errors.New("protocol: checksum mismatch")
	// ErrTokenMismatch: a token or page count differs from the reservation.
	ErrTokenMismatch = errors.New("protocol: token count mismatch")
)

// Outcomes: why a request ended without success. Every outcome a Sender or
// Receiver reports is nil (success) or wraps one of these (and, for a
// verification failure, one of the verification errors above).
var (
	// ErrRejected: intake refused the request; it never held pages.
	ErrRejected = errors.New("protocol: rejected")
	// ErrTooLong: the prompt exceeds this node's limit (always with ErrRejected).
	ErrTooLong = errors.New("protocol: prompt too long")
	// ErrTooManyPages: the request needs more pages than one Grant carries
	// (MaxGrantPages), whatever the pool holds (always with ErrRejected).
	ErrTooManyPages = errors.New("protocol: request needs more pages than a grant carries")
	// ErrBadGrant: the receiver's Grant names one page twice (by number, or by
	// remote address and key), so two WRITEs would land on one page, or its
	// prefix does not fit the request (not whole pages of the chain the
	// request sent, or not every page past it granted).
	ErrBadGrant = errors.New("protocol: bad grant")
	// ErrCancelled: the client or router cancelled the request.
	ErrCancelled = errors.New("protocol: cancelled")
	// ErrTimedOut: the receiver waited too long for the transfer.
	ErrTimedOut = errors.New("protocol: timed out")
	// ErrPeerFailed: the other leg failed, gave up, or its queue pair broke.
	ErrPeerFailed = errors.New("protocol: peer failed")
	// ErrUnauthorized: the receiver's Authorize refused a Bootstrap (no
	// ticket, or one that is forged, expired, for another request, node or
	// token count, or replayed); it never held pages.
	ErrUnauthorized = errors.New("protocol: unauthorized")
	// ErrBadChain: a Bootstrap's prefix chain does not fit the request: not
	// one hash per full page, or a chain without a scope (always with
	// ErrRejected); it never held pages.
	ErrBadChain = errors.New("protocol: prefix chain does not fit the request")
	// ErrOverQuota: the Bootstrap's peer already holds as many open requests
	// or reserved pages as the receiver allows one peer; it never held pages.
	ErrOverQuota = errors.New("protocol: over the peer's quota")
)

// Misuse and protocol violations: returned by the call that caused them, with
// no change of state.
var (
	// ErrUnknownRequest: a message or call names a request this node never had.
	ErrUnknownRequest = errors.New("protocol: unknown request")
	// ErrDuplicate: a request submitted twice, or a second Grant or Done.
	ErrDuplicate = errors.New("protocol: duplicate request or message")
	// ErrWrongPeer: a message about a request came from a peer it is not on.
	ErrWrongPeer = errors.New("protocol: message from a peer the request is not on")
	// ErrUnexpectedMessage: a message that never travels in this direction.
	ErrUnexpectedMessage = errors.New("protocol: message not expected in this direction")
	// ErrBadComputed: ComputedPages with a page count outside the request's
	// pages, or below one it was given before (computed pages only grow).
	ErrBadComputed = errors.New("protocol: computed pages out of range")
	// ErrNotReady: Acquire or Finish on a request that is not verified or not being read.
	ErrNotReady = errors.New("protocol: request not verified for reading")
)

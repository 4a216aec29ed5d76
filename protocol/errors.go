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
	// ErrTooLong: the frame's body exceeds MaxBody.
	ErrTooLong = errors.New("protocol: frame too long")
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

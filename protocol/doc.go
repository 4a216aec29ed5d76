// Package protocol is kvhandoff's implementation of the handoff protocol
// (docs/protocol.md), the code an engine links. It imports only the standard
// library and its checksum package.
//
// Today it holds the two encodings that cross the wire, both decoded
// defensively (any input yields a value or an error that wraps one of this
// package's error values: never a panic, and no allocation beyond the limits):
//
//   - The control messages between a prefill node and a decode node: Bootstrap,
//     Grant, Done, Abort and AbortAck. Each travels as a frame of version
//     (1 byte), type (1 byte), body length (4 bytes, big-endian, at most MaxBody)
//     and body. [AppendMessage] refuses a message that breaks a limit, so every
//     frame it writes decodes. [DecodeMessage] tells an incomplete frame
//     (ErrShortFrame: read more) from a broken stream (every other error).
//   - The tag record written after each page's payload ([Tag], [TagSize] bytes),
//     and [VerifyPage], the check every page passes before anything reads it:
//     an intact record, for this request, page index and epoch, with this many
//     tokens, over a payload with this checksum.
//
// And the decode node's page pool ([Pool]): every page is free, owned by one
// request at one epoch, or quarantined until that request's writer is fenced.
// Allocation advances epochs; release and quarantine name the tenancy they mean
// (page and epoch) and touch nothing else, so a duplicate or late fence can never
// free the next owner's page; [Pool.Check] is the read-time epoch check.
//
// The sans-I/O sender and receiver state machines and the implementation
// switches come next (issue 3). They are checked against the executable spec in
// package spec.
package protocol

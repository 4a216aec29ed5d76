package node

import (
	"errors"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// Errors of the nodes, for errors.Is.
var (
	// ErrBadRequest: a client request that is not one (malformed JSON, no
	// prompt, a max_tokens out of range, another model).
	ErrBadRequest = errors.New("node: bad request")
	// ErrShuttingDown: the node is stopping and takes no new request.
	ErrShuttingDown = errors.New("node: shutting down")
	// ErrUnreachable: a node's control API did not answer.
	ErrUnreachable = errors.New("node: node unreachable")
	// ErrNoPrompt: a decode node verified a request's KV but was never told
	// its prompt in time.
	ErrNoPrompt = errors.New("node: no prompt for a verified request")
)

// wireErrors are the errors whose identity crosses the control API: a
// node's error arrives at the router with the same errors.Is answers.
var wireErrors = []struct {
	code string
	err  error
}{
	{"rejected", protocol.ErrRejected},
	{"too_long", protocol.ErrTooLong},
	{"too_many_pages", protocol.ErrTooManyPages},
	{"bad_grant", protocol.ErrBadGrant},
	{"cancelled", protocol.ErrCancelled},
	{"timed_out", protocol.ErrTimedOut},
	{"peer_failed", protocol.ErrPeerFailed},
	{"node_lost", protocol.ErrNodeLost},
	{"no_node", protocol.ErrNoNode},
	{"tag_malformed", protocol.ErrTagMalformed},
	{"tag_mismatch", protocol.ErrTagMismatch},
	{"checksum_mismatch", protocol.ErrChecksumMismatch},
	{"token_mismatch", protocol.ErrTokenMismatch},
	{"no_capacity", protocol.ErrNoCapacity},
	{"fenced", protocol.ErrFenced},
	{"unknown_request", protocol.ErrUnknownRequest},
	{"duplicate", protocol.ErrDuplicate},
	{"not_ready", protocol.ErrNotReady},
	{"abort_cancelled", protocol.AbortCancelled},
	{"abort_rejected", protocol.AbortRejected},
	{"abort_no_capacity", protocol.AbortNoCapacity},
	{"abort_timed_out", protocol.AbortTimedOut},
	{"abort_verify_failed", protocol.AbortVerifyFailed},
	{"abort_peer_failed", protocol.AbortPeerFailed},
	{"unauthorized", protocol.ErrUnauthorized},
	{"over_quota", protocol.ErrOverQuota},
	{"abort_unauthorized", protocol.AbortUnauthorized},
	{"abort_over_quota", protocol.AbortOverQuota},
	{"ticket", ErrTicket},
	{"no_peer", transfer.ErrNoPeer},
	{"engine_bad_request", engine.ErrBadRequest},
	{"geometry", kv.ErrGeometry},
	{"bad_request", ErrBadRequest},
	{"shutting_down", ErrShuttingDown},
	{"unreachable", ErrUnreachable},
	{"no_prompt", ErrNoPrompt},
	{"not_shared", protocol.ErrNotShared},
	{"bad_chain", protocol.ErrBadChain},
	{"shared_write", engine.ErrSharedWrite},
	{"scope_in_body", ErrScopeInBody},
}

// wireError is an error as the control API carries it.
type wireError struct {
	Message string   `json:"message"`
	Codes   []string `json:"codes,omitempty"`
}

func toWire(err error) *wireError {
	if err == nil {
		return nil
	}
	w := &wireError{Message: err.Error()}
	for _, e := range wireErrors {
		if errors.Is(err, e.err) {
			w.Codes = append(w.Codes, e.code)
		}
	}
	return w
}

// remoteError is an error that came over the control API: its message, and
// the sentinel errors it wrapped on the node that made it.
type remoteError struct {
	msg  string
	errs []error
}

func (e *remoteError) Error() string   { return e.msg }
func (e *remoteError) Unwrap() []error { return e.errs }

func (w *wireError) err() error {
	if w == nil {
		return nil
	}
	r := &remoteError{msg: w.Message}
	for _, c := range w.Codes {
		for _, e := range wireErrors {
			if e.code == c {
				r.errs = append(r.errs, e.err)
			}
		}
	}
	return r
}

// Reason is a failure's reason as the metrics name it: one of a closed set.
func Reason(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, protocol.ErrRejected), errors.Is(err, protocol.ErrUnauthorized), errors.Is(err, protocol.AbortUnauthorized), errors.Is(err, ErrScopeInBody),
		errors.Is(err, protocol.ErrOverQuota), errors.Is(err, protocol.AbortOverQuota):
		return "rejected"
	case errors.Is(err, protocol.ErrTagMismatch), errors.Is(err, protocol.ErrTagMalformed), errors.Is(err, protocol.ErrFenced), errors.Is(err, protocol.ErrNotShared):
		return "tag"
	case errors.Is(err, protocol.ErrChecksumMismatch):
		return "checksum"
	case errors.Is(err, protocol.ErrTokenMismatch):
		return "tokens"
	case errors.Is(err, protocol.ErrNoCapacity), errors.Is(err, protocol.ErrTooManyPages), errors.Is(err, protocol.ErrBadGrant), errors.Is(err, protocol.AbortNoCapacity):
		return "pages"
	case errors.Is(err, protocol.ErrCancelled), errors.Is(err, protocol.AbortCancelled):
		return "cancelled"
	case errors.Is(err, protocol.ErrTimedOut), errors.Is(err, protocol.AbortTimedOut):
		return "timeout"
	case errors.Is(err, protocol.ErrPeerFailed), errors.Is(err, ErrUnreachable), errors.Is(err, protocol.ErrNoNode), errors.Is(err, transfer.ErrNoPeer):
		return "peer"
	}
	return "other"
}

// reasons is Reason's closed set.
var reasons = []string{"rejected", "tag", "checksum", "tokens", "pages", "cancelled", "timeout", "peer", "other"}

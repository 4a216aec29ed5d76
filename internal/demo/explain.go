package demo

import (
	"strings"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// corrupted is explain's answer for a failure a corrupted WRITE explains.
const corrupted = "a corrupted WRITE"

// explain names what explains a failed, rejected or cancelled request:
// something the demo did to the deployment (injected, the faults it
// injected), or the request itself (a prompt over the limit, a body naming
// a cache scope, a client that went away). It returns "" for a failure
// nothing explains: a defense of the deployment stopped a bug of its own,
// which a healthy deployment never gives, so the run fails (a demo that
// cannot tell a defended bug from a healthy run cannot check either).
//
// The message is the error's (in process) or the HTTP API's answer (as
// processes: "the handoff failed (REASON: cause)", node's failureCauses).
// What each cause can give:
//   - a corrupted WRITE: a checksum mismatch, or a damaged tag record
//     (malformed, or its MAC fails), of the one request the WRITE was for
//     (Check counts them: no more such failures than corruptions). Never an
//     intact record naming another page or request, nor a token count:
//     those the MAC vouches for;
//   - a queue-pair cut or a crashed prefill node: peer failures, a page
//     fenced under a read, the crashed node's unfinished legs;
//   - a late placement, and the machine's load: timeouts (the deployment's
//     honest answer to a slow leg, on a shared machine too);
//   - a full pool (the workload's own load): no capacity;
//   - nothing the demo does gives a token count mismatch, a bad grant, a
//     shared page that is no longer a pinned cached page of the request's
//     scope (eviction or purge leaves a pinned page readable), or a tag
//     record naming another page.
func explain(o Outcome, injected Faults) string {
	r, msg := o.Request, o.Err
	has := func(err error) bool { return strings.Contains(msg, err.Error()) }
	cutOrCrash := injected.Cuts > 0 || injected.Crash
	if strings.HasPrefix(msg, runStopped) {
		return "the run was stopped"
	}
	switch {
	case o.Kind == Rejected || o.Reason == "rejected":
		switch {
		case r.OverLimit:
			return "a prompt over the limit"
		case r.BodyScope != "":
			return "a body naming a cache scope"
		case o.Kind == Failed && cutOrCrash:
			return "a leg of a crashed or cut peer"
		}
		return ""
	case o.Kind == Cancelled || o.Reason == "cancelled":
		switch {
		case r.Disconnect > 0:
			return "the client went away"
		case cutOrCrash:
			return "a leg of a crashed or cut peer"
		}
		return ""
	}
	switch o.Reason {
	case "checksum":
		if injected.Corruptions > 0 {
			return corrupted
		}
	case "tag":
		switch {
		case has(protocol.ErrNotShared):
			return ""
		case injected.Corruptions > 0 && (has(protocol.ErrTagMalformed) || strings.Contains(msg, "MAC fails") || strings.Contains(msg, "payload sum is")):
			return corrupted
		case cutOrCrash && (has(protocol.ErrFenced) || strings.Contains(msg, "(tag: fenced)")):
			return "a page fenced by a cut or crash"
		}
	case "pages":
		if has(protocol.ErrNoCapacity) || strings.Contains(msg, protocol.AbortNoCapacity.Error()) || strings.Contains(msg, "(pages: no room in a pool)") {
			return "a full pool"
		}
	case "timeout":
		return "a deadline"
	case "peer", "other":
		if cutOrCrash {
			return "a queue-pair cut or a crashed node"
		}
	}
	return ""
}

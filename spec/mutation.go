package spec

import (
	"errors"
	"fmt"
	"strings"
)

// Mutation is one rule of the spec weakened or removed on purpose, for the
// mutation gate (issue 23; docs/spec.md, "The mutation gate"): every rule
// earns its place if some configuration CI checks catches the spec without
// it, or an argument says why nothing can. Config.Mutation turns one on; the
// zero value is none. Unlike a Switch, a mutation is no bug of a catalogue,
// and has no implementation counterpart: each is a guard on one rule of the
// step functions (grep its constant). The switches are mutations too: the
// gate runs each alone beside these.
type Mutation uint8

// The mutations.
const (
	NoMutation                   Mutation = iota
	RouterIgnoresLimit                    // the router's intake admits prompts over the advertised context
	PrefillIgnoresLimit                   // prefill's intake admits prompts over its own pool (and fails them for capacity)
	DecodeIgnoresLimit                    // decode's intake reserves for prompts over its own pool (and fails them for capacity)
	AdmitIgnoresGrant                     // prefill's admission takes a grant whose counts differ from its own view
	NoPoolEpochCheck                      // verification at Done does not compare a page's pool epoch with the granted one
	NoReadEpochCheck                      // the read does not compare each page's epoch with the granted one
	ReleaseIgnoresEpoch                   // a release frees every recorded page, whoever owns it now at whatever epoch
	NoRestartFence                        // decode accepts a prefill node's new incarnation without cutting the old one's queue pair
	NoDecodeRestartFence                  // prefill accepts a decode node's new incarnation without cutting its queue pair to the old one
	DecodeRestartSameIncarnation          // a decode node restarts under the incarnation it had (the registry sees no new one)
	NoRouterLegCancel                     // the router does not cancel the open prefill legs of a lost decode node's requests (with static peers, of any failed request: static.go)
	NoLostDecodeFence                     // prefill does not cut its queue pair to a decode node the registry declared lost
	KeyOutlivesRecord                     // decode revokes a grant's key at Done only: not at an abort, a quarantine, a fence or a cut
	KeyCoversPool                         // a grant's key covers every page of the pool (revoked as the rule says)
	NoTicketCheck                         // decode's intake reserves for a Bootstrap without the router's ticket (as unticketed-bootstrap)
	NoDonePrefixCheck                     // verification at Done does not compare Done's prefix with the grant's
	NoPinnedCheck                         // verification at Done does not check the pinned prefix pages
	NoSharedReadCheck                     // the read does not check the pinned prefix pages
	InsertUnverified                      // a request's written pages enter the prefix cache at every end, not only after a verified read
	NoUnpin                               // a request's end does not unpin the pages of its prefix hit
	UnsaltedPublicChain                   // the chain past a public prefix is not salted with the tenant: a public request's private pages are keyed alike for every tenant
	UnboundedRetry                        // RC retries a work request to a silent peer for ever (retry_cnt 7 on rxe and some NICs): no RetryExceeded (static.go)
	NumMutations
)

var mutationNames = [NumMutations]string{"none",
	"router-ignores-limit", "prefill-ignores-limit", "decode-ignores-limit", "admit-ignores-grant",
	"no-pool-epoch-check", "no-read-epoch-check", "release-ignores-epoch",
	"no-restart-fence", "no-decode-restart-fence", "decode-restart-same-incarnation",
	"no-router-leg-cancel", "no-lost-decode-fence",
	"key-outlives-record", "key-covers-pool", "no-ticket-check",
	"no-done-prefix-check", "no-pinned-check", "no-shared-read-check", "insert-unverified", "no-unpin",
	"unsalted-public-chain", "unbounded-retry",
}

func (m Mutation) String() string {
	if m < NumMutations {
		return mutationNames[m]
	}
	return fmt.Sprintf("Mutation(%d)", m)
}

// AllMutations lists every mutation but NoMutation.
func AllMutations() []Mutation {
	out := make([]Mutation, 0, NumMutations-1)
	for m := NoMutation + 1; m < NumMutations; m++ {
		out = append(out, m)
	}
	return out
}

// ErrUnknownMutation is returned for a mutation name not in the table.
var ErrUnknownMutation = errors.New("unknown mutation")

// ParseMutation parses a mutation's name; "" and "none" are NoMutation.
func ParseMutation(name string) (Mutation, error) {
	if name == "" {
		return NoMutation, nil
	}
	for m, n := range mutationNames {
		if n == name {
			return Mutation(m), nil
		}
	}
	return 0, fmt.Errorf("%w %q (known: %s)", ErrUnknownMutation, name, strings.Join(mutationNames[1:], ", "))
}

// Equivalent holds the mutants (a mutation's or a switch's name) that no
// check can catch, each with the argument why: the gate accepts an uncaught
// mutant only if it is here, and fails on one that is here and caught.
var Equivalent = map[string]string{
	"abort-still-sends":       "redundant behind the tag check: the Done of a cancelled sender reaches a page it never wrote, whose stale tag record fails verification (an honest failure); the matrix exposes it with no-tag-check",
	"no-token-check":          "redundant behind the tag records and prefill's intake: a Done whose counts differ from the reservation comes only from admit-finished's placeholder or a count damaged in transit, and the pages verify by their own tag records and checksums; the matrix exposes it with admit-finished and no-tag-check (the incident)",
	"done-unmatched":          "redundant behind the tag check: a Done matched to the slot's new holder verifies that request's pages by their tag records, which another request's WRITEs did not write; the matrix exposes it with no-tag-check",
	"no-tag-check":            "redundant behind the checksum and the other defenses: a tag record damaged in transit leaves a payload whose checksum still matches, and the stale records it would catch exist only behind another switch (abort-still-sends, done-unmatched, admit-finished with no-token-check: the matrix)",
	"abort-frees-source":      "redundant behind the checksum: a WRITE that reads a source page reused early ships KV whose checksum, computed at posting, no longer matches; the matrix exposes it with no-checksum",
	"router-ignores-limit":    "redundant behind each node's own limit: a prompt over the advertised context is over the prefill pool or the decode pool too, and that node rejects it, with a reason NoSpuriousFailure accepts",
	"decode-ignores-limit":    "in the model decode's limit is its pool, so a prompt over it needs more pages than the pool has and the capacity refusal ends it (failed, no capacity, a reason NoSpuriousFailure accepts) before anything is reserved",
	"admit-ignores-grant":     "the spec's sender takes its grant's pages from decode's reservation and writes its own page count, so a Grant's counts damaged in transit change nothing it writes, and decode's token and page check at Done refuses any mismatch",
	"no-pool-epoch-check":     "it refuses only a page a live request no longer owns at its granted epoch, a Conservation violation, and the checker expands no state that violates a property: defense in depth, redundant (Coverage)",
	"no-read-epoch-check":     "as no-pool-epoch-check: a changed epoch at read time is a Conservation violation first",
	"release-ignores-epoch":   "a release names pages the record owns at their granted epochs while Conservation holds, so the test it drops is always true; only a second release (double-free) makes it matter, and double-free is caught",
	"no-restart-fence":        "redundant behind the lost node's fence: the new incarnation's registration tells the router the old one is lost first, and the PeerFailed it sends reaches decode ahead of PeerRestarted on the same FIFO queue and cuts the queue pair for good; it shows only with no-peer-cancel or peer-by-name on (issue 23)",
	"no-decode-restart-fence": "as no-restart-fence, for a decode node: its new registration makes the router lose the old incarnation, and the PeerFailed every prefill node gets ahead of PeerRestarted cuts its queue pair to it",
	"no-done-prefix-check":    "the spec's sender takes its skip from the grant's prefix and Done carries it, and no fault damages it, so the check refuses nothing a run of the correct protocol sends; a skip that differs (prefix-count-mismatch) violates PrefixExact at admission, before any Done",
	"no-pinned-check":         "a pinned page stays cached at its epoch, scope and chain while pinned (PinnedNeverReallocated holds in every exploration, and the checker expands no state that violates it), so the check at Done refuses nothing: defense in depth, as no-pool-epoch-check",
	"no-shared-read-check":    "as no-pinned-check, at the read",
}

// mut reports whether the model runs with mutation mu.
func (x *sys) mut(mu Mutation) bool { return x.m.cfg.Mutation == mu }

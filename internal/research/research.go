// Package research turns on bugs of the catalogue (docs/spec.md) in the protocol
// implementation, for research and to prove that the checkers can fail.
//
// It is internal to the kvhandoff module on purpose. A Switches value with
// anything on can only be built by code inside this module (the simulator, the
// model-based tests, the command line), because code outside can neither import
// this package nor construct a non-zero Switches (its field is unexported). An
// engine that links package protocol gets the zero value, every defense on, and
// cannot change that by accident, or by an untyped constant in a config file.
package research

import (
	"fmt"
	"strings"
)

// Switch is one bug of the catalogue that the implementation can reproduce.
type Switch uint32

// The implementation's switches, named as in the spec. done-unmatched has no
// counterpart: the wire carries no slot, and Done is matched by request id.
const (
	AdmitFinished Switch = 1 << iota
	AbortStillSends
	NoTokenCheck
	EagerRelease
	TimeoutFree
	PrefillEarlyFree
	NoTagCheck
	NoChecksum
	LeakOnCancel
	NoPeerCancel
	DoubleFree
	// AbortFreesSource: an aborted sender frees its source pages at once,
	// not when the WRITEs reading them complete (vLLM #21570).
	AbortFreesSource
	// ChecksumHangs: a checksum mismatch at Done neither fails nor readies
	// the request; it waits for a Done that has come (SGLang #39729).
	ChecksumHangs
	// PeerByName: a node that restarted is known by its name only, not its
	// name and incarnation: its new registration is an advertisement update,
	// and the old incarnation's requests carry on as if it had not gone.
	PeerByName
	// PoolWideKey: the decode pool is one region under one remote key, the
	// same in every Grant and never revoked: any peer that learned it can
	// WRITE any page (transfer; issue 17's hole).
	PoolWideKey
	// VerifyBeforeRevoke: Done reaches the Receiver, which verifies, before
	// the request's windows are revoked (only at release): the sender can
	// still WRITE verified pages (a time-of-check/time-of-use window).
	VerifyBeforeRevoke
	// UnticketedBootstrap: the decode node reserves pages for any Bootstrap,
	// without asking whether the router dispatched it (its ticket), so any
	// peer that connected a queue pair can hold the pool (issue 17).
	UnticketedBootstrap
	// ScopeDropped: the prefix cache's key is the chain hash alone, and the
	// shared read check ignores the scope, so two tenants with one prompt
	// share cached KV (SGLang #37160).
	ScopeDropped
	// ClientScope: the router takes a request's cache scope from the
	// request body, not from the authenticated tenant (node's router).
	ClientScope
	// EvictPinned: eviction takes the least recently used cached page
	// whether or not a request has it pinned, so a page being read is
	// reallocated and written.
	EvictPinned
	// PrefixCountMismatch: the sender skips one page more than the Grant's
	// prefix, and neither side compares the two lengths (the sender's
	// admission and the receiver's Done check of Prefix).
	PrefixCountMismatch
	// WriteShared: the receiver grants the pinned prefix pages too (with
	// Prefix 0), so the sender writes pages other requests read.
	WriteShared
	// WriteUncomputed: a prefill that computes in chunks posts the WRITEs
	// of every granted page once its first chunk is computed, as if one
	// chunk's completion were the prompt's: the pages not computed yet ship
	// whatever they held, the previous request's KV, under this request's
	// tag (docs/protocol.md rule 25).
	WriteUncomputed
	// FreeComputing: the prefill driver feeds the Sender a cancel, an
	// Abort or a flush as it arrives, while the request's KV is being
	// computed: its source pages go back to the pool and to the next
	// request while the engine still writes them (transfer).
	FreeComputing
	numSwitches = iota
)

// Concurrency bugs of the shared (concurrency-safe) layer, not of the protocol:
// they exist to prove that the linearizability checker can fail. They are
// wrappers in package racy, outside every code path an engine links.
const (
	// StaleStatus: Status answers from a cache that a Cancel does not update,
	// so a status read can observe a state older than a completed cancel.
	StaleStatus Switch = 1 << (numSwitches + iota)
	// SplitAcquire: Acquire checks readiness, drops the lock, then takes the
	// pages, so a Cancel can slip in between and Acquire still reports success.
	SplitAcquire
)

// Node bugs: fixes of the deployable nodes (package node) that the
// refinement mapping cannot see, since it drives the protocol's state
// machines, not the nodes around them. They exist to prove that the trace
// checker (spec/tracecheck, docs/trace.md) can fail.
const (
	// NoCutCallCancel: the router sends no cancel call to a decode node
	// whose call it cut short, or that refused the call as it stops (the
	// fix of a request failed while its decode call was in flight): a call
	// that never reached the node leaves the request's verified pages held
	// until the node's own timeout, or past its stop.
	NoCutCallCancel Switch = 1 << (numSwitches + 2 + iota)
)

// Node lists the node switches.
func Node() []Switch { return []Switch{NoCutCallCancel} }

var names = [numSwitches]string{"admit-finished", "abort-still-sends", "no-token-check", "eager-release",
	"timeout-free", "prefill-early-free", "no-tag-check", "no-checksum", "leak-on-cancel", "no-peer-cancel", "double-free",
	"abort-frees-source", "checksum-hangs", "peer-by-name",
	"pool-wide-key", "verify-before-revoke", "unticketed-bootstrap",
	"scope-dropped", "client-scope", "evict-pinned", "prefix-count-mismatch", "write-shared", "write-uncomputed", "free-computing"}

func (s Switch) String() string {
	for i, n := range names {
		if s == 1<<i {
			return n
		}
	}
	switch s {
	case StaleStatus:
		return "stale-status"
	case SplitAcquire:
		return "split-acquire"
	case NoCutCallCancel:
		return "no-cut-call-cancel"
	}
	return fmt.Sprintf("Switch(%#x)", uint32(s))
}

// Concurrency lists the shared layer's switches.
func Concurrency() []Switch { return []Switch{StaleStatus, SplitAcquire} }

// Switches is a set of switches. The zero value, every defense on, is the only
// one code outside this module can have.
type Switches struct{ on uint32 }

// On returns the set of the given switches.
func On(sw ...Switch) Switches {
	var s Switches
	for _, x := range sw {
		s.on |= uint32(x)
	}
	return s
}

// Without returns s with the given switches off.
func (s Switches) Without(sw ...Switch) Switches {
	for _, x := range sw {
		s.on &^= uint32(x)
	}
	return s
}

// Has reports whether sw is on.
func (s Switches) Has(sw Switch) bool { return s.on&uint32(sw) != 0 }

// Any reports whether any switch is on.
func (s Switches) Any() bool { return s.on != 0 }

func (s Switches) String() string {
	var out []string
	for _, sw := range append(append(All(), Concurrency()...), Node()...) {
		if s.Has(sw) {
			out = append(out, sw.String())
		}
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, ",")
}

// All lists every switch.
func All() []Switch {
	out := make([]Switch, numSwitches)
	for i := range out {
		out[i] = 1 << i
	}
	return out
}

// Parse reads a comma-separated list of switch names. It reports which names
// are catalogue switches that the implementation does not have (done-unmatched)
// separately from names that are not switches at all.
func Parse(list string) (Switches, error) {
	var s Switches
	if list == "" || list == "none" {
		return s, nil
	}
	for _, name := range strings.Split(list, ",") {
		name = strings.TrimSpace(name)
		found := false
		for _, sw := range append(append(All(), Concurrency()...), Node()...) {
			if sw.String() == name {
				s.on |= uint32(sw)
				found = true
			}
		}
		switch {
		case found:
		case name == "done-unmatched":
			return s, fmt.Errorf("switch done-unmatched has no implementation counterpart: the wire carries no slot and Done is matched by request id")
		default:
			return s, fmt.Errorf("unknown switch %q (known: %s, stale-status, split-acquire, no-cut-call-cancel)", name, strings.Join(names[:], ", "))
		}
	}
	return s, nil
}

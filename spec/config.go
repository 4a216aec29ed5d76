package spec

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Switch is one bug of the catalogue (docs/spec.md#the-switches-and-their-counterexamples, and the peers' issue
// trackers: docs/spec.md). A set of switches is a Switches value; the zero
// value is the correct protocol.
type Switch uint32

// The switches, with exactly the catalogue's names (see Switch.String).
const (
	AdmitFinished       Switch = 1 << iota // admission checks "finished", not "rejected"
	AbortStillSends                        // an aborted sender still sends Done
	NoTokenCheck                           // decode accepts a Done whose token or page count differs
	EagerRelease                           // decode frees pages on abort while a WRITE may be in flight
	TimeoutFree                            // decode frees pages on timeout without fencing the sender
	PrefillEarlyFree                       // prefill frees source pages before their WRITEs complete
	DoneUnmatched                          // Done is matched by slot, not by request
	NoTagCheck                             // tag records and page epochs are not checked
	NoChecksum                             // payload checksums are not verified
	LeakOnCancel                           // a cancelled request's pages are never returned
	NoPeerCancel                           // a failure on one leg is not propagated to the other
	DoubleFree                             // a page can be freed twice
	AbortFreesSource                       // an aborted sender frees its source pages before its posted WRITEs complete (vLLM #21570)
	ChecksumHangs                          // a checksum mismatch at Done neither fails nor readies the request (SGLang #39729)
	PeerByName                             // the router knows a restarted prefill node by its name only, not name and incarnation: the old incarnation's requests carry on
	PoolWideKey                            // every Grant carries one remote key for the whole decode pool, never revoked (issue 17): any peer that took a Grant can WRITE any page
	VerifyBeforeRevoke                     // Done verifies while the grant's key is still live; the key is revoked only when the pages are released (the time-of-check/time-of-use window)
	UnticketedBootstrap                    // decode reserves pages for any Bootstrap, not only for a request the router dispatched to it
	ScopeDropped                           // the prefix cache's key is the token chain alone, without the scope (SGLang #37160): a hit may be another tenant's KV
	ClientScope                            // the router takes a request's scope from its body, not from the authenticated tenant
	EvictPinned                            // eviction of cached pages ignores pins: a page a live request shares is reallocated
	PrefixCountMismatch                    // prefill skips one page more than the grant's prefix: decode's hit length and prefill's skipped length disagree
	WriteShared                            // decode's Grant lists the pinned prefix pages too (prefix 0), so prefill WRITEs shared pages
	WriteUncomputed                        // prefill posts a page's WRITE before the page is computed: decode gets whoever's KV was in the source page before (stream.go)
	FreeComputing                          // an ended leg's computation goes on: a page is computed into a source page its Abort, Cancel or flush has freed (stream.go)
	numSwitches         = iota
)

var switchNames = [numSwitches]string{
	"admit-finished", "abort-still-sends", "no-token-check", "eager-release", "timeout-free",
	"prefill-early-free", "done-unmatched", "no-tag-check", "no-checksum", "leak-on-cancel",
	"no-peer-cancel", "double-free", "abort-frees-source", "checksum-hangs", "peer-by-name",
	"pool-wide-key", "verify-before-revoke", "unticketed-bootstrap",
	"scope-dropped", "client-scope", "evict-pinned", "prefix-count-mismatch", "write-shared",
	"write-uncomputed", "free-computing",
}

// AllSwitches lists every switch in catalogue order.
func AllSwitches() []Switch {
	out := make([]Switch, numSwitches)
	for i := range out {
		out[i] = 1 << i
	}
	return out
}

func (s Switch) String() string {
	for i := 0; i < numSwitches; i++ {
		if s == 1<<i {
			return switchNames[i]
		}
	}
	return fmt.Sprintf("Switch(%#x)", uint32(s))
}

// Switches is a set of switches.
type Switches uint32

// Has reports whether sw is in the set.
func (s Switches) Has(sw Switch) bool { return s&Switches(sw) != 0 }

// With returns the set plus sw.
func (s Switches) With(sw Switch) Switches { return s | Switches(sw) }

// Names lists the set's names in catalogue order.
func (s Switches) Names() []string {
	out := []string{}
	for _, sw := range AllSwitches() {
		if s.Has(sw) {
			out = append(out, sw.String())
		}
	}
	return out
}

func (s Switches) String() string {
	if s == 0 {
		return "none"
	}
	return strings.Join(s.Names(), ",")
}

// Faults is the budget b widened by what the switches need to act at all:
// peer-by-name acts only at a restart, which needs a crash, so a check of it
// (the defense matrix's, say) gives each of them at least 1. Every other
// switch acts under the one-pair deployment's faults, and b is returned as is.
func (s Switches) Faults(b Budget) Budget {
	if s.Has(PeerByName) {
		b[FaultCrash], b[FaultRestart] = max(b[FaultCrash], 1), max(b[FaultRestart], 1)
	}
	if s.Has(ClientScope) {
		b[FaultRogue] = max(b[FaultRogue], 1) // the client naming a scope in its body is the rogue fault
	}
	return b
}

// ErrUnknownSwitch is returned for a switch name not in the catalogue.
var ErrUnknownSwitch = errors.New("unknown switch")

// ParseSwitches parses a comma-separated list of switch names; "" and "none" are the empty set.
func ParseSwitches(list string) (Switches, error) {
	var out Switches
	if list == "" || list == "none" {
		return 0, nil
	}
	for _, name := range strings.Split(list, ",") {
		name = strings.TrimSpace(name)
		found := false
		for i, n := range switchNames {
			if n == name {
				out |= 1 << i
				found = true
			}
		}
		if !found {
			return 0, fmt.Errorf("%w %q (known: %s)", ErrUnknownSwitch, name, strings.Join(switchNames[:], ", "))
		}
	}
	return out, nil
}

// Fault is a kind of fault action.
type Fault int

// The faults, each with a budget in Config.Faults.
const (
	FaultCancel       Fault = iota // the client cancels a request at any point
	FaultCrash                     // the prefill node crashes
	FaultTimeout                   // decode's timer for a reserved request fires
	FaultCut                       // the queue pair breaks: everything in flight is flushed
	FaultLate                      // a posted WRITE stays in the network, placed arbitrarily later
	FaultCorrupt                   // a WRITE's payload is corrupted in transit
	FaultRogue                     // a peer WRITEs any page with any key it has held, or sends a Bootstrap for a request nobody dispatched (issue 17)
	FaultLease                     // a node's registry lease expires (the node may live on, unreachable)
	FaultRestart                   // a crashed prefill node comes back under a new incarnation (and, with Config.DecodeRestarts, a decode node crashes and comes back under one)
	FaultPartition                 // a live decode node is cut off from the router, the registry and every prefill node for good, silently (partition.go)
	FaultDataplaneCut              // the queue pairs between a live decode node and every prefill node break for good, while the registry and the router still list it (dataplane.go)
	NumFaults
)

// numClassicFaults is the faults of the one-pair deployment: "all" means
// these, and a budget prints the others only when they are not zero, so
// that the one-pair runs read as they did before the topology existed.
const numClassicFaults = FaultLease

var faultNames = [NumFaults]string{"cancel", "crash", "timeout", "cut", "late", "corrupt", "rogue", "lease", "restart", "partition", "dataplane-cut"}

func (f Fault) String() string {
	if f >= 0 && f < NumFaults {
		return faultNames[f]
	}
	return fmt.Sprintf("Fault(%d)", int(f))
}

// Budget is how many times each fault may happen in one execution.
type Budget [NumFaults]uint8

// String lists the budget as name=N pairs.
func (b Budget) String() string {
	var parts []string
	for f := Fault(0); f < NumFaults; f++ {
		if f >= numClassicFaults && b[f] == 0 {
			continue
		}
		parts = append(parts, fmt.Sprintf("%s=%d", f, b[f]))
	}
	return strings.Join(parts, ",")
}

// ErrBadFaults is returned for a malformed fault list.
var ErrBadFaults = errors.New("bad fault list")

// ParseFaults parses "name[=N],..." (a bare name means N=1); "none" is no faults;
// "all" is every fault of the one-pair deployment once (not lease, restart,
// partition or dataplane-cut), alone or in a list ("all,restart"). Faults not named get budget 0.
func ParseFaults(list string) (Budget, error) {
	var b Budget
	switch list {
	case "none", "":
		return b, nil
	case "all":
		for i := range numClassicFaults {
			b[i] = 1
		}
		return b, nil
	}
	for _, item := range strings.Split(list, ",") {
		if strings.TrimSpace(item) == "all" { // within a list: the classic faults once, then the rest as named
			for i := range numClassicFaults {
				b[i] = max(b[i], 1)
			}
			continue
		}
		name, num, hasNum := strings.Cut(strings.TrimSpace(item), "=")
		n := 1
		if hasNum {
			v, err := strconv.Atoi(num)
			if err != nil || v < 0 || v > 3 {
				return b, fmt.Errorf("%w: %q: budget must be 0..3", ErrBadFaults, item)
			}
			n = v
		}
		found := false
		for f := Fault(0); f < NumFaults; f++ {
			if f.String() == name {
				b[f] = uint8(n)
				found = true
			}
		}
		if !found {
			return b, fmt.Errorf("%w: unknown fault %q (known: %s)", ErrBadFaults, name, strings.Join(faultNames[:], ", "))
		}
	}
	return b, nil
}

// Damage is what the corrupt fault may damage in transit besides a WRITE's
// payload, which it always may.
type Damage uint8

// The kinds of damage.
const (
	DamageTag  Damage = 1 << iota // one field of a WRITE's tag record: its request, page index or epoch
	DamageSend                    // the token or page count of a Done or a Grant
	numDamage  = iota
)

var damageNames = [numDamage]string{"tag", "send"}

// Has reports whether d includes k.
func (d Damage) Has(k Damage) bool { return d&k != 0 }

func (d Damage) String() string {
	parts := []string{"payload"}
	for i, n := range damageNames {
		if d.Has(1 << i) {
			parts = append(parts, n)
		}
	}
	return strings.Join(parts, ",")
}

// ParseDamage parses a comma-separated list of payload, tag and send
// (payload is always included); "" is payload only.
func ParseDamage(list string) (Damage, error) {
	var d Damage
	for _, name := range strings.Split(list, ",") {
		name = strings.TrimSpace(name)
		switch name {
		case "", "payload":
			continue
		}
		i := slices.Index(damageNames[:], name)
		if i < 0 {
			return 0, fmt.Errorf("%w: unknown damage %q (known: payload, %s)", ErrBadFaults, name, strings.Join(damageNames[:], ", "))
		}
		d |= 1 << i
	}
	return d, nil
}

// Config is one bounded instance of the protocol.
type Config struct {
	PageSize     int   // tokens per page
	Prompts      []int // prompt length in tokens of each request
	ContextLimit int   // the advertised context length: all the router checks
	PrefillPages int   // source pages on the prefill node; its own limit is PrefillPages*PageSize tokens
	DecodePages  int   // pages in the decode pool
	DecodeSlots  int   // request slots on the decode node
	MaxInFlight  int   // WRITEs a sender may have posted and not completed, per request
	Faults       Budget
	MaxFaults    int    // faults in one execution, all kinds together; 0 means only the budgets bound them
	Damage       Damage // what the corrupt fault may damage besides a WRITE's payload
	Bugs         Switches
	// AnySourcePages lets a prefill node's intake take any free source pages,
	// in any order, instead of the lowest: every choice is explored (more
	// states). The refinement mapping turns it on, so that the Sender's pool,
	// which takes the most recently freed, makes one of the spec's choices.
	AnySourcePages bool
	// LowestPages makes decode's reservation take the lowest free pages,
	// in order: one choice where the spec otherwise explores every ordered
	// tuple of free pages. Only for a configuration whose free pages are
	// interchangeable anyway (the trace checker's one request, docs/trace.md):
	// there every choice is the same state up to the pages' names.
	LowestPages bool
	// DecodeRestarts lets the restart fault restart a decode node too: it
	// crashes and comes back at once under a new incarnation, with a fresh
	// pool whose page epochs start again from zero, no records, and new
	// queue pairs. Off, only prefill nodes restart (the state space of
	// every earlier run is unchanged).
	DecodeRestarts bool
	// StaticPeers is a deployment whose registry never loses a node
	// (node.Static, the in-process registry): the router loses a decode node
	// only when its control API stops answering, and no prefill node is
	// ever told (no PeerFailed, so no fence). A queue pair to a partitioned
	// decode node then ends by RC's retry limit, as the RetryExceeded step
	// (static.go). Off, the registry tells every prefill node.
	StaticPeers bool
	// MaxQueue bounds every channel (0: the default, MaxQueue; at most
	// QueueCapacity). A message sent on a full one is dropped and flags
	// WithinBounds: the bound, not the protocol, was too small.
	MaxQueue int
	// Mutation removes or weakens one rule of the spec (the mutation gate;
	// NoMutation, the zero value, for the protocol as it is).
	Mutation Mutation
	// The deployment: Prefills prefill and Decodes decode nodes (0 means 1),
	// each with the pools above, and a queue pair per (prefill, decode) pair.
	Prefills, Decodes int
	// PrefixCache is how many of a decode node's pages its prefix cache may
	// hold (0: no cache, the protocol without reuse; prefix.go).
	PrefixCache int
	// Scopes is each request's tenant scope (0: no reuse; 1..MaxScopes); empty
	// means 0 for every request. The router sets the request's scope from it.
	Scopes []int
	// Contents names each full page of each prompt by a letter: two requests
	// share the chain up to page i when their first i+1 letters agree. Empty
	// means "a" for every page (every prompt shares every prefix).
	Contents []string
	// PublicPrefix is a declared public prefix (a system prompt every tenant
	// may share), as the letters of its full pages; empty: none. A request
	// of a tenant scope whose contents start with it gets the public scope,
	// and its chain past the public pages is salted with its tenant
	// (prefix.go), as the node's router does.
	PublicPrefix string
}

// NumPrefills is the number of prefill nodes.
func (c *Config) NumPrefills() int { return max(1, c.Prefills) }

// QueueBound is the bound of every channel.
func (c *Config) QueueBound() int {
	if c.MaxQueue == 0 {
		return MaxQueue
	}
	return c.MaxQueue
}

// NumDecodes is the number of decode nodes.
func (c *Config) NumDecodes() int { return max(1, c.Decodes) }

// Bounds of the state encoding.
const (
	MaxRequests     = 4
	MaxDecodePages  = 8
	MaxPrefillPages = 8
	MaxSlots        = 4
	MaxQueue        = 8  // the default bound of every channel (Config.MaxQueue)
	QueueCapacity   = 12 // the largest bound Config.MaxQueue may set: the encoding's
	MaxPrefills     = 2
	MaxDecodes      = 2
	MaxScopes       = 2 // tenant scopes of the prefix cache
	MaxPrefixCache  = 4 // cached pages per decode node
)

// DefaultConfig is the incident's deployment at the default bounds: three
// requests, two that fit and one over-long; the router's advertised context
// admits the over-long one, the prefill pool does not.
func DefaultConfig() Config { return NewConfig(3, 4, 2) }

// NewConfig builds the incident-shaped configuration for the given bounds:
// requests-1 prompts of one page and one over-long prompt of PrefillPages*pageSize+1
// tokens, where the prefill pool holds half the decode pool (at least one page)
// and the router checks only the decode pool's capacity (the advertised context).
// Every fault gets budget 1 and there are two decode slots.
func NewConfig(requests, decodePages, pageSize int) Config {
	prefillPages := max(1, decodePages/2)
	c := Config{
		PageSize:     pageSize,
		ContextLimit: decodePages * pageSize,
		PrefillPages: prefillPages,
		DecodePages:  decodePages,
		DecodeSlots:  min(2, max(1, requests-1)),
		MaxInFlight:  2,
	}
	for i := 0; i < requests-1; i++ {
		c.Prompts = append(c.Prompts, pageSize)
	}
	if requests > 0 {
		c.Prompts = append(c.Prompts, prefillPages*pageSize+1)
	}
	for f := range numClassicFaults {
		c.Faults[f] = 1
	}
	return c
}

// ErrBadConfig is returned by Validate.
var ErrBadConfig = errors.New("bad configuration")

// PagesFor is the number of pages a prompt of t tokens needs.
func (c *Config) PagesFor(t int) int { return (t + c.PageSize - 1) / c.PageSize }

// PrefillLimit is the prefill node's own intake limit in tokens.
func (c *Config) PrefillLimit() int { return c.PrefillPages * c.PageSize }

// DecodeLimit is the decode node's own intake limit in tokens.
func (c *Config) DecodeLimit() int { return c.DecodePages * c.PageSize }

// MaxSourceChoices is the most choices of source pages an intake may have
// under AnySourcePages: a PrefillRecv action names its choice in the top 12
// bits of its argument (the node in the low 4), and a choice past them would
// name another's, printing a wrong trace step.
const MaxSourceChoices = 1 << 12

// intakePages is how many source pages a prefill node's intake of a prompt
// of t tokens takes: its pages, or one for a prompt over the prefill limit
// (rejected, or under admit-finished swapped for a one-page placeholder).
func (c *Config) intakePages(t int) int {
	if t > c.PrefillLimit() {
		return 1
	}
	return c.PagesFor(t)
}

// orderings is how many ordered choices of k things there are among n.
func orderings(n, k int) int {
	count := 1
	for i := range k {
		count *= n - i
	}
	return count
}

// Validate checks that the configuration fits the state encoding.
func (c *Config) Validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s", ErrBadConfig, fmt.Sprintf(format, a...))
	}
	switch {
	case len(c.Prompts) < 1 || len(c.Prompts) > MaxRequests:
		return bad("requests must be 1..%d, got %d", MaxRequests, len(c.Prompts))
	case c.PageSize < 1 || c.PageSize > 16:
		return bad("page size must be 1..16 tokens, got %d", c.PageSize)
	case c.DecodePages < 1 || c.DecodePages > MaxDecodePages:
		return bad("decode pages must be 1..%d, got %d", MaxDecodePages, c.DecodePages)
	case c.PrefillPages < 1 || c.PrefillPages > MaxPrefillPages:
		return bad("prefill pages must be 1..%d, got %d", MaxPrefillPages, c.PrefillPages)
	case c.DecodeSlots < 1 || c.DecodeSlots > MaxSlots:
		return bad("decode slots must be 1..%d, got %d", MaxSlots, c.DecodeSlots)
	case c.MaxInFlight < 1:
		return bad("max in-flight WRITEs must be at least 1")
	case c.Prefills < 0 || c.Prefills > MaxPrefills:
		return bad("prefill nodes must be 1..%d, got %d", MaxPrefills, c.Prefills)
	case c.Decodes < 0 || c.Decodes > MaxDecodes:
		return bad("decode nodes must be 1..%d, got %d", MaxDecodes, c.Decodes)
	case c.MaxQueue < 0 || c.MaxQueue > QueueCapacity:
		return bad("the queue bound must be 1..%d (0: %d), got %d", QueueCapacity, MaxQueue, c.MaxQueue)
	case c.Mutation >= NumMutations:
		return bad("unknown mutation %d", c.Mutation)
	case c.ContextLimit < 1:
		return bad("context limit must be at least 1 token")
	case c.PrefixCache < 0 || c.PrefixCache > MaxPrefixCache:
		return bad("the prefix cache must hold 0..%d pages, got %d", MaxPrefixCache, c.PrefixCache)
	case len(c.Scopes) != 0 && len(c.Scopes) != len(c.Prompts):
		return bad("scopes: one per request (%d), got %d", len(c.Prompts), len(c.Scopes))
	case len(c.Contents) != 0 && len(c.Contents) != len(c.Prompts):
		return bad("contents: one per request (%d), got %d", len(c.Prompts), len(c.Contents))
	case c.DecodeRestarts && c.Faults[FaultRestart] == 0:
		return bad("decode restarts are restarts: give the restart fault a budget too")
	case c.StaticPeers && c.Faults[FaultLease] > 0:
		return bad("static peers have no leases: the router's own loss of a partitioned decode node is the partition's (static.go)")
	case c.StaticPeers && c.DecodeRestarts:
		return bad("static peers and decode restarts: a restarted decode node's news reaches prefill nodes through the registry, which static peers do not change")
	case c.Faults[FaultRestart] > 0 && c.Faults[FaultCrash] == 0 && !c.DecodeRestarts:
		return bad("a restart brings back a crashed prefill node: give the crash fault a budget too")
	}
	for i, t := range c.Prompts {
		if t < 1 || t > 127 {
			return bad("prompt %d: length must be 1..127 tokens, got %d", i, t)
		}
		// A prompt the router admits may be granted up to DecodePages pages.
		if t <= c.ContextLimit && c.PagesFor(t) > MaxDecodePages {
			return bad("prompt %d: %d pages exceed the encoding's %d", i, c.PagesFor(t), MaxDecodePages)
		}
		// With AnySourcePages each choice of an intake's source pages is a
		// successor (Model.sourceChoices): at most this many, the pool free.
		if n := orderings(c.PrefillPages, c.intakePages(t)); c.AnySourcePages && n > MaxSourceChoices {
			return bad("prompt %d: any source pages: its intake may take %d pages of the %d-page prefill pool in %d orders, more than the %d an action can name", i, c.intakePages(t), c.PrefillPages, n, MaxSourceChoices)
		}
		if len(c.Scopes) > 0 && (c.Scopes[i] < 0 || c.Scopes[i] > MaxScopes) {
			return bad("request %d: scope must be 0..%d, got %d", i, MaxScopes, c.Scopes[i])
		}
		if len(c.Contents) > 0 {
			if len(c.Contents[i]) != t/c.PageSize {
				return bad("request %d: contents %q must name its %d full pages, one letter each", i, c.Contents[i], t/c.PageSize)
			}
			for _, ch := range c.Contents[i] {
				if ch < 'a' || ch > 'z' {
					return bad("request %d: contents %q: pages are named a..z", i, c.Contents[i])
				}
			}
		}
	}
	for _, ch := range c.PublicPrefix {
		if ch < 'a' || ch > 'z' {
			return bad("public prefix %q: pages are named a..z", c.PublicPrefix)
		}
	}
	if (len(c.Scopes) > 0 || len(c.Contents) > 0 || c.PublicPrefix != "") && c.PrefixCache == 0 {
		return bad("scopes and contents describe the prefix cache: give it a capacity too")
	}
	return nil
}

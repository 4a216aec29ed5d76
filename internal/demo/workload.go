package demo

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"time"
)

// Tenant is one customer of the deployment; Canary is a string that occurs
// in its prompts and nowhere else.
type Tenant struct {
	Name   string
	Canary string
	// Tag is a character of the tenant's own, just before its canary in
	// its prompts and in its question.
	Tag byte
	// Prober is the hostile tenant of a Prefixes workload: it only probes
	// other tenants' cached prefixes (RequestProbe).
	Prober bool
}

// Request is one client request of the workload.
type Request struct {
	Index     int // position in the workload, also the request's name: "req-<Index>"
	Tenant    int // index into Workload.Tenants
	Prompt    string
	MaxTokens int
	// OverLimit: the prompt is longer than the deployment's limit (the
	// smallest pool), so the only honest outcome is rejected.
	OverLimit bool
	// Disconnect, if positive: the client goes away this long after sending,
	// mid-transfer; its request must end cancelled (or have finished first).
	Disconnect time.Duration
	// Kind is the prompt's shape in a Prefixes workload (RequestOwn, ...).
	Kind string
	// BodyScope is the cache scope the request's body names (cache_salt):
	// only the prober's, naming another tenant. A deployment must refuse it.
	BodyScope string
}

// The prompt shapes of a Prefixes workload.
const (
	RequestOwn    = "own"    // the tenant's own system text, then filler and the question
	RequestTurn   = "turn"   // a conversation's next turn: an earlier prompt, its answer, a follow-up question
	RequestPublic = "public" // the declared public system prompt, then the tenant's own prompt
	RequestCommon = "common" // a system prompt every tenant uses but no one declared public
	RequestProbe  = "probe"  // the prober: the common system prompt, its body naming a victim's scope
)

// PublicSystem is the system prompt the demo's deployment declares public
// ("desk"): every tenant may read its cached pages. CommonSystem is one
// every tenant uses too, undeclared: each tenant's requests share only
// their own copy of it, and a hit on another tenant's is a cross-scope hit.
const (
	PublicSystem = "System (desk): quote the key as given, exactly. "
	CommonSystem = "System (common): be brief; quote keys exactly. "
)

// Name is the request's name in reports.
func (r Request) Name() string { return fmt.Sprintf("req-%d", r.Index) }

// Workload is the demo's requests and their tenants.
type Workload struct {
	Tenants  []Tenant
	Requests []Request
	// PageTokens is the page size the prompts are aligned to (Spec.Align).
	PageTokens int
}

// Spec sizes a workload.
type Spec struct {
	Seed     uint64
	Requests int // 0 means 1000
	Tenants  int // 0 means 8
	// Limit is the deployment's limit in tokens (the smallest pool): prompts
	// fit it except the over-limit ones, which exceed it.
	Limit int
	// Context is the model's context: no prompt plus its generation exceeds it.
	Context   int
	MaxTokens int // tokens generated per request; 0 means 16
	// OverLimitTokens is the length of the over-limit prompts; 0 means half
	// again the limit (at most what the context leaves).
	OverLimitTokens int
	// WarmUp is how many requests come first that are never over the limit:
	// they leave every decode page holding some tenant's KV.
	WarmUp int
	// Align, if positive, makes every prompt's length a multiple of it (the
	// page size): decode then appends its tokens in pages of its own and
	// never writes into a granted page.
	Align int
	// OverLimit and Disconnect are the fractions of requests over the limit
	// and of clients that disconnect; negative means none.
	OverLimit, Disconnect float64
	// Prefixes adds the prefix cache's traffic: conversations of two turns
	// (the second's prompt is the first's, its answer, and a follow-up
	// question), the public and the common system prompts, and a prober
	// tenant (the last) whose requests name another tenant's scope in their
	// body. Answer is the colocated run's answer to a prompt (the second
	// turns' text); it is required with Prefixes.
	Prefixes bool
	Answer   func(prompt string, maxTokens int) (string, error)
}

// canaryAlphabet excludes nothing the byte model cannot copy; it avoids
// characters the prompts use elsewhere so a canary never occurs by chance.
const canaryAlphabet = "ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789"

// filler is the tenants' ordinary text, the same for every tenant, so that
// only the canary tells one tenant's KV from another's.
var filler = []string{
	"Quarterly notes for the account. Shipping was on time and the invoice was paid. ",
	"The meeting moved to Thursday; bring the signed forms and the badge. ",
	"Support ticket summary: the customer asked about the export format twice. ",
	"Reminder: rotate the keys before the audit and archive the old logs. ",
}

// question is what every prompt of t ends with: the built-in model's copy
// head answers it with the canary that followed the same three bytes (the
// tenant's tag between spaces) earlier in what it reads.
func question(t Tenant) string { return fmt.Sprintf(" Later: the key is %c ", t.Tag) }

// intro is how every prompt starts, after BOS: with the question's last
// byte, then the tag and the canary within a few tokens. A decode node that
// reads stale KV without the prompt's own previous tokens (the incident)
// falls back on BOS, the built-in model's attention sink, and its copy head
// then continues the start of whatever prompt the stale pages hold. Where
// they hold several tenants' prompts, their codes blend at the first byte
// that differs, the tag, which may come out garbled; the next three steps
// still see it and follow the one tenant whose tag is nearest, so the
// canary after it comes out whole, in the answer's first 24 tokens.
func intro(t Tenant) string {
	return fmt.Sprintf(" Key is %c %s. Account of %s. ", t.Tag, t.Canary, t.Name)
}

// NewWorkload draws a workload from spec.Seed: the same seed, the same
// requests. Each tenant has a few prompt variants (the colocated reference
// runs once per distinct prompt), each carrying the tenant's canary once
// near the start and ending with the question that makes the model repeat it.
func NewWorkload(spec Spec) (Workload, error) {
	if spec.Requests == 0 {
		spec.Requests = 1000
	}
	if spec.Tenants == 0 {
		spec.Tenants = 8
	}
	if spec.MaxTokens == 0 {
		spec.MaxTokens = 16
	}
	if spec.OverLimit == 0 {
		spec.OverLimit = 0.05
	}
	if spec.Disconnect == 0 {
		spec.Disconnect = 0.05
	}
	if spec.Requests < 1 || spec.Tenants < 2 || spec.Limit < 64 || spec.Context < spec.Limit {
		return Workload{}, fmt.Errorf("demo: a workload needs requests, at least 2 tenants, a limit of at least 64 tokens and a context no shorter (got %d requests, %d tenants, limit %d, context %d)",
			spec.Requests, spec.Tenants, spec.Limit, spec.Context)
	}
	rng := rand.New(rand.NewPCG(spec.Seed, 0x6b7668616e646f66))
	w := Workload{PageTokens: spec.Align}
	// Every leakProbe characters of a canary are its own: in no other
	// canary, and not in the text the tenants share.
	shared := strings.Join(filler, "")
	for t := range spec.Tenants {
		tn := Tenant{Name: fmt.Sprintf("tenant-%d", t), Tag: canaryAlphabet[t%len(canaryAlphabet)]}
		shared += intro(tn) + question(tn)
	}
	seen := map[string]bool{}
	unique := func(c string) bool {
		if seen[c[:2]] { // the copy head tells canaries apart by two bytes
			return false
		}
		for i := 0; i+leakProbe <= len(c); i++ {
			if seen[c[i:i+leakProbe]] || strings.Contains(shared, c[i:i+leakProbe]) {
				return false
			}
		}
		return true
	}
	for t := range spec.Tenants {
		var c string
		for c == "" || !unique(c) {
			b := make([]byte, 12)
			for i := range b {
				b[i] = canaryAlphabet[rng.IntN(len(canaryAlphabet))]
			}
			c = string(b[:4]) + "-" + string(b[4:8]) + "-" + string(b[8:])
		}
		seen[c[:2]] = true
		for i := 0; i+leakProbe <= len(c); i++ {
			seen[c[i:i+leakProbe]] = true
		}
		w.Tenants = append(w.Tenants, Tenant{Name: fmt.Sprintf("tenant-%d", t), Canary: c, Tag: canaryAlphabet[t%len(canaryAlphabet)]})
	}
	if spec.Prefixes {
		if spec.Answer == nil {
			return Workload{}, fmt.Errorf("demo: a Prefixes workload needs the colocated answers")
		}
		// The prober: a tenant of its own, whose canary nothing else holds
		// (its tag is the next one).
		p := Tenant{Name: fmt.Sprintf("tenant-%d", spec.Tenants), Tag: canaryAlphabet[spec.Tenants%len(canaryAlphabet)], Prober: true}
		p.Canary = "prober-none"
		w.Tenants = append(w.Tenants, p)
	}
	const variants = 4
	fits := spec.Limit - spec.MaxTokens // the generation stays inside the decode node's context too
	prompts := make([][]string, len(w.Tenants))
	long := make([]string, len(w.Tenants))
	for t, tn := range w.Tenants {
		for v := range variants {
			// from about a quarter of the limit to about all of it
			target := align(fits/4+v*(fits-fits/4)/variants, spec.Align)
			prompts[t] = append(prompts[t], prompt(tn, v, target, spec.Align))
		}
		over := spec.Limit + spec.Limit/2
		if spec.OverLimitTokens > 0 {
			over = spec.OverLimitTokens
		}
		over = align(min(spec.Context-spec.MaxTokens, over), spec.Align)
		long[t] = prompt(tn, 0, over, spec.Align)
	}
	// turns are each tenant's first turns so far, for second turns to follow.
	turns := make([][]Request, spec.Tenants)
	for i := range spec.Requests {
		t := rng.IntN(spec.Tenants)
		r := Request{Index: i, Tenant: t, MaxTokens: spec.MaxTokens, Kind: RequestOwn}
		switch x := rng.Float64(); {
		case spec.OverLimit > 0 && x < spec.OverLimit && i >= spec.WarmUp:
			r.Prompt, r.OverLimit = long[t], true
		case spec.Prefixes:
			if err := prefixRequest(&r, rng, w, spec, fits, prompts, turns); err != nil {
				return Workload{}, err
			}
		default:
			r.Prompt = prompts[t][rng.IntN(variants)]
		}
		if spec.Disconnect > 0 && rng.Float64() < spec.Disconnect {
			r.Disconnect = disconnectAfter(rng)
		}
		w.Requests = append(w.Requests, r)
	}
	return w, nil
}

// disconnectAfter draws how long after sending a disconnecting client goes
// away: log-uniform from 0.1 ms to 1 s, so that as many land in each decade
// of a request's life (before its Grant, while its pages are written, while
// it is read) on a machine of any speed or load. A narrow window misses
// whole phases on a busy machine: 0.1 to 3.1 ms ended nearly every request
// before its decode node granted it on 2 loaded cores.
func disconnectAfter(rng *rand.Rand) time.Duration {
	const lo, hi = 100 * time.Microsecond, time.Second
	return time.Duration(float64(lo) * math.Pow(float64(hi)/float64(lo), rng.Float64()))
}

// prefixRequest draws r's shape in a Prefixes workload (its tenant drawn):
// a conversation's first or second turn, a public or common system prompt,
// the tenant's own prompt, or (2%) the prober's probe. A second turn follows
// a first turn of its tenant drawn at least 48 requests earlier, so that
// most have finished and their pages are cached.
func prefixRequest(r *Request, rng *rand.Rand, w Workload, spec Spec, fits int, prompts [][]string, turns [][]Request) error {
	t := r.Tenant
	tn := w.Tenants[t]
	x := rng.Float64()
	switch {
	case x < 0.02:
		prober := len(w.Tenants) - 1
		r.Tenant, r.Kind = prober, RequestProbe
		r.BodyScope = w.Tenants[t].Name // a victim
		r.Prompt = withSystem(CommonSystem, w.Tenants[prober], fits, spec.Align)
	case x < 0.20:
		r.Kind, r.Prompt = RequestPublic, withSystem(PublicSystem, tn, fits, spec.Align)
	case x < 0.35:
		r.Kind, r.Prompt = RequestCommon, withSystem(CommonSystem, tn, fits, spec.Align)
	case x < 0.65:
		var first []Request
		for _, f := range turns[t] {
			if f.Index <= r.Index-48 {
				first = append(first, f)
			}
		}
		if len(first) > 0 && rng.IntN(2) == 0 {
			f := first[rng.IntN(len(first))]
			answer, err := spec.Answer(f.Prompt, f.MaxTokens)
			if err != nil {
				return err
			}
			r.Kind, r.Prompt = RequestTurn, nextTurn(f.Prompt, answer, tn, fits, spec.Align)
			if 1+len(r.Prompt) <= fits {
				return nil
			}
		}
		// A first turn: the shortest prompt of the tenant's and a short
		// answer, so that the second turn fits the limit.
		r.Kind, r.Prompt, r.MaxTokens = RequestOwn, prompt(tn, rng.IntN(4), 0, spec.Align), max(1, spec.MaxTokens/2)
		turns[t] = append(turns[t], *r)
	default:
		r.Prompt = prompts[t][rng.IntN(len(prompts[t]))]
	}
	return nil
}

// withSystem is a system prompt, then the tenant's intro and filler to
// about 3/4 of what fits, then its question.
func withSystem(system string, t Tenant, fits, alignTo int) string {
	target := align(fits*3/4, alignTo)
	body := prompt(t, 0, target-len(system), alignTo)
	return system + body
}

// followUp is a second turn's question: the copy head answers it with the
// tenant's name, which follows the same three bytes once in the prompt
// (asking for the key again would find it twice, once cut short in the
// first turn's answer, and blend the two).
const followUp = " Account of "

// nextTurn is a conversation's second turn: the first turn's prompt, its
// answer, then the follow-up question, padded so that its length stays a
// multiple of alignTo.
func nextTurn(first, answer string, t Tenant, fits, alignTo int) string {
	q := followUp
	// The answer as printable ASCII: BOS is no text, and a byte that is not
	// UTF-8 would not cross the JSON API unchanged.
	s := first + strings.Map(func(r rune) rune {
		if r < 0x20 || r > 0x7e {
			return '.'
		}
		return r
	}, answer)
	text := align(1+len(s)+len(q)+max(alignTo, 1)-1, alignTo) - 1
	for i := 0; len(s)+len(q) < text; i++ {
		s += string(" ."[i%2])
	}
	return s + q
}

// align rounds n down to a multiple of a (if a > 0).
func align(n, a int) int {
	if a > 0 {
		return n / a * a
	}
	return n
}

// prompt is tenant t's prompt variant v, about target tokens long (BOS
// and the text's bytes, tokens of the byte vocabulary), or the shortest
// multiple of alignTo that holds the intro and the question.
func prompt(t Tenant, v, target, alignTo int) string {
	in, q := intro(t), question(t)
	if least := 1 + len(in) + len(q); target < least {
		target = align(least+max(alignTo, 1)-1, alignTo)
	}
	text := target - 1 // BOS is the first token
	var b strings.Builder
	b.WriteString(in)
	for i := v; b.Len()+len(q) < text; i++ {
		b.WriteString(filler[i%len(filler)])
	}
	s := b.String()
	if len(s)+len(q) > text {
		s = s[:max(len(in), text-len(q))] // cut the filler, never the canary
	}
	return s + q
}

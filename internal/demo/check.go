package demo

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"
)

// Kind is a request's client-visible outcome.
type Kind string

// The outcomes.
const (
	OK        Kind = "ok"
	Rejected  Kind = "rejected"
	Cancelled Kind = "cancelled"
	Failed    Kind = "failed"
)

// Outcome is what a client saw for one request.
type Outcome struct {
	Request Request
	Kind    Kind
	// Reason is a failure's reason (node.Reason's closed set: tag, tokens,
	// checksum, pages, timeout, peer, cancelled, rejected, other); Err its
	// message. A non-OK outcome without a message is not explicit.
	Reason  string
	Err     string
	Tokens  []int
	Text    string
	Latency time.Duration
	// Cached is the prompt tokens a success read from the prefix cache;
	// Sent and Ended are when the request was sent and answered, from the
	// run's start.
	Cached      int
	Sent, Ended time.Duration
}

// Leak is a success whose text carries another tenant's canary.
type Leak struct {
	Request       string `json:"request"`
	Tenant        string `json:"tenant"`
	ForeignTenant string `json:"foreign_tenant"`
	Text          string `json:"text"`
}

// Report is the verdict over a run.
type Report struct {
	Requests   int
	ByKind     map[Kind]int
	ByReason   map[string]int    // "kind/reason" of every non-OK outcome
	Example    map[string]string // the first error message of each "kind/reason"
	Coherent   int               // successes equal to the colocated run
	Incoherent int               // successes that differ, or that should not have succeeded (over the limit, a body naming a scope)
	Silent     int               // non-OK outcomes without an error message
	// Unexplained are failures nothing the demo did explains (explain): no
	// fault it injected, no client going away, no prompt over the limit. A
	// defense turned a bug of the deployment into an explicit failure, which
	// a healthy deployment never gives; Unexplanations names up to a few.
	Unexplained    int
	Unexplanations []string
	// CachedWritten names each prefix cache page seen written while cached
	// (InProcess.WatchCache; in process only): nothing may write one.
	CachedWritten []string
	Leaks         []Leak
	PagesLeaked   int
	PagesByNode   map[string]int // pages still owned or quarantined at the end, per node
	Seconds       float64
	P50, P99      time.Duration // over successes
	// Incoherences names up to a few incoherent successes, for the report.
	Incoherences []string
	// PrefixHits are successes that read prompt tokens from the prefix
	// cache, PrefixHitTokens those tokens; CrossScopeHits are hits longer
	// than anything the request's own scope can have cached (each also a
	// Leak: a cross-tenant hit is a timing side channel).
	PrefixHits, PrefixHitTokens, CrossScopeHits int
}

// leakProbe is how much of a canary counts as leaked: any half-dozen
// consecutive characters of it (the workload makes sure none occurs in
// another tenant's canary or in the text the tenants share). A canary whose
// first character came out garbled is leaked all the same.
const leakProbe = 6

// Check judges every outcome: a success must equal ref's run of the same
// prompt and carry no other tenant's canary; an over-limit request must not
// succeed; every other outcome must say why, and be explained by something
// the demo did (injected: the faults it injected, counted). pagesLeft is each
// node's count of pages still owned or quarantined after the run.
func Check(w Workload, outs []Outcome, ref *Reference, injected Faults, pagesLeft map[string]int, elapsed time.Duration) (*Report, error) {
	rep := &Report{Requests: len(outs), ByKind: map[Kind]int{}, ByReason: map[string]int{}, Example: map[string]string{}, PagesByNode: map[string]int{}, Seconds: elapsed.Seconds()}
	var lat []time.Duration
	corruptionFailures := 0
	for _, o := range outs {
		rep.ByKind[o.Kind]++
		if o.Kind != OK {
			key := string(o.Kind) + "/" + o.Reason
			rep.ByReason[key]++
			if _, ok := rep.Example[key]; !ok {
				rep.Example[key] = o.Request.Name() + ": " + o.Err
			}
			why := explain(o, injected)
			if why == corrupted {
				// One corrupted WRITE fails at most the one request it
				// was for: failures past that count are a bug's.
				if corruptionFailures++; corruptionFailures > injected.Corruptions {
					why = ""
				}
			}
			if strings.TrimSpace(o.Err) == "" {
				rep.Silent++
			} else if why == "" {
				rep.Unexplained++
				if len(rep.Unexplanations) < 5 {
					rep.Unexplanations = append(rep.Unexplanations, fmt.Sprintf("%s (%s): %s/%s: %s", o.Request.Name(), w.Tenants[o.Request.Tenant].Name, o.Kind, o.Reason, clip(o.Err, 160)))
				}
			}
			continue
		}
		lat = append(lat, o.Latency)
		r := o.Request
		if leak, ok := foreignCanary(w, r, o.Text); ok {
			rep.Leaks = append(rep.Leaks, leak)
		}
		if o.Cached > 0 {
			rep.PrefixHits++
			rep.PrefixHitTokens += o.Cached
			if leak, ok := crossScope(w, outs, o, pageTokensOf(w)); ok {
				rep.CrossScopeHits++
				rep.Leaks = append(rep.Leaks, leak)
			}
		}
		if r.OverLimit {
			rep.Incoherent++
			rep.note(fmt.Sprintf("%s (%s): a prompt over the deployment's limit succeeded: %q", r.Name(), w.Tenants[r.Tenant].Name, o.Text))
			continue
		}
		if r.BodyScope != "" {
			// A request never names its own scope: the router refuses
			// one whose body does (400), whatever it then would read.
			rep.Incoherent++
			rep.note(fmt.Sprintf("%s (%s): a request whose body names a cache scope (%s's) succeeded: %q", r.Name(), w.Tenants[r.Tenant].Name, r.BodyScope, o.Text))
			continue
		}
		want, err := ref.Tokens(r.Prompt, r.MaxTokens)
		if err != nil {
			return nil, fmt.Errorf("demo: the colocated run of %s: %w", r.Name(), err)
		}
		if slices.Equal(want, o.Tokens) {
			rep.Coherent++
		} else {
			rep.Incoherent++
			rep.note(fmt.Sprintf("%s (%s): %q, the colocated run gives %q", r.Name(), w.Tenants[r.Tenant].Name, o.Text, ref.Text(r.Prompt, want)))
		}
	}
	for n, p := range pagesLeft {
		rep.PagesByNode[n] = p
		rep.PagesLeaked += p
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	rep.P50, rep.P99 = quantile(lat, 0.50), quantile(lat, 0.99)
	return rep, nil
}

// pageTokensOf is the page size the workload's prompts are aligned to.
func pageTokensOf(w Workload) int {
	if w.PageTokens > 0 {
		return w.PageTokens
	}
	return 16
}

// crossScope judges a success's prefix hit against what its own scope can
// have held: the pages its prompt shares with a request of its own tenant
// that was sent before it was answered (none of those the prober's, whose
// bodies name other scopes), and the declared public prompt's pages. A
// longer hit read pages another scope cached: a Leak naming a tenant whose
// prompt shares them.
func crossScope(w Workload, outs []Outcome, o Outcome, pt int) (Leak, bool) {
	r := o.Request
	own := 0
	if strings.HasPrefix(r.Prompt, PublicSystem) {
		own = (1 + len(PublicSystem)) / pt * pt
	}
	foreign := ""
	for _, p := range outs {
		q := p.Request
		if q.Index == r.Index || p.Sent > o.Ended || q.OverLimit {
			continue
		}
		shared := (1 + commonPrefix(q.Prompt, r.Prompt)) / pt * pt
		switch {
		case q.Tenant == r.Tenant && q.BodyScope == "":
			own = max(own, shared)
		case q.Tenant != r.Tenant && shared >= o.Cached && foreign == "":
			foreign = w.Tenants[q.Tenant].Name
		}
	}
	if o.Cached <= own {
		return Leak{}, false
	}
	if foreign == "" {
		foreign = "another scope"
	}
	return Leak{Request: r.Name(), Tenant: w.Tenants[r.Tenant].Name, ForeignTenant: foreign,
		Text: fmt.Sprintf("a prefix cache hit of %d prompt tokens, past the %d its own scope can hold: a cross-scope hit", o.Cached, own)}, true
}

func commonPrefix(a, b string) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

func (rep *Report) note(s string) {
	if len(rep.Incoherences) < 5 {
		rep.Incoherences = append(rep.Incoherences, s)
	}
}

// foreignCanary finds another tenant's canary (leakProbe consecutive
// characters of it, or more) in a success's text; of several, the tenant
// with the longest run of its canary.
func foreignCanary(w Workload, r Request, text string) (Leak, bool) {
	best, longest := -1, leakProbe-1
	for i, t := range w.Tenants {
		if n := longestCommonRun(text, t.Canary); i != r.Tenant && n > longest {
			best, longest = i, n
		}
	}
	if best < 0 {
		return Leak{}, false
	}
	return Leak{Request: r.Name(), Tenant: w.Tenants[r.Tenant].Name, ForeignTenant: w.Tenants[best].Name, Text: text}, true
}

// longestCommonRun is the length of the longest string that is in both a and b.
func longestCommonRun(a, b string) int {
	longest := 0
	prev, cur := make([]int, len(b)+1), make([]int, len(b)+1)
	for i := 1; i <= len(a); i++ {
		for j := 1; j <= len(b); j++ {
			if a[i-1] == b[j-1] {
				cur[j] = prev[j-1] + 1
				longest = max(longest, cur[j])
			} else {
				cur[j] = 0
			}
		}
		prev, cur = cur, prev
	}
	return longest
}

func quantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[min(len(sorted)-1, int(q*float64(len(sorted))))]
}

// Passed is the verdict: no leak, no incoherent success, no page leaked, and
// every failure explicit and explained, no cached page written.
func (rep *Report) Passed() bool {
	return len(rep.Leaks) == 0 && rep.Incoherent == 0 && rep.PagesLeaked == 0 && rep.Silent == 0 && rep.Unexplained == 0 && len(rep.CachedWritten) == 0
}

// HandoffsPerSecond is successful handoffs per second of the run.
func (rep *Report) HandoffsPerSecond() float64 {
	if rep.Seconds <= 0 {
		return 0
	}
	return float64(rep.ByKind[OK]) / rep.Seconds
}

// reportJSON is the --json object, field for field as issue 11 gives it.
type reportJSON struct {
	Requests     int     `json:"requests"`
	OK           int     `json:"ok"`
	Rejected     int     `json:"rejected"`
	Cancelled    int     `json:"cancelled"`
	Failed       int     `json:"failed"`
	Coherent     int     `json:"coherent"`
	Incoherent   int     `json:"incoherent"`
	Leaks        int     `json:"leaks"`
	PagesLeaked  int     `json:"pages_leaked"`
	Seconds      float64 `json:"seconds"`
	HandoffsPerS float64 `json:"handoffs_per_s"`
	LeakExamples []Leak  `json:"leak_examples"`
	// The prefix cache: successes that read cached prompt tokens, those
	// tokens, and hits past what the request's own scope can hold (each a
	// leak too; must be 0).
	PrefixHits      int `json:"prefix_hits"`
	PrefixHitTokens int `json:"prefix_hit_tokens"`
	CrossScopeHits  int `json:"cross_scope_hits"`
	// Unexplained: failures no fault the demo injected explains (must be 0).
	Unexplained int `json:"unexplained"`
	// CachedPagesWritten: prefix cache pages seen written while cached (must be 0).
	CachedPagesWritten int `json:"cached_pages_written"`
}

// WriteJSON writes the report as one JSON object.
func (rep *Report) WriteJSON(w io.Writer) error {
	ex := rep.Leaks
	if len(ex) > 10 {
		ex = ex[:10]
	}
	if ex == nil {
		ex = []Leak{}
	}
	return json.NewEncoder(w).Encode(reportJSON{
		Requests: rep.Requests, OK: rep.ByKind[OK], Rejected: rep.ByKind[Rejected], Cancelled: rep.ByKind[Cancelled],
		Failed: rep.ByKind[Failed], Coherent: rep.Coherent, Incoherent: rep.Incoherent, Leaks: len(rep.Leaks),
		PagesLeaked: rep.PagesLeaked, Seconds: rep.Seconds, HandoffsPerS: rep.HandoffsPerSecond(), LeakExamples: ex,
		PrefixHits: rep.PrefixHits, PrefixHitTokens: rep.PrefixHitTokens, CrossScopeHits: rep.CrossScopeHits,
		Unexplained: rep.Unexplained, CachedPagesWritten: len(rep.CachedWritten),
	})
}

// WriteTable writes the summary table, then every leak (up to a few) with
// the leaked text, and the verdict.
func (rep *Report) WriteTable(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "requests\t%d\n", rep.Requests)
	for _, k := range []Kind{OK, Rejected, Cancelled, Failed} {
		fmt.Fprintf(tw, "  %s\t%d\n", k, rep.ByKind[k])
	}
	var reasons []string
	for r := range rep.ByReason {
		reasons = append(reasons, r)
	}
	sort.Strings(reasons)
	for _, r := range reasons {
		fmt.Fprintf(tw, "    %s\t%d\t(%s)\n", r, rep.ByReason[r], clip(rep.Example[r], 110))
	}
	fmt.Fprintf(tw, "coherent (= colocated run)\t%d\n", rep.Coherent)
	fmt.Fprintf(tw, "incoherent\t%d\n", rep.Incoherent)
	fmt.Fprintf(tw, "failures without a reason\t%d\n", rep.Silent)
	fmt.Fprintf(tw, "failures no injected fault explains\t%d\n", rep.Unexplained)
	fmt.Fprintf(tw, "leaks (another tenant's canary or cached prefix)\t%d\n", len(rep.Leaks))
	fmt.Fprintf(tw, "prefix cache hits / tokens\t%d / %d\n", rep.PrefixHits, rep.PrefixHitTokens)
	fmt.Fprintf(tw, "cross-scope hits\t%d\n", rep.CrossScopeHits)
	fmt.Fprintf(tw, "cached pages written while cached\t%d\n", len(rep.CachedWritten))
	fmt.Fprintf(tw, "pages leaked\t%d\n", rep.PagesLeaked)
	fmt.Fprintf(tw, "handoffs/s\t%.1f\n", rep.HandoffsPerSecond())
	fmt.Fprintf(tw, "latency p50 / p99\t%v / %v\n", rep.P50.Round(time.Microsecond), rep.P99.Round(time.Microsecond))
	fmt.Fprintf(tw, "seconds\t%.2f\n", rep.Seconds)
	tw.Flush()
	for i, l := range rep.Leaks {
		if i == 10 {
			fmt.Fprintf(w, "... and %d more leaks\n", len(rep.Leaks)-i)
			break
		}
		if strings.HasPrefix(l.Text, "a prefix cache hit") {
			fmt.Fprintf(w, "LEAK %s of %s read %s's cached prefix: %s\n", l.Request, l.Tenant, l.ForeignTenant, l.Text)
			continue
		}
		fmt.Fprintf(w, "LEAK %s of %s answered with %s's canary: %q\n", l.Request, l.Tenant, l.ForeignTenant, l.Text)
	}
	for _, s := range rep.Incoherences {
		fmt.Fprintf(w, "INCOHERENT %s\n", s)
	}
	for _, s := range rep.Unexplanations {
		fmt.Fprintf(w, "UNEXPLAINED %s\n", s)
	}
	for i, s := range rep.CachedWritten {
		if i == 5 {
			fmt.Fprintf(w, "... and %d more cached pages written\n", len(rep.CachedWritten)-i)
			break
		}
		fmt.Fprintf(w, "CACHED PAGE WRITTEN %s\n", s)
	}
	var nodes []string
	for n, p := range rep.PagesByNode {
		if p > 0 {
			nodes = append(nodes, fmt.Sprintf("%s: %d", n, p))
		}
	}
	sort.Strings(nodes)
	if len(nodes) > 0 {
		fmt.Fprintf(w, "PAGES LEFT %s\n", strings.Join(nodes, ", "))
	}
	if rep.Passed() {
		fmt.Fprintln(w, "PASS: no leak, every success equal to the colocated run, every failure explicit and explained, no cached page written, no page left owned")
	} else {
		fmt.Fprintln(w, "FAIL")
	}
}

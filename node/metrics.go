package node

import (
	"net/http"
	"runtime"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvhandoff/kvhandoff/transfer"
)

// Metrics are one process's Prometheus metrics, on its own registry (so
// that several nodes in one process keep theirs apart). Names follow
// Prometheus's conventions: base units (seconds, bytes), _total counters,
// closed label sets.
type Metrics struct {
	reg        *prometheus.Registry
	handoffs   *prometheus.CounterVec   // role, outcome
	failures   *prometheus.CounterVec   // role, reason
	bytes      *prometheus.CounterVec   // role
	duration   *prometheus.HistogramVec // role
	fenceWait  prometheus.Histogram
	requests   *prometheus.CounterVec   // router's client requests by HTTP status code class
	retries    prometheus.Counter       // router: attempts retried for want of room
	promptTok  prometheus.Counter       // router: prompt tokens of answered requests
	genTok     prometheus.Counter       // router: generated tokens answered
	ttft       prometheus.Histogram     // router: dispatch to the first token at the router
	tpot       prometheus.Histogram     // router: per output token, after the first
	latency    *prometheus.HistogramVec // router: client request end to end, by status code
	waiting    prometheus.Gauge         // router: requests waiting for room (between retries)
	nodeEvents *prometheus.CounterVec   // router: nodes joined, lost, rejoined, by role
	// afterCancel, decode: tokens generated for a request no one waited
	// for any more (at most the step in flight when the cancel came).
	afterCancel prometheus.Counter
	prefixHits  *prometheus.CounterVec // decode: requests that reused a cached prefix, by scope label
	prefixTok   *prometheus.CounterVec // decode: prompt tokens reused from the cache, by scope label
}

// outcomes is the handoffs' outcome label's closed set.
var outcomes = []string{"success", "rejected", "cancelled", "failed"}

func outcomeOf(err error) string {
	switch Reason(err) {
	case "":
		return "success"
	case "rejected":
		return "rejected"
	case "cancelled":
		return "cancelled"
	}
	return "failed"
}

// NewMetrics is an empty set of metrics with Go's and the process's own.
func NewMetrics() *Metrics {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m := &Metrics{
		reg: reg,
		handoffs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvhandoff_handoffs_total",
			Help: "Handoff legs ended on this node, by role and outcome (success, rejected, cancelled, failed)."}, []string{"role", "outcome"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvhandoff_handoff_failures_total",
			Help: "Handoff legs that did not succeed, by role and reason (tag, tokens, pages, checksum, timeout, peer, cancelled, rejected, other)."}, []string{"role", "reason"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvhandoff_transfer_bytes_total",
			Help: "KV payload bytes of handoffs that succeeded: written by prefill, received and verified by decode."}, []string{"role"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvhandoff_handoff_duration_seconds",
			Help:    "Time from a leg's start on this node to its outcome.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}, []string{"role"}),
		fenceWait: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvhandoff_fence_wait_seconds",
			Help:        "Decode: time from a request's failure until its quarantined pages were fenced and came back.",
			ConstLabels: prometheus.Labels{"role": string(RoleDecode)},
			Buckets:     prometheus.ExponentialBuckets(0.001, 2, 16)}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvhandoff_client_requests_total",
			Help: "Router: client completions answered, by HTTP status code."}, []string{"code"}),
	}
	m.retries = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvhandoff_retries_total",
		Help: "Router: handoffs retried under the same client request because a pool had no room, or elsewhere than a node that refused a leg as it stops."})
	m.promptTok = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvhandoff_prompt_tokens_total",
		Help: "Router: prompt tokens of requests answered 200 (BOS counted)."})
	m.genTok = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvhandoff_generation_tokens_total",
		Help: "Router: generated tokens answered 200 (up to a stop)."})
	m.ttft = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvhandoff_time_to_first_token_seconds",
		Help:    "Router: a handoff's dispatch to its first generated token at the router (the decode node streams each token as it samples it).",
		Buckets: prometheus.ExponentialBuckets(0.005, 2, 14)})
	m.tpot = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvhandoff_time_per_output_token_seconds",
		Help:    "Router: a request's time from its first generated token to its last, over the tokens after the first.",
		Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16)})
	m.latency = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvhandoff_request_duration_seconds",
		Help:    "Router: client requests of the API end to end, by HTTP status code.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 17)}, []string{"code"})
	m.waiting = prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvhandoff_requests_waiting",
		Help: "Router: requests waiting for a pool to have room, between their retries (the queue)."})
	m.nodeEvents = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvhandoff_node_events_total",
		Help: "Router: nodes that joined, were lost (lease, unreachable, restart), rejoined, or refused a leg as they stop (out of rotation a while), by role."}, []string{"role", "event"})
	m.afterCancel = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvhandoff_decode_tokens_after_cancel_total",
		Help:        "Decode: tokens generated for a request after it was cancelled or failed (the step in flight when the cancel came: at most one per request).",
		ConstLabels: prometheus.Labels{"role": string(RoleDecode)}})
	m.prefixHits = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvhandoff_prefix_hits_total",
		Help:        "Decode: requests whose prompt began with pages found in the prefix cache, by scope (public:NAME for a declared public prefix, tenant for every other).",
		ConstLabels: prometheus.Labels{"role": string(RoleDecode)}}, []string{"scope"})
	m.prefixTok = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvhandoff_prefix_hit_tokens_total",
		Help:        "Decode: prompt tokens found in the prefix cache (neither computed into pages nor transferred), by scope (public:NAME or tenant).",
		ConstLabels: prometheus.Labels{"role": string(RoleDecode)}}, []string{"scope"})
	build := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvhandoff_build_info",
		Help: "The running build: its version (module version or VCS revision) and Go version; always 1."}, []string{"version", "goversion"})
	build.WithLabelValues(Version(), runtime.Version()).Set(1)
	reg.MustRegister(m.handoffs, m.failures, m.bytes, m.duration, m.fenceWait, m.requests, build)
	return m
}

// leg records a leg's outcome.
func (m *Metrics) leg(role Role, err error, took time.Duration, bytes int) {
	m.handoffs.WithLabelValues(string(role), outcomeOf(err)).Inc()
	if err != nil {
		m.failures.WithLabelValues(string(role), Reason(err)).Inc()
	} else {
		m.bytes.WithLabelValues(string(role)).Add(float64(bytes))
	}
	m.duration.WithLabelValues(string(role)).Observe(took.Seconds())
}

// prime makes every label combination of role exist at zero, so a scrape
// shows the whole family before the first event.
func (m *Metrics) prime(role Role) {
	for _, o := range outcomes {
		m.handoffs.WithLabelValues(string(role), o)
	}
	for _, r := range reasons {
		m.failures.WithLabelValues(string(role), r)
	}
	m.bytes.WithLabelValues(string(role))
	m.duration.WithLabelValues(string(role))
	if role == RoleDecode {
		m.reg.MustRegister(m.afterCancel)
	}
	if role == RoleRouter {
		m.reg.MustRegister(m.retries, m.promptTok, m.genTok, m.ttft, m.tpot, m.latency, m.waiting, m.nodeEvents)
		for _, r := range []Role{RolePrefill, RoleDecode} {
			for _, e := range []string{"joined", "lost", "rejoined", "stopping"} {
				m.nodeEvents.WithLabelValues(string(r), e)
			}
		}
	}
}

// endpointGauges exports a transfer endpoint's gauges when scraped.
func (m *Metrics) endpointGauges(role Role, gauges func() transfer.Gauges) {
	desc := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, labels, prometheus.Labels{"role": string(role)})
	}
	pages := desc("kvhandoff_pages", "KV pool pages by state (free, owned, quarantined, cached: decode's prefix cache).", "state")
	qps := desc("kvhandoff_queue_pairs", "Queue pairs by state (live: taking requests; draining: cut, flush not drained).", "state")
	credits := desc("kvhandoff_credits", "Receive buffers the peers granted this node's SENDs, over live queue pairs.")
	refused := desc("kvhandoff_refused_messages_total", "Control messages the state machine refused (unknown, duplicate, late, wrong peer).")
	m.reg.MustRegister(collectorFunc{descs: []*prometheus.Desc{pages, qps, credits, refused}, collect: func(ch chan<- prometheus.Metric) {
		g := gauges()
		owned := g.Pages - g.PagesFree - g.PagesQuarantined - g.PagesCached
		ch <- prometheus.MustNewConstMetric(pages, prometheus.GaugeValue, float64(g.PagesFree), "free")
		ch <- prometheus.MustNewConstMetric(pages, prometheus.GaugeValue, float64(owned), "owned")
		ch <- prometheus.MustNewConstMetric(pages, prometheus.GaugeValue, float64(g.PagesQuarantined), "quarantined")
		ch <- prometheus.MustNewConstMetric(pages, prometheus.GaugeValue, float64(g.PagesCached), "cached")
		ch <- prometheus.MustNewConstMetric(qps, prometheus.GaugeValue, float64(g.QueuePairsLive), "live")
		ch <- prometheus.MustNewConstMetric(qps, prometheus.GaugeValue, float64(g.QueuePairsDraining), "draining")
		ch <- prometheus.MustNewConstMetric(credits, prometheus.GaugeValue, float64(g.Credits))
		ch <- prometheus.MustNewConstMetric(refused, prometheus.CounterValue, float64(g.Refused))
	}})
}

// prefixGauges exports a decode node's prefix cache: its hits (counted as
// requests are read), its evictions, its pages purged for a caught writer
// and its pages by scope label, read when scraped.
func (m *Metrics) prefixGauges(read func() (evictions, purged uint64, cached map[string]int)) {
	evictions := prometheus.NewDesc("kvhandoff_prefix_evictions_total", "Decode: cached prefix pages evicted (least recently used, unpinned) for fresh pages.",
		nil, prometheus.Labels{"role": string(RoleDecode)})
	purgedPages := prometheus.NewDesc("kvhandoff_prefix_purged_pages_total", "Decode: cached prefix pages taken out of the cache because the peer that wrote them was caught (failed verification, fenced, failed, or unauthorized).",
		nil, prometheus.Labels{"role": string(RoleDecode)})
	cached := prometheus.NewDesc("kvhandoff_prefix_cached_pages", "Decode: pages in the prefix cache now, by scope (public:NAME or tenant).",
		[]string{"scope"}, prometheus.Labels{"role": string(RoleDecode)})
	m.prefixHits.WithLabelValues("tenant")
	m.prefixTok.WithLabelValues("tenant")
	m.reg.MustRegister(m.prefixHits, m.prefixTok, collectorFunc{descs: []*prometheus.Desc{evictions, purgedPages, cached}, collect: func(ch chan<- prometheus.Metric) {
		ev, pu, by := read()
		ch <- prometheus.MustNewConstMetric(evictions, prometheus.CounterValue, float64(ev))
		ch <- prometheus.MustNewConstMetric(purgedPages, prometheus.CounterValue, float64(pu))
		if _, ok := by["tenant"]; !ok {
			ch <- prometheus.MustNewConstMetric(cached, prometheus.GaugeValue, 0, "tenant")
		}
		for label, n := range by {
			ch <- prometheus.MustNewConstMetric(cached, prometheus.GaugeValue, float64(n), label)
		}
	}})
}

// routerGauges exports the router's live nodes by role and its requests
// in flight.
func (m *Metrics) routerGauges(read func() (prefills, decodes, inFlight int)) {
	nodes := prometheus.NewDesc("kvhandoff_nodes", "Router: live nodes by role (registered, not lost).", []string{"role"}, nil)
	flight := prometheus.NewDesc("kvhandoff_requests_in_flight", "Router: accepted requests without a client-visible outcome yet.", nil, nil)
	m.reg.MustRegister(collectorFunc{descs: []*prometheus.Desc{nodes, flight}, collect: func(ch chan<- prometheus.Metric) {
		p, d, f := read()
		ch <- prometheus.MustNewConstMetric(nodes, prometheus.GaugeValue, float64(p), "prefill")
		ch <- prometheus.MustNewConstMetric(nodes, prometheus.GaugeValue, float64(d), "decode")
		ch <- prometheus.MustNewConstMetric(flight, prometheus.GaugeValue, float64(f))
	}})
}

type collectorFunc struct {
	descs   []*prometheus.Desc
	collect func(chan<- prometheus.Metric)
}

func (c collectorFunc) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
}
func (c collectorFunc) Collect(ch chan<- prometheus.Metric) { c.collect(ch) }

// Handler serves the metrics in Prometheus's text format (GET /metrics).
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// Registry is the metrics' registry, for a caller that adds its own.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

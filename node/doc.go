// Package node is kvhandoff's deployable processes: the router node, the
// prefill node and the decode node, the Registry through which they find
// each other, their Prometheus metrics, and the router's client API (the
// OpenAI-compatible completions, chat completions and models, with
// /healthz and /readyz: api.go, openai.go, chat.go; its HTTP server's
// bounds: frontdoor.go). kvhandoff serve runs one of them per process;
// StartLocal runs a whole deployment in one process (tests, the demo).
//
// The roles, and what each one wires together:
//
//	Router   protocol.Router (intake against each node's advertised limits,
//	         node choice, cancels, first outcome wins) driven by Run's loop
//	         and clock; the registry's watch adds nodes and loses them;
//	         each leg is a call to a node's control API.
//	Prefill  transfer.Prefill, its KV computed by the engine straight into
//	         the source pages (engine.Source), or transfer.GeneratedKV
//	         without a model; a queue pair dialled to every decode node
//	         the registry lists (transfer.Dial, mutual TLS 1.3).
//	Decode   transfer.Decode, accepting prefill nodes' queue pairs
//	         (transfer.Serve); once a request's KV has verified, the engine
//	         generates over the very pages the WRITEs placed, every read
//	         checked against the endpoint's epochs; its own pages hold the
//	         generated tokens' KV past the grant.
//
// A request's life:
//
//	client ── POST /v1/completions ──▶ router: tokenize, Router.Submit
//	  (over the limit: 400, the limit named; nothing reaches a node)
//	router ── decode call {id, prompt, max_tokens} ──▶ decode node (waits)
//	router ── prefill call {id, decode, prompt} ──▶ prefill node:
//	  its own intake, KV computed, Bootstrap, Grant, WRITEs, Done
//	decode node: Verified → Acquire → generate → Finish; streams each
//	  token to its call as it samples it (JSON lines), then its leg's
//	  outcome; prefill answers its call with its leg's outcome
//	router: relays each token to a streaming client at once (an SSE
//	  event); Router.LegEnded for each leg; the first outcome is the
//	  client's: 200 with the text, or 503 with the reason (never 200
//	  without a verified handoff; a stream's failure is an error event)
//
// Prefix reuse (scope.go): the router sets each request's cache scope from
// its authenticated tenant (or a declared public prefix) and binds it, with
// the prompt's chain, into the ticket; prefill's Bootstrap carries both; a
// decode node with PrefixCache reads a cached prefix of the scope in place
// of transferring it (engine.DecodeShared). A body naming a scope is a 400.
//
// A client that disconnects: Router.Cancel, and a cancel call to each leg's
// node (and the legs' calls closed); the decode node stops generating
// before its next token. A leg that fails: the router cancels
// the other. A node the registry loses: Router.NodeLost fails its requests
// on every leg, and each decode node is told to cut its queue pair to a
// lost prefill node: the cut is the fence for the pages it may still write
// (they stay quarantined until then). A node whose control API stops
// answering is lost to the router at once (not after its lease) and probed
// until it answers again.
//
// The control API (control.go) is JSON over HTTPS with mutual TLS 1.3: a
// node answers only a caller whose certificate names an allowed caller
// (the router), and the router checks that a node's certificate names the
// node the registry knows. Errors cross it with their identity: a node's
// error matches the same errors.Is sentinels at the router (wire.go).
//
// Shutdown (each Serve and Run, on ctx's end): a node first registers its
// record again marked Stopping, so routers send it nothing new; then intake
// stops (new calls get ErrShuttingDown), calls in flight get a grace
// period, then the rest are cancelled, and a node returns once no page is
// owned or quarantined (a decode node cuts its queue pairs, the fence, if
// pages stay quarantined). The router retries on other nodes what a
// stopping node refuses or its stop's end fails, and takes the loss of a
// stopped node once its requests' other legs have ended: a rolling restart
// fails no request.
//
// Metrics (metrics.go), one registry per node: kvhandoff_handoffs_total
// {role,outcome}, kvhandoff_handoff_failures_total{role,reason} (reason
// in tag, tokens, pages, checksum, timeout, peer, cancelled, rejected,
// other), kvhandoff_transfer_bytes_total{role},
// kvhandoff_handoff_duration_seconds{role}, kvhandoff_fence_wait_seconds,
// kvhandoff_pages{role,state}, kvhandoff_queue_pairs{role,state},
// kvhandoff_credits{role}, kvhandoff_refused_messages_total{role},
// kvhandoff_build_info, a decode node's prefix cache
// (kvhandoff_prefix_hits_total, _hit_tokens_total, _evictions_total,
// kvhandoff_prefix_cached_pages; scope label public:NAME or tenant), and
// the router's operator signals (requests by code,
// tokens, time to first token, per output token, latency by status, queue,
// retries, node events: docs/nodes.md lists them). Logs are log/slog, every
// request line carrying request_id (the client request's, a string, the
// same across retries and on both nodes), handoff_id, tenant, model,
// prefill and decode.
package node

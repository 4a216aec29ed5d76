// Package demo is kvhandoff demo's workload and its checks: the multi-tenant
// traffic that a deployment is run under, the deployment itself (Start: the
// router and nodes of package node in this process; StartProcs: each node a
// kvhandoff serve process on loopback), and the verdict over what its clients
// saw. The workload and the checks know nothing of how a request travels: a
// Client sends one request and returns its tokens or its error.
//
// The workload (NewWorkload, from a seed): 8 tenants, each with a canary
// string that occurs in its prompts and nowhere else; every prompt names the
// canary near its start and ends with a question whose answer, for the
// built-in model's copy head, is the canary that followed the same words
// earlier in what it attends over. So a decode node that reads another
// tenant's KV answers with that tenant's canary, and one that reads stale KV
// without the prompt's own (the incident) continues a stale prompt from its
// start, whose first tokens are its canary. Some prompts are over the
// deployment's limit (only "rejected" is honest for them), and some clients
// disconnect a few milliseconds after sending, mid-transfer.
//
// The checks (Check), for every request:
//   - a success equals, token for token, the colocated run (Reference: the
//     same model on one node, the engine called directly, no handoff);
//   - a success carries no other tenant's canary, nor 6 consecutive
//     characters of it (a Leak names the request, its tenant, the foreign
//     tenant and the text);
//   - a request over the limit never succeeds;
//   - every other outcome is an explicit error, with its reason, and
//     something the demo did explains it (a fault it injected, a client
//     that went away, a prompt over the limit): a failure nothing explains
//     is a defense stopping a bug of the deployment;
//   - a request whose body names a cache scope never succeeds;
//   - no prefix cache page is written while cached (in process: a watch
//     of the decode nodes' caches, InProcess.WatchCache);
//   - at the end no page is owned or quarantined on any node.
//
// The loop:
//
//	w, _ := demo.NewWorkload(demo.Spec{Seed: 1, Limit: limit, Context: ctx})
//	ref, _ := demo.NewReference(m, llama.Bytes{}, pageTokens, -1)
//	outs := demo.Run(ctx, w, client, classify, 16, bar.Tick)
//	rep, _ := demo.Check(w, outs, ref, injectedFaults, pagesLeftPerNode, elapsed)
//	rep.WriteTable(os.Stdout) // or rep.WriteJSON
//	if !rep.Passed() { os.Exit(1) }
package demo

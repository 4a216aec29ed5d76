package model

import "github.com/kvhandoff/kvhandoff/internal/research"

// notInTheModel are the implementation's switches whose defense lives
// outside the state machines the simulation and the refinement drive, so no
// walk of theirs can tell the switch on from off. The model checker finds
// each in the spec (kvhandoff check --bug NAME exits 1 with its shortest
// counterexample), and each has its own tests in the implementation, which
// fail with the switch on:
//
//   - pool-wide-key and verify-before-revoke: package transfer's per-grant
//     remote access (memory windows), over every provider:
//     transfer.TestRogueWriteIsRefusedByPerGrantWindows (under pool-wide-key
//     the rogue's bytes land) and transfer.TestVerifiedPagesCannotChange
//     (under either, a WRITE after Done changes verified KV).
//   - unticketed-bootstrap: the receiver's Authorize hook, which the
//     deployment gives it (the router's signed tickets); the model runs
//     honest peers, every Bootstrap one the router dispatched. Caught by
//     protocol.TestBootstrapWithoutAValidTicketReservesNothing and
//     node.TestUnticketedFloodFromAnIntruderReservesNothing.
//   - client-scope: the scope decision is node's router (node.Router's
//     scopeOf and its front door's refusal of a body naming a scope, the
//     OpenAI cache_salt field): protocol.Router.Submit takes no scope and
//     the model's router plays only the authenticated tenant's, so no walk
//     has a client naming one (the refinement's driver leaves the spec's
//     rogue Submit out). Caught by node.TestARequestNamingItsScopeIsRefused
//     (under the switch the body's scope is taken, and is the victim's).
//     The other four prefix switches are in the model: the refinement maps
//     the prefix cache (prefix_refine_test.go), and the simulation with
//     SimConfig.PrefixCache finds them (TestSimulationFindsEveryPrefixSwitch).
//   - free-computing: transfer's driver, which holds what would end a
//     request until its chunk ends (free-computing is the driver's bug, not
//     the Sender's: the refinement drives the Sender, not the driver).
//     Staged by transfer.TestAComputingRequestsPagesStayItsUntilTheChunkEnds.
//
// The tests that iterate research.All() skip exactly these, by name, so that
// nothing passes silently.
var notInTheModel = map[research.Switch]bool{
	research.PoolWideKey:         true,
	research.VerifyBeforeRevoke:  true,
	research.UnticketedBootstrap: true,
	research.ClientScope:         true,
	research.FreeComputing:       true,
}

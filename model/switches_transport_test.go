package model

import "github.com/kvhandoff/kvhandoff/internal/research"

// transportSwitches are implementation switches of package transfer's
// per-grant remote access (memory windows), which neither the protocol's
// state machines nor this package's walks run: the model checker finds each
// in the spec (kvhandoff check --bug pool-wide-key, --bug
// verify-before-revoke), and transfer's hostile tests catch each in the
// implementation over every provider (TestRogueWriteIsRefusedByPerGrantWindows
// under pool-wide-key, TestVerifiedPagesCannotChange under
// verify-before-revoke). The tests that iterate research.All() skip exactly
// these, by name, so that nothing passes silently.
var transportSwitches = map[research.Switch]bool{
	research.PoolWideKey:        true,
	research.VerifyBeforeRevoke: true,
}

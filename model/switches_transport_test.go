package model

import "github.com/kvhandoff/kvhandoff/internal/research"

// transportSwitches are implementation switches of package transfer's
// per-grant remote access, which neither the protocol's state machines nor
// this package's walks run: the spec side lands in branch spec; until then
// they are caught by transfer's hostile tests (TestRogueWriteIsRefusedByPerGrantWindows
// under pool-wide-key, TestVerifiedPagesCannotChange under
// verify-before-revoke). The tests that iterate research.All() skip exactly
// these, by name, so that nothing passes silently.
var transportSwitches = map[research.Switch]bool{
	research.PoolWideKey:        true,
	research.VerifyBeforeRevoke: true,
}

package protocol_test

import (
	"flag"
	"testing"

	"github.com/kvhandoff/kvhandoff/protocol/protocoltest"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the expected output of testdata/*.txt scenarios")

// TestScenarios runs the datadriven files in testdata/ through the shared
// harness (protocoltest.RunScenarios, which lists the commands): each block
// stages a race among the router, a prefill node and a decode node, and what
// they did (posts, placements, deliveries, outcomes, violations of the spec's
// properties) must match the text after "----". Run with -rewrite to
// regenerate it.
func TestScenarios(t *testing.T) {
	protocoltest.RunScenarios(t, "testdata/*.txt", *rewrite)
}

package node

import (
	"math/rand/v2"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// LeastOutstanding is the router's placement (protocol.Policy): the
// candidate with the least outstanding work, the pages of its requests whose
// leg has not ended, with ties broken at random, so that idle nodes share
// sequential requests rather than the lowest ID taking them all
// (protocol.LeastPagesInUse's deterministic tie-break, which the model
// checker wants).
type LeastOutstanding struct {
	// IntN picks among n tied candidates; nil means math/rand/v2's IntN.
	IntN func(n int) int
}

// Choose implements protocol.Policy.
func (p LeastOutstanding) Choose(_ protocol.Role, _ int, candidates []protocol.NodeLoad) int {
	least := candidates[0].PagesInUse
	for _, c := range candidates[1:] {
		least = min(least, c.PagesInUse)
	}
	var tied []int
	for i, c := range candidates {
		if c.PagesInUse == least {
			tied = append(tied, i)
		}
	}
	pick := rand.IntN
	if p.IntN != nil {
		pick = p.IntN
	}
	return tied[pick(len(tied))]
}

package explore

import (
	"testing"

	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/checker"
)

// reachesGoal is the definition goalReachable remembers its answers for: a
// breadth-first search from s over actions without faults, with nothing kept
// between calls.
func reachesGoal(m *spec.Model, g spec.Goal, s *spec.State) bool {
	return breadthFirst(m, []spec.State{*s}, func(a spec.Action) bool { return !a.IsFault() },
		func(st *spec.State) bool { return g.Reached(m, st) })
}

// leakingStates is the model of the default bounds (at most 2 faults) with
// leak-on-cancel, and up to limit of its states: the goals' answers differ
// among them, as leaked pages put NoLeak out of reach.
func leakingStates(t *testing.T, limit int) (*spec.Model, []spec.State) {
	t.Helper()
	cfg := spec.DefaultConfig()
	cfg.MaxFaults = 2
	cfg.Bugs = bugs(t, "leak-on-cancel")
	m, err := spec.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var states []spec.State
	breadthFirst(m, m.Initial(), func(spec.Action) bool { return true }, func(st *spec.State) bool {
		states = append(states, *st)
		return len(states) == limit
	})
	return m, states
}

// breadthFirst visits the states reachable from start by the actions take
// accepts, breadth first, each once, until visit returns true; it reports
// whether it did.
func breadthFirst(m *spec.Model, start []spec.State, take func(spec.Action) bool, visit func(*spec.State) bool) bool {
	seen := map[checker.Fingerprint]bool{}
	queue := start
	for len(queue) > 0 {
		st := queue[0]
		queue = queue[1:]
		fp := checker.FingerprintOf(m.AppendFingerprint(nil, &st))
		if seen[fp] {
			continue
		}
		seen[fp] = true
		if visit(&st) {
			return true
		}
		m.Successors(&st, func(a spec.Action, n *spec.State) {
			if take(a) {
				queue = append(queue, *n)
			}
		})
	}
	return false
}

// The matrix's filter answers "is the goal still reachable" from memory
// (every state a search settles, either way, and the stack of one that
// finds the goal): the answers must be the definition's, for both goals, on
// states where it is and where it is not, and asked again from memory.
func TestGoalReachableMatchesTheDefinition(t *testing.T) {
	m, states := leakingStates(t, 1500)
	r := newReplayer(m)
	answers := map[bool]int{}
	for g, goal := range spec.Goals {
		want := make([]bool, len(states))
		for i := range states {
			want[i] = reachesGoal(m, goal, &states[i])
			answers[want[i]]++
		}
		for round := range 2 {
			before := r.searched
			for i := range states {
				if got := r.goalReachable(g, &states[i]); got != want[i] {
					t.Fatalf("%s from state %d (round %d): goalReachable says %v, the definition %v", goal.Name, i, round, got, want[i])
				}
			}
			if round == 1 && r.searched != before {
				t.Errorf("%s: asked again, the searches pushed %d more states; every answer should be remembered", goal.Name, r.searched-before)
			}
		}
	}
	// leak-on-cancel leaks pages: NoLeak is out of reach from some states.
	if answers[true] == 0 || answers[false] == 0 {
		t.Fatalf("the states must include both answers, got %v", answers)
	}
}

// A search reuses its stack, its pending successors and its visited set:
// once they have grown, a search allocates nothing (before, a slice of
// successors and a string key per state made the collector cost more than
// the searches).
func TestGoalReachableDoesNotAllocate(t *testing.T) {
	m, states := leakingStates(t, 200)
	r := newReplayer(m)
	search := func() {
		for g := range spec.Goals {
			for i := range states {
				clear(r.reach) // search again, not from memory
				r.goalReachable(g, &states[i])
			}
		}
	}
	search() // grow
	if n := testing.AllocsPerRun(3, search); n > 0 {
		t.Fatalf("%v allocations per %d searches, want none", n, len(spec.Goals)*len(states))
	}
}

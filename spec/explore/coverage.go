package explore

import (
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/kvhandoff/kvhandoff/spec"
)

// CoverageRow is one line of a coverage report: an action kind or a branch of
// the spec, and how often it fired.
type CoverageRow struct {
	// Kind is "action"; "defense", a refusing check the correct protocol can
	// reach; "redundant", one it cannot (spec.Branch.Redundant); or "branch".
	Kind    string `json:"kind"`
	Name    string `json:"name"`
	Count   uint64 `json:"count"`
	Defense bool   `json:"defense"`
}

// CoverageRows lists c: every action kind, then every branch, in the spec's order.
func CoverageRows(c *spec.Coverage) []CoverageRow {
	var out []CoverageRow
	for k := spec.ActionKind(0); k < spec.NumActionKinds; k++ {
		out = append(out, CoverageRow{Kind: "action", Name: k.String(), Count: c.Action(k)})
	}
	for b := spec.Branch(0); b < spec.NumBranches; b++ {
		kind := "branch"
		switch {
		case b.Defense():
			kind = "defense"
		case b.Redundant():
			kind = "redundant"
		}
		out = append(out, CoverageRow{Kind: kind, Name: b.String(), Count: c.Branch(b), Defense: b.Defense()})
	}
	return out
}

// Unfired lists the defenses of rows that never fired.
func Unfired(rows []CoverageRow) []string {
	var out []string
	for _, r := range rows {
		if r.Defense && r.Count == 0 {
			out = append(out, r.Name)
		}
	}
	return out
}

// WriteCoverage prints rows as a table, one line per row, "kind name count":
// a line starts with its kind, so the lines of several runs can be summed
// with awk.
func WriteCoverage(w io.Writer, rows []CoverageRow) error {
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "coverage\tname\tcount")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%d\n", r.Kind, r.Name, r.Count)
	}
	return tw.Flush()
}

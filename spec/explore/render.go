package explore

import (
	"fmt"
	"io"
	"strings"

	"github.com/kvhandoff/kvhandoff/spec"
)

// WriteText prints a trace as numbered steps.
func WriteText(w io.Writer, trace []Step) {
	for _, st := range trace {
		fmt.Fprintf(w, "%3d. %s\n", st.Step, st.Action)
		for _, d := range strings.Split(st.Detail, "; ") {
			if d != "" {
				fmt.Fprintf(w, "       - %s\n", d)
			}
		}
	}
}

// actors says who does a step: the arrow's ends, or one actor for a note.
func actors(a spec.Action) (from, to string) {
	switch a.Kind {
	case spec.Submit, spec.Cancel:
		return "Client", "Router"
	case spec.PrefillRecv:
		return "Router", "Prefill"
	case spec.PrefillRecvQP:
		return "Decode", "Prefill"
	case spec.DecodeRecv:
		return "Router", "Decode"
	case spec.DecodeRecvQP:
		return "Prefill", "Decode"
	case spec.DecodeRead:
		return "Decode", "Router"
	case spec.PostWrite, spec.Compute, spec.Crash, spec.Restart:
		return "Prefill", ""
	case spec.DetectCrash:
		return "Router", ""
	case spec.Timeout, spec.Partition:
		return "Decode", ""
	case spec.Cut, spec.DataplaneCut:
		return "Prefill", "Decode"
	case spec.CorruptSend:
		if a.Arg&spec.SendBack != 0 {
			return "Decode", "Prefill"
		}
		return "Prefill", "Decode"
	}
	return "Router", ""
}

// mermaidText makes s safe inside a Mermaid message or note.
func mermaidText(s string) string {
	r := strings.NewReplacer(";", ",", "#", "no.", "\n", " ", "->", "→", ">", "›", "<", "‹")
	return r.Replace(s)
}

// WriteMermaid prints a trace as a Mermaid sequence diagram: one message or note
// per step, with the step's effects in a note beside it.
func WriteMermaid(w io.Writer, title string, trace []Step) {
	fmt.Fprintln(w, "sequenceDiagram")
	if title != "" {
		fmt.Fprintf(w, "    title %s\n", mermaidText(title))
	}
	for _, p := range []string{"Client", "Router", "Prefill", "Decode"} {
		fmt.Fprintf(w, "    participant %s\n", p)
	}
	for _, st := range trace {
		from, to := actors(st.Kind)
		label := fmt.Sprintf("%d. %s", st.Step, mermaidText(st.Action))
		switch {
		case to == "":
			fmt.Fprintf(w, "    Note over %s: %s\n", from, label)
		case st.Kind.IsFault():
			fmt.Fprintf(w, "    %s-x%s: %s\n", from, to, label)
		default:
			fmt.Fprintf(w, "    %s->>%s: %s\n", from, to, label)
		}
		if st.Detail != "" {
			side := to
			if side == "" {
				side = from
			}
			fmt.Fprintf(w, "    Note right of %s: %s\n", side, strings.ReplaceAll(mermaidText(strings.ReplaceAll(st.Detail, "; ", "\x00")), "\x00", "<br/>"))
		}
	}
}

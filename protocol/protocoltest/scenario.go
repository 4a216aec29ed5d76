package protocoltest

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// RunScenarios runs every datadriven file matching glob: blocks of commands,
// one event each, with what the network did written after "----". A block
// whose output differs fails the test; with rewrite, the files are written
// back with the output as it is now (the diff is then for a person to
// review).
//
// Commands (IDs are decimal; a network has one prefill and one decode node
// unless new says otherwise, and then node=N names one by its ID):
//
//	new pages=N [prefill-pages=8] [advertise=M] [prefills=1] [decodes=1] [bugs=a,b]
//	                            a fresh deployment: decode nodes of N pages, prefill nodes
//	                            of prefill-pages, each prefill node advertising M pages to
//	                            the router (default its own: more is the incident's lie)
//	submit r=ID tokens=T        the client's request: router intake, the dispatch taken by
//	                            the prefill node at once, its KV computed at once
//	deliver [n=K] [qp=P,D]      place or deliver the next K items prefill→decode
//	back [n=K] [qp=P,D]         deliver the next K messages decode→prefill
//	router node=N [n=K]         deliver the next K messages from the router to node N
//	run                         deliver everything (Network.Run)
//	cancel r=ID [side=S]        the client goes away; the router's cancels reach both legs
//	                            at once (side=both), or only decode or prefill now, the
//	                            other left in flight
//	tick d=DURATION             the clock moves on; every node and the router tick
//	peer-failed [node=N]        the registry's lease on prefill node N expires: the router
//	                            hears it and its messages to every decode node arrive
//	cut [qp=P,D]                the queue pair breaks
//	read r=ID                   decode acquires, checks and finishes r
//	corrupt page=P [node=N]     flip a byte of a decode page
//	stale-tag [qp=P,D]          the next WRITE's tag record carries an older epoch
//	send-decode done r=ID tokens=T pages=N [qp=P,D]
//	send-prefill grant r=ID tokens=T pages=N [qp=P,D]
//	pools                       free and quarantined pages on every node
func RunScenarios(t *testing.T, glob string, rewrite bool) {
	t.Helper()
	files, _ := filepath.Glob(glob)
	if len(files) == 0 {
		t.Fatalf("no scenarios match %s", glob)
	}
	for _, file := range files {
		t.Run(strings.TrimSuffix(filepath.Base(file), ".txt"), func(t *testing.T) {
			data, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			out, diffs := runScenario(t, string(data))
			if rewrite {
				if err := os.WriteFile(file, []byte(out), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			for _, d := range diffs {
				t.Error(d)
			}
		})
	}
}

// runScenario executes every block and returns the file as it should be, and
// a description of every block whose output differs.
func runScenario(t *testing.T, text string) (string, []string) {
	var s scenario
	var out strings.Builder
	var diffs []string
	for _, block := range strings.Split(strings.TrimSpace(text), "\n\n") {
		cmds, want, _ := strings.Cut(block, "----\n")
		cmds = strings.TrimSuffix(cmds, "----")
		s.log = nil
		for _, line := range strings.Split(strings.TrimSpace(cmds), "\n") {
			if line == "" || strings.HasPrefix(line, "#") {
				continue
			}
			if err := s.execute(line); err != nil {
				t.Fatalf("%s: %v", line, err)
			}
		}
		body := strings.Join(s.log, "\n")
		if strings.TrimSpace(body) != strings.TrimSpace(want) {
			diffs = append(diffs, fmt.Sprintf("%s\n----\ngot:\n%s\nwant:\n%s", strings.TrimSpace(cmds), body, strings.TrimSpace(want)))
		}
		fmt.Fprintf(&out, "%s\n----\n%s\n\n", strings.TrimSpace(cmds), body)
	}
	return strings.TrimSuffix(out.String(), "\n"), diffs
}

type scenario struct {
	n   *Network
	log []string
}

func (s *scenario) logf(format string, a ...any) { s.log = append(s.log, fmt.Sprintf(format, a...)) }

func (s *scenario) execute(line string) error {
	fields := strings.Fields(line)
	args := map[string]string{}
	for _, f := range fields[1:] {
		k, v, _ := strings.Cut(f, "=")
		args[k] = v
	}
	var bad error
	num := func(key string, def int) int {
		v, ok := args[key]
		if !ok {
			return def
		}
		n, err := strconv.Atoi(v)
		if err != nil && bad == nil {
			bad = fmt.Errorf("%s=%q is not a number", key, v)
		}
		return n
	}
	if fields[0] != "new" && s.n == nil {
		return fmt.Errorf("the scenario must start with new")
	}
	n := s.n
	qp := func() *QueuePair {
		if v, ok := args["qp"]; ok {
			p, d, _ := strings.Cut(v, ",")
			pi, err1 := strconv.Atoi(p)
			di, err2 := strconv.Atoi(d)
			if err1 != nil || err2 != nil || n.PrefillNode(protocol.NodeID(pi)) == nil || n.DecodeNode(protocol.NodeID(di)) == nil {
				bad = fmt.Errorf("qp=%s names no queue pair", v)
				return n.QPs[0]
			}
			return n.QP(protocol.NodeID(pi), protocol.NodeID(di))
		}
		return n.QPs[0]
	}
	id := protocol.RequestID(num("r", 0))
	switch fields[0] {
	case "new":
		bugs, err := research.Parse(args["bugs"])
		if err != nil {
			return err
		}
		pre := NodeConfig{Pages: num("prefill-pages", 8), PageBytes: 256, Advertise: num("advertise", 0)}
		dec := NodeConfig{Pages: num("pages", 4), PageBytes: 256, Timeout: time.Second}
		cfg := Config{Research: bugs}
		for range num("prefills", 1) {
			cfg.Prefill = append(cfg.Prefill, pre)
		}
		for range num("decodes", 1) {
			cfg.Decode = append(cfg.Decode, dec)
		}
		if s.n, err = New(cfg); err != nil {
			return err
		}
		s.n.Logf, s.n.Lenient, s.n.ComputeAtIntake = s.logf, true, true
	case "submit":
		before := map[protocol.NodeID]int{}
		for _, p := range n.Prefill {
			before[p.ID] = len(p.Inbox)
		}
		if n.Submit(id, num("tokens", 4)) == nil {
			for _, p := range n.Prefill {
				if len(p.Inbox) > before[p.ID] {
					n.DeliverRouter(p.ID) // the dispatch arrives at once
				}
			}
		}
	case "deliver":
		q := qp()
		for range num("n", 1) {
			if len(q.Fwd) == 0 {
				return fmt.Errorf("nothing to deliver on %s", q.Name())
			}
			n.Deliver(q)
		}
	case "back":
		q := qp()
		for range num("n", 1) {
			if len(q.Back) == 0 {
				return fmt.Errorf("nothing to deliver back on %s", q.Name())
			}
			n.DeliverBack(q)
		}
	case "router":
		node := protocol.NodeID(num("node", 0))
		for range num("n", 1) {
			if !s.routerPending(node) {
				return fmt.Errorf("no router message for node %d", node)
			}
			n.DeliverRouter(node)
		}
	case "run":
		if !s.n.Run() {
			s.logf("run did not settle")
		}
	case "cancel":
		side := args["side"]
		n.Cancel(id)
		if side == "" || side == "both" || side == "decode" {
			for _, d := range n.Decode {
				for len(d.Inbox) > 0 {
					n.DeliverRouter(d.ID)
				}
			}
		}
		if side == "" || side == "both" || side == "prefill" {
			for _, p := range n.Prefill {
				for len(p.Inbox) > 0 && !p.Crashed {
					n.DeliverRouter(p.ID)
				}
			}
		}
	case "tick":
		d, err := time.ParseDuration(args["d"])
		if err != nil {
			return err
		}
		n.Advance(d)
	case "peer-failed":
		n.Detect(protocol.NodeID(num("node", int(PrefillID(0)))))
		for _, d := range n.Decode {
			for len(d.Inbox) > 0 {
				n.DeliverRouter(d.ID)
			}
		}
	case "cut":
		n.Cut(qp())
	case "read":
		n.Read(id)
	case "corrupt":
		d := n.Decode[0]
		if v, ok := args["node"]; ok {
			k, _ := strconv.Atoi(v)
			if d = n.DecodeNode(protocol.NodeID(k)); d == nil {
				return fmt.Errorf("node=%s is no decode node", v)
			}
		}
		d.Mem.Payload(uint32(num("page", 0)))[3] ^= 0xFF
		s.logf("page %d corrupted", num("page", 0))
	case "stale-tag":
		q := qp()
		if len(q.Fwd) == 0 || q.Fwd[0].Write == nil {
			return fmt.Errorf("the next item on %s is not a WRITE", q.Name())
		}
		w := q.Fwd[0].Write
		w.Tag = protocol.Tag{Request: w.Request, Epoch: w.Remote.Epoch - 1, Index: w.Index, Tokens: 4}.Append(nil, q.Key)
		s.logf("the tag record of %s now carries epoch %d", OpString(q.Fwd[0]), w.Remote.Epoch-1)
	case "send-decode":
		q := qp()
		m := &protocol.Done{Request: id, Tokens: uint32(num("tokens", 4)), Pages: uint32(num("pages", 1))}
		s.logf("%s receives %s", q.Decode.Name, OpString(protocol.Op{Msg: m}))
		if err := q.Decode.Receiver.Step(queuePairTo(q.Prefill.ID), m, n.Now); err != nil {
			n.refused(q.Decode.Name, err)
		}
		n.settle()
	case "send-prefill":
		q := qp()
		m := &protocol.Grant{Request: id, Tokens: uint32(num("tokens", 4)), Pages: make([]protocol.PageGrant, num("pages", 1))}
		s.logf("%s receives %s", q.Prefill.Name, OpString(protocol.Op{Msg: m}))
		if err := q.Prefill.Sender.Step(queuePairTo(q.Decode.ID), m); err != nil {
			n.refused(q.Prefill.Name, err)
		}
		n.settle()
	case "pools":
		var parts []string
		for _, d := range n.Decode {
			parts = append(parts, fmt.Sprintf("%s %d free, %d quarantined", d.Name, d.Receiver.Pool().Free(), d.Receiver.Pool().Quarantined()))
		}
		for _, p := range n.Prefill {
			parts = append(parts, fmt.Sprintf("%s %d free", p.Name, p.Sender.Pool().Free()))
		}
		s.logf("pools: %s", strings.Join(parts, "; "))
	default:
		return fmt.Errorf("unknown command")
	}
	return bad
}

func (s *scenario) routerPending(node protocol.NodeID) bool {
	if p := s.n.PrefillNode(node); p != nil {
		return len(p.Inbox) > 0 && !p.Crashed
	}
	d := s.n.DecodeNode(node)
	return d != nil && len(d.Inbox) > 0
}

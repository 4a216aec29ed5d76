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
//	new pages=N [prefill-pages=8] [advertise=M] [prefills=1] [decodes=1] [bugs=a,b] [horizon=D] [cache=1]
//	                            a fresh deployment: decode nodes of N pages, prefill nodes
//	                            of prefill-pages, each prefill node advertising M pages to
//	                            the router (default its own: more is the incident's lie),
//	                            every node forgetting ended records after horizon D
//	                            (default never), decode nodes with the prefix cache (cache=1)
//	submit r=ID tokens=T [scope=S shared=K] [computed=C]
//	                            the client's request: router intake, the dispatch taken by
//	                            the prefill node at once, its KV computed at once (only its
//	                            first C pages with computed=C, a streaming prefill); with a
//	                            scope, a prompt of T tokens whose first K are the ones every
//	                            such request shares (the rest are its own), its chain in
//	                            the Bootstrap
//	compute r=ID pages=C        the prefill node has computed r's first C pages (ComputedPages)
//	acquire [node=N]            decode's decoder takes (and checks) its next verified request
//	finish [node=N]             decode's decoder ends its oldest read
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
//	send-decode done r=ID tokens=T pages=N [prefix=K] [qp=P,D]
//	send-prefill grant r=ID tokens=T pages=N [prefix=K] [qp=P,D]
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

// args are a command's key=value arguments; the first that does not parse is
// kept in bad and fails the command after it ran.
type args struct {
	kv  map[string]string
	n   *Network
	bad error
}

// num is the decimal argument key, or def.
func (a *args) num(key string, def int) int {
	v, ok := a.kv[key]
	if !ok {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil && a.bad == nil {
		a.bad = fmt.Errorf("%s=%q is not a number", key, v)
	}
	return n
}

// request is the argument r=ID.
func (a *args) request() protocol.RequestID { return protocol.RequestID(a.num("r", 0)) }

// qp is the queue pair qp=P,D names, or the network's first.
func (a *args) qp() *QueuePair {
	v, ok := a.kv["qp"]
	if !ok {
		return a.n.QPs[0]
	}
	p, d, _ := strings.Cut(v, ",")
	pi, err1 := strconv.Atoi(p)
	di, err2 := strconv.Atoi(d)
	if err1 != nil || err2 != nil || a.n.PrefillNode(protocol.NodeID(pi)) == nil || a.n.DecodeNode(protocol.NodeID(di)) == nil {
		a.bad = fmt.Errorf("qp=%s names no queue pair", v)
		return a.n.QPs[0]
	}
	return a.n.QP(protocol.NodeID(pi), protocol.NodeID(di))
}

// commands are the scenario language, one function per command (RunScenarios
// documents them).
var commands = map[string]func(s *scenario, a *args) error{
	"new":          (*scenario).newNetwork,
	"submit":       (*scenario).submit,
	"deliver":      (*scenario).deliver,
	"back":         (*scenario).back,
	"router":       (*scenario).router,
	"run":          (*scenario).run,
	"cancel":       (*scenario).cancel,
	"tick":         (*scenario).tick,
	"peer-failed":  (*scenario).peerFailed,
	"cut":          func(s *scenario, a *args) error { s.n.Cut(a.qp()); return nil },
	"read":         func(s *scenario, a *args) error { s.n.Read(a.request()); return nil },
	"corrupt":      (*scenario).corrupt,
	"stale-tag":    (*scenario).staleTag,
	"send-decode":  (*scenario).sendDecode,
	"send-prefill": (*scenario).sendPrefill,
	"pools":        (*scenario).pools,
	"compute": func(s *scenario, a *args) error {
		if s.n.Request(a.request()) == nil {
			return fmt.Errorf("no request r%d", a.request())
		}
		s.logf("prefill computes r%d up to page %d", a.request(), a.num("pages", 0))
		s.n.ComputePages(a.request(), a.num("pages", 0))
		return nil
	},
	"acquire": func(s *scenario, a *args) error {
		d := s.n.DecodeNode(protocol.NodeID(a.num("node", int(DecodeID(0)))))
		if d == nil || len(d.Verified) == 0 {
			return fmt.Errorf("nothing verified to acquire")
		}
		s.n.Acquire(d)
		return nil
	},
	"finish": func(s *scenario, a *args) error {
		d := s.n.DecodeNode(protocol.NodeID(a.num("node", int(DecodeID(0)))))
		if d == nil || len(d.Reading) == 0 {
			return fmt.Errorf("nothing being read to finish")
		}
		s.n.Finish(d)
		return nil
	},
}

func (s *scenario) execute(line string) error {
	fields := strings.Fields(line)
	a := &args{kv: map[string]string{}, n: s.n}
	for _, f := range fields[1:] {
		k, v, _ := strings.Cut(f, "=")
		a.kv[k] = v
	}
	cmd, ok := commands[fields[0]]
	if !ok {
		return fmt.Errorf("unknown command")
	}
	if fields[0] != "new" && s.n == nil {
		return fmt.Errorf("the scenario must start with new")
	}
	if err := cmd(s, a); err != nil {
		return err
	}
	return a.bad
}

func (s *scenario) newNetwork(a *args) error {
	bugs, err := research.Parse(a.kv["bugs"])
	if err != nil {
		return err
	}
	var horizon time.Duration
	if v, ok := a.kv["horizon"]; ok {
		if horizon, err = time.ParseDuration(v); err != nil {
			return err
		}
	}
	pre := NodeConfig{Pages: a.num("prefill-pages", 8), PageBytes: 256, Advertise: a.num("advertise", 0), Horizon: horizon}
	dec := NodeConfig{Pages: a.num("pages", 4), PageBytes: 256, Timeout: time.Second, Horizon: horizon, PrefixCache: a.num("cache", 0) == 1}
	cfg := Config{Research: bugs}
	for range a.num("prefills", 1) {
		cfg.Prefill = append(cfg.Prefill, pre)
	}
	for range a.num("decodes", 1) {
		cfg.Decode = append(cfg.Decode, dec)
	}
	if s.n, err = New(cfg); err != nil {
		return err
	}
	s.n.Logf, s.n.Lenient, s.n.ComputeAtIntake = s.logf, true, true
	return nil
}

func (s *scenario) submit(a *args) error {
	n := s.n
	before := map[protocol.NodeID]int{}
	for _, p := range n.Prefill {
		before[p.ID] = len(p.Inbox)
	}
	tokens := a.num("tokens", 4)
	var prompt []uint32
	scope := protocol.Scope(a.num("scope", 0))
	if scope != 0 {
		prompt = SharedPrompt(a.request(), tokens, a.num("shared", 0))
	}
	n.ComputePagesAtIntake = a.num("computed", 0)
	defer func() { n.ComputePagesAtIntake = 0 }()
	if n.SubmitPrompt(a.request(), tokens, scope, prompt) == nil {
		for _, p := range n.Prefill {
			if len(p.Inbox) > before[p.ID] {
				n.DeliverRouter(p.ID) // the dispatch arrives at once
			}
		}
	}
	return nil
}

func (s *scenario) deliver(a *args) error {
	q := a.qp()
	for range a.num("n", 1) {
		if len(q.Fwd) == 0 {
			return fmt.Errorf("nothing to deliver on %s", q.Name())
		}
		s.n.Deliver(q)
	}
	return nil
}

func (s *scenario) back(a *args) error {
	q := a.qp()
	for range a.num("n", 1) {
		if len(q.Back) == 0 {
			return fmt.Errorf("nothing to deliver back on %s", q.Name())
		}
		s.n.DeliverBack(q)
	}
	return nil
}

func (s *scenario) router(a *args) error {
	node := protocol.NodeID(a.num("node", 0))
	for range a.num("n", 1) {
		if !s.routerPending(node) {
			return fmt.Errorf("no router message for node %d", node)
		}
		s.n.DeliverRouter(node)
	}
	return nil
}

func (s *scenario) run(*args) error {
	if !s.n.Run() {
		s.logf("run did not settle")
	}
	return nil
}

func (s *scenario) cancel(a *args) error {
	n, side := s.n, a.kv["side"]
	n.Cancel(a.request())
	if side == "" || side == "both" || side == "decode" {
		s.deliverRouterToDecode()
	}
	if side == "" || side == "both" || side == "prefill" {
		for _, p := range n.Prefill {
			for len(p.Inbox) > 0 && !p.Crashed {
				n.DeliverRouter(p.ID)
			}
		}
	}
	return nil
}

// deliverRouterToDecode delivers everything the router has for decode nodes.
func (s *scenario) deliverRouterToDecode() {
	for _, d := range s.n.Decode {
		for len(d.Inbox) > 0 {
			s.n.DeliverRouter(d.ID)
		}
	}
}

func (s *scenario) tick(a *args) error {
	d, err := time.ParseDuration(a.kv["d"])
	if err != nil {
		return err
	}
	s.n.Advance(d)
	return nil
}

func (s *scenario) peerFailed(a *args) error {
	s.n.Detect(protocol.NodeID(a.num("node", int(PrefillID(0)))))
	s.deliverRouterToDecode()
	return nil
}

func (s *scenario) corrupt(a *args) error {
	d := s.n.Decode[0]
	if v, ok := a.kv["node"]; ok {
		k, _ := strconv.Atoi(v)
		if d = s.n.DecodeNode(protocol.NodeID(k)); d == nil {
			return fmt.Errorf("node=%s is no decode node", v)
		}
	}
	d.Mem.Payload(uint32(a.num("page", 0)))[3] ^= 0xFF
	s.logf("page %d corrupted", a.num("page", 0))
	return nil
}

func (s *scenario) staleTag(a *args) error {
	q := a.qp()
	if len(q.Fwd) == 0 || q.Fwd[0].Write == nil {
		return fmt.Errorf("the next item on %s is not a WRITE", q.Name())
	}
	w := q.Fwd[0].Write
	w.Tag = protocol.Tag{Request: w.Request, Epoch: w.Remote.Epoch - 1, Index: w.Index, Tokens: 4}.Append(nil, q.Key)
	s.logf("the tag record of %s now carries epoch %d", OpString(q.Fwd[0]), w.Remote.Epoch-1)
	return nil
}

func (s *scenario) sendDecode(a *args) error {
	q := a.qp()
	m := &protocol.Done{Request: a.request(), Tokens: uint32(a.num("tokens", 4)), Pages: uint32(a.num("pages", 1)), Prefix: uint32(a.num("prefix", 0))}
	s.logf("%s receives %s", q.Decode.Name, OpString(protocol.Op{Msg: m}))
	if err := q.Decode.Receiver.Step(queuePairTo(q.Prefill.ID), m, s.n.Now); err != nil {
		s.n.refused(q.Decode.Name, err)
	}
	s.n.settle()
	return nil
}

func (s *scenario) sendPrefill(a *args) error {
	q := a.qp()
	m := &protocol.Grant{Request: a.request(), Tokens: uint32(a.num("tokens", 4)), Prefix: uint32(a.num("prefix", 0)), Pages: make([]protocol.PageGrant, a.num("pages", 1))}
	for i := range m.Pages { // distinct pages: what is refused is the prefix, not a page twice
		m.Pages[i] = protocol.PageGrant{Page: uint32(i), Addr: uint64(i) << 20}
	}
	s.logf("%s receives %s", q.Prefill.Name, OpString(protocol.Op{Msg: m}))
	if err := q.Prefill.Sender.Step(queuePairTo(q.Decode.ID), m); err != nil {
		s.n.refused(q.Prefill.Name, err)
	}
	s.n.settle()
	return nil
}

func (s *scenario) pools(*args) error {
	var parts []string
	for _, d := range s.n.Decode {
		pool := d.Receiver.Pool()
		if d.receiverCfg.PrefixCache {
			parts = append(parts, fmt.Sprintf("%s %d free, %d quarantined, %d cached (%d pinned)", d.Name, pool.Free(), pool.Quarantined(), pool.Cached(), pool.Pinned()))
			continue
		}
		parts = append(parts, fmt.Sprintf("%s %d free, %d quarantined", d.Name, pool.Free(), pool.Quarantined()))
	}
	for _, p := range s.n.Prefill {
		parts = append(parts, fmt.Sprintf("%s %d free", p.Name, p.Sender.Pool().Free()))
	}
	s.logf("pools: %s", strings.Join(parts, "; "))
	return nil
}

func (s *scenario) routerPending(node protocol.NodeID) bool {
	if p := s.n.PrefillNode(node); p != nil {
		return len(p.Inbox) > 0 && !p.Crashed
	}
	d := s.n.DecodeNode(node)
	return d != nil && len(d.Inbox) > 0
}

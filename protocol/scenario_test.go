package protocol

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the expected output of testdata/*.txt scenarios")

// TestScenarios runs the datadriven files in testdata/: each block of commands
// stages a race on an in-memory queue pair, and what the two nodes did (posts,
// placements, deliveries, outcomes, violations of the spec's properties) must
// match the text after "----". Run with -rewrite to regenerate it.
//
// Commands:
//
//	new pages=N [bugs=a,b]      a fresh prefill node (8 pages) and decode node (N pages)
//	submit r=ID tokens=T        prefill intake, KV computed at once
//	deliver [n=K]               place or deliver the next K items prefill→decode
//	back [n=K]                  deliver the next K messages decode→prefill
//	run                         deliver everything, reading what is verified
//	cancel r=ID [side=S]        the router's cancel: side is both, decode or prefill
//	tick d=DURATION             decode's clock moves on
//	peer-failed                 the router tells decode the prefill node is gone
//	read r=ID                   decode acquires, checks and finishes r
//	corrupt page=P              flip a byte of decode page P
//	stale-tag                   the next WRITE's tag record carries an older epoch
//	send-decode done r=ID tokens=T pages=N
//	send-prefill grant r=ID tokens=T pages=N
//	pools                       free and quarantined pages on both nodes
func TestScenarios(t *testing.T) {
	files, _ := filepath.Glob("testdata/*.txt")
	if len(files) == 0 {
		t.Fatal("no scenarios in testdata/")
	}
	for _, file := range files {
		t.Run(strings.TrimSuffix(filepath.Base(file), ".txt"), func(t *testing.T) {
			data, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			out, diffs := runScenario(t, string(data))
			if *rewrite {
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

// runScenario executes every block and returns the file as it should be, and a
// description of every block whose output differs.
func runScenario(t *testing.T, text string) (string, []string) {
	var l *link
	var out strings.Builder
	var diffs []string
	for _, block := range strings.Split(strings.TrimSpace(text), "\n\n") {
		cmds, want, _ := strings.Cut(block, "----\n")
		cmds = strings.TrimSuffix(cmds, "----")
		var got []string
		for _, line := range strings.Split(strings.TrimSpace(cmds), "\n") {
			if line == "" || strings.HasPrefix(line, "#") {
				continue
			}
			if l != nil {
				l.log = nil
			}
			l = execute(t, l, line)
			got = append(got, l.log...)
		}
		body := strings.Join(got, "\n")
		if strings.TrimSpace(body) != strings.TrimSpace(want) {
			diffs = append(diffs, fmt.Sprintf("%s\n----\ngot:\n%s\nwant:\n%s", strings.TrimSpace(cmds), body, strings.TrimSpace(want)))
		}
		fmt.Fprintf(&out, "%s\n----\n%s\n\n", strings.TrimSpace(cmds), body)
	}
	return strings.TrimSuffix(out.String(), "\n"), diffs
}

func execute(t *testing.T, l *link, line string) *link {
	t.Helper()
	fields := strings.Fields(line)
	args := map[string]string{}
	for _, f := range fields[1:] {
		k, v, _ := strings.Cut(f, "=")
		args[k] = v
	}
	num := func(key string, def int) int {
		v, ok := args[key]
		if !ok {
			return def
		}
		n, err := strconv.Atoi(v)
		if err != nil {
			t.Fatalf("%s: %s=%q is not a number", line, key, v)
		}
		return n
	}
	id := RequestID(num("r", 0))
	if fields[0] != "new" && l == nil {
		t.Fatalf("%s: the scenario must start with new", line)
	}
	switch fields[0] {
	case "new":
		var bugs []research.Switch
		if args["bugs"] != "" {
			sw, err := research.Parse(args["bugs"])
			if err != nil {
				t.Fatal(err)
			}
			for _, b := range research.All() {
				if sw.Has(b) {
					bugs = append(bugs, b)
				}
			}
		}
		l = newLink(t, num("pages", 4), bugs...)
		l.lenient = true
	case "submit":
		if err := l.trySubmit(id, num("tokens", 4)); err != nil {
			l.logf("prefill rejects r%d: %v", id, err)
		}
	case "deliver":
		for range num("n", 1) {
			l.deliverOne()
		}
	case "back":
		for range num("n", 1) {
			l.backOne()
		}
	case "run":
		l.run()
	case "cancel":
		side := args["side"]
		if side == "" || side == "both" || side == "decode" {
			l.r.Cancel(id)
		}
		if side == "" || side == "both" || side == "prefill" {
			l.s.Cancel(id)
		}
		l.collect()
	case "tick":
		d, err := time.ParseDuration(args["d"])
		if err != nil {
			t.Fatal(err)
		}
		l.now = l.now.Add(d)
		l.r.Tick(l.now)
		l.collect()
	case "peer-failed":
		l.r.PeerFailed(prefill)
		l.collect()
	case "read":
		l.read(id)
	case "corrupt":
		l.dst.payload[num("page", 0)][3] ^= 0xFF
		l.logf("page %d corrupted", num("page", 0))
	case "stale-tag":
		w := l.wire[0].Write
		w.Tag = Tag{Request: w.Request, Epoch: w.Remote.Epoch - 1, Index: w.Index, Tokens: 4}.Append(nil, testKey)
		l.logf("the tag record of %s now carries epoch %d", opString(l.wire[0]), w.Remote.Epoch-1)
	case "send-decode":
		m := &Done{Request: id, Tokens: uint32(num("tokens", 4)), Pages: uint32(num("pages", 1))}
		l.logf("decode receives %s", opString(Op{Msg: m}))
		if err := l.r.Step(prefill, m, l.now); err != nil {
			l.refuse("decode", err)
		}
		l.collect()
	case "send-prefill":
		m := &Grant{Request: id, Tokens: uint32(num("tokens", 4)), Pages: make([]PageGrant, num("pages", 1))}
		l.logf("prefill receives %s", opString(Op{Msg: m}))
		if err := l.s.Step(prefill, m); err != nil {
			l.refuse("prefill", err)
		}
		l.collect()
	case "pools":
		l.logf("pools: decode %d free, %d quarantined; prefill %d free", l.r.Pool().Free(), l.r.Pool().Quarantined(), l.s.Pool().Free())
	default:
		t.Fatalf("unknown command %q", line)
	}
	return l
}

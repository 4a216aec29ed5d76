package demo

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The serve processes' addresses are handed out before any process starts.
// Port 0's picks are independent, so two of one run could be the same port,
// and the second process to bind it died (the start-up flake, docs/demo.md).
// The picker never repeats a port and stays out of the kernel's ephemeral
// range, where port 0's picks and outgoing connections' source ports are.
func TestPortPickerNeverRepeatsAPortAndStaysOutOfTheEphemeralRange(t *testing.T) {
	p := newPortPicker()
	lo, hi := ephemeralRange()
	seen := map[string]bool{}
	for range 2000 {
		a, err := p.addr()
		if err != nil {
			t.Fatal(err)
		}
		if seen[a] {
			t.Fatalf("%s handed out twice", a)
		}
		seen[a] = true
		_, ps, _ := net.SplitHostPort(a)
		port, _ := strconv.Atoi(ps)
		if port < portFloor || port >= lo && port <= hi {
			t.Fatalf("%s: below %d or in the ephemeral range %d-%d", a, portFloor, lo, hi)
		}
	}
}

func TestPortPickerSkipsAPortInUse(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	taken := ln.Addr().(*net.TCPAddr).Port
	// A range of 1,001 ports that ends with the taken one: drawing it dry
	// would draw the taken port unless the picker checks.
	p := &portPicker{ranges: [][2]int{{taken - 1000, taken + 1}}, used: map[int]bool{}, rng: newPortPicker().rng}
	for range 1001 {
		a, err := p.addr()
		if err != nil {
			break // the range ran out: every free port was drawn
		}
		if a == ln.Addr().String() {
			t.Fatalf("drew %s, which a listener holds", a)
		}
	}
}

func TestPortPickerRefusesATooNarrowRange(t *testing.T) {
	p := &portPicker{ranges: [][2]int{{portFloor, portFloor + 10}}, used: map[int]bool{}, rng: newPortPicker().rng}
	if _, err := p.addr(); !errors.Is(err, errNoPort) {
		t.Fatalf("a 10-port range: %v, want errNoPort", err)
	}
}

// A serve process that exits during start-up (here one that cannot bind
// its address) ends StartProcs at once with its name and the end of its
// output, not after the 30 s wait with the router's last answer: the
// start-up flake's log said only that a pair's handoff failed.
func TestStartProcsNamesANodeThatExitsAtStartUp(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "kvhandoff")
	script := `#!/bin/sh
case "$1" in certs) exit 0;; esac
case "$*" in *"--name prefill-0 "*)
  echo '{"level":"INFO","msg":"serve: starting"}'
  echo 'kvhandoff serve: listen tcp 127.0.0.1:20001: bind: address already in use' >&2
  exit 1;;
esac
exec sleep 60
`
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	p, err := StartProcs(bin, dir, Default(), "", nil)
	if err == nil {
		p.Stop()
		t.Fatal("StartProcs succeeded with a node that exited")
	}
	msg := err.Error()
	for _, want := range []string{"prefill-0 exited", "exit status 1", "address already in use"} {
		if !strings.Contains(msg, want) {
			t.Errorf("the error lacks %q:\n%s", want, msg)
		}
	}
	if strings.Contains(msg, "within") {
		t.Errorf("StartProcs waited out its timeout instead of naming the exit:\n%s", msg)
	}
	t.Logf("after %v: %s", time.Since(start).Round(time.Millisecond), msg)
}

func TestTailKeepsTheLastWholeLines(t *testing.T) {
	var tl tail
	for i := range 5000 {
		tl.Write([]byte("line " + strconv.Itoa(i) + "\n"))
	}
	if got := tl.lastLines(3); got != "line 4997\nline 4998\nline 4999" {
		t.Fatalf("lastLines(3) = %q", got)
	}
	if len(tl.buf) > tailBytes {
		t.Fatalf("kept %d bytes, more than %d", len(tl.buf), tailBytes)
	}
	// Every line kept, asked for more than there are: whole lines only, the
	// one the trim cut through left out.
	all := strings.Split(tl.lastLines(100000), "\n")
	first := 5000 - len(all)
	for i, l := range all {
		if l != "line "+strconv.Itoa(first+i) {
			t.Fatalf("line %d of what was kept is %q, want %q", i, l, "line "+strconv.Itoa(first+i))
		}
	}
	// A buffer never trimmed keeps its first line, even at exactly tailBytes.
	var exact tail
	exact.Write([]byte("first\n" + strings.Repeat("x", tailBytes-7) + "\n"))
	if got := exact.lastLines(10); !strings.HasPrefix(got, "first\n") {
		t.Fatalf("%d bytes, never trimmed: lastLines dropped the first line: %.20q...", tailBytes, got)
	}
	var short tail
	short.Write([]byte("only\n"))
	if got := short.lastLines(10); got != "only" {
		t.Fatalf("lastLines of one line = %q", got)
	}
}

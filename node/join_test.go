package node

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/rdma/inproc"
)

// registeredNames is the names etcd holds under prefix now.
func registeredNames(t *testing.T, reg Registry) []string {
	t.Helper()
	ms, err := Registered(context.Background(), reg)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range ms {
		out = append(out, m.Name)
	}
	return out
}

// A node joining a deployment in etcd is checked against what the other
// nodes registered: a good one registers; one whose pool is smaller than the
// context, whose page size or model differs, or whose advertised context is
// more than a registered pool holds, is refused with ErrWouldBreak naming
// the problem, and leaves no record. Without CheckJoin the same bad node
// registers (the check is what refuses it).
func TestJoinIsRefusedWhereItWouldBreakTheDeployment(t *testing.T) {
	addr := startEtcd(t)
	reg, err := NewEtcd([]string{addr}, "/join/nodes", 2*time.Second, quietLog())
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Close()
	// The deployment already there: one decode node, a pool of 1,024 tokens
	// in pages of 16, a context of 512, model m.
	regCtx, deregister := context.WithCancel(context.Background())
	defer deregister()
	if _, err := reg.Register(regCtx, Member{Name: "decode-0", Role: RoleDecode, Control: "127.0.0.1:1", Transfer: "127.0.0.1:2",
		PoolPages: 64, PageTokens: 16, PageBytes: 4096, ContextTokens: 512, Model: "m"}); err != nil {
		t.Fatal(err)
	}
	fabric := inproc.NewFabric(fmt.Sprintf("join-%d", time.Now().UnixNano()))
	cases := []struct {
		name                       string
		pages, pageTokens, context int
		model                      string
		noCheck                    bool
		refused                    string // "" joins
	}{
		{name: "prefill-good", pages: 64, pageTokens: 16, context: 512, model: "m"},
		{name: "prefill-pages", pages: 64, pageTokens: 32, context: 512, model: "m", refused: "page size differs: decode-0 has pages of 16 tokens (4,096 bytes), prefill-pages of 32 tokens"},
		{name: "prefill-model", pages: 64, pageTokens: 16, context: 512, model: "other", refused: `model differs: decode-0 serves "m", prefill-model serves "other"`},
		{name: "prefill-short", pages: 16, pageTokens: 16, context: 512, model: "m", refused: "prefill pool of prefill-short holds 256 tokens, fewer than the context length of 512"},
		{name: "prefill-wide", pages: 256, pageTokens: 16, context: 2048, model: "m", refused: "decode pool of decode-0 holds 1,024 tokens, fewer than the context length of 2,048"},
		{name: "prefill-unchecked", pages: 16, pageTokens: 16, context: 512, model: "m", noCheck: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p, err := NewPrefill(NodeConfig{Name: c.name, Device: fabric.Device(c.name), Pages: c.pages, PageTokens: c.pageTokens, PageBytes: 4096,
				ContextTokens: c.context, ModelID: c.model, Security: Security{Insecure: true}, Registry: reg, Log: quietLog(), CheckJoin: !c.noCheck})
			if err != nil {
				t.Fatal(err)
			}
			ctl, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			ctx, stop := context.WithCancel(context.Background())
			defer stop()
			served := make(chan error, 1)
			go func() { served <- p.Serve(ctx, ctl, time.Second) }()
			if c.refused != "" {
				select {
				case err := <-served:
					if !errors.Is(err, ErrWouldBreak) || !strings.Contains(err.Error(), c.refused) {
						t.Fatalf("Serve: %v; want ErrWouldBreak naming %q", err, c.refused)
					}
				case <-time.After(20 * time.Second):
					t.Fatal("a node that would break the deployment is serving")
				}
				if names := registeredNames(t, reg); slices.Contains(names, c.name) {
					t.Fatalf("the refused node is registered: %v", names)
				}
				return
			}
			deadline := time.Now().Add(20 * time.Second)
			for !slices.Contains(registeredNames(t, reg), c.name) {
				select {
				case err := <-served:
					t.Fatalf("a good node stopped: %v", err)
				default:
				}
				if time.Now().After(deadline) {
					t.Fatal("a good node did not register")
				}
				time.Sleep(10 * time.Millisecond)
			}
			stop()
			if err := <-served; err != nil {
				t.Fatalf("Serve: %v", err)
			}
		})
	}
}

// CheckJoin refuses only problems the node adds: a deployment already
// broken (a registered pool short of the context) does not stop a good node
// joining, and a node's own stale record (a restart before its lease
// expired) is replaced, not compared with.
func TestJoinIgnoresProblemsTheDeploymentAlreadyHad(t *testing.T) {
	reg, err := NewStatic(
		Member{Name: "decode-0", Role: RoleDecode, Control: "a", Transfer: "b", PoolPages: 16, PageTokens: 16, PageBytes: 4096, ContextTokens: 512, Model: "m"},
		Member{Name: "prefill-0", Role: RolePrefill, Control: "c", PoolPages: 64, PageTokens: 32, PageBytes: 4096, ContextTokens: 512, Model: "old"})
	if err != nil {
		t.Fatal(err)
	}
	self := Member{Name: "prefill-0", Role: RolePrefill, Control: "c", PoolPages: 64, PageTokens: 16, PageBytes: 4096, ContextTokens: 512, Model: "m"}
	if err := CheckJoin(context.Background(), reg, self); err != nil {
		t.Fatalf("a good node refused: %v", err)
	}
	self.Model = "other"
	if err := CheckJoin(context.Background(), reg, self); !errors.Is(err, ErrWouldBreak) || !strings.Contains(err.Error(), "model differs") {
		t.Fatalf("CheckJoin: %v; want ErrWouldBreak, model differs", err)
	}
}

// decodeMember is a decode node's record with pages of pageTokens tokens.
func decodeMember(name string, pageTokens int) Member {
	return Member{Name: name, Role: RoleDecode, Control: "127.0.0.1:1", Transfer: "127.0.0.1:2",
		PoolPages: 64, PageTokens: pageTokens, PageBytes: 4096, ContextTokens: 512, Model: "m"}
}

// twoEtcdClients is two nodes' registries on one etcd, under one prefix.
func twoEtcdClients(t *testing.T, prefix string) (a, b *Etcd) {
	t.Helper()
	addr := startEtcd(t)
	for _, r := range []**Etcd{&a, &b} {
		reg, err := NewEtcd([]string{addr}, prefix, 2*time.Second, quietLog())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { reg.Close() })
		*r = reg
	}
	return a, b
}

// Two nodes that conflict (their page sizes differ) join an empty etcd
// registry at once: A reads the registry and passes its check, then, before
// A's put, B joins whole. A's put is a transaction conditioned on nothing
// under the prefix having changed since its read, so it fails; A checks
// again, now against B, and is refused. Exactly one of them joins.
func TestConflictingJoinsRacingInEtcdAdmitOnlyOne(t *testing.T) {
	regA, regB := twoEtcdClients(t, "/race/nodes")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var errB error
	hooks := 0
	regA.beforeCommit = func() {
		hooks++
		if hooks == 1 {
			_, errB = Join(ctx, regB, decodeMember("decode-b", 32), true)
		}
	}
	_, errA := Join(ctx, regA, decodeMember("decode-a", 16), true)
	if errB != nil {
		t.Fatalf("B, joining first: %v", errB)
	}
	if !errors.Is(errA, ErrWouldBreak) || !strings.Contains(errA.Error(), "page size differs") {
		t.Fatalf("A, joining second: %v; want ErrWouldBreak, page size differs", errA)
	}
	if hooks != 1 {
		t.Fatalf("A passed its check %d times; want once (its second check sees B and refuses)", hooks)
	}
	if names := registeredNames(t, regA); !slices.Equal(names, []string{"decode-b"}) {
		t.Fatalf("registered: %v; want only decode-b", names)
	}
}

// The gap the transaction closes: CheckJoin then Register, with B joining
// in between, lets both conflicting nodes in.
func TestCheckThenRegisterLetsConflictingNodesBothIn(t *testing.T) {
	regA, regB := twoEtcdClients(t, "/gap/nodes")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := CheckJoin(ctx, regA, decodeMember("decode-a", 16)); err != nil {
		t.Fatal(err)
	}
	if _, err := Join(ctx, regB, decodeMember("decode-b", 32), true); err != nil {
		t.Fatal(err)
	}
	if _, err := regA.Register(ctx, decodeMember("decode-a", 16)); err != nil {
		t.Fatal(err)
	}
	if names := registeredNames(t, regA); len(names) != 2 {
		t.Fatalf("registered: %v; want both (this is the race Join closes)", names)
	}
}

// Two compatible nodes racing both join: A's put fails once, its second
// check passes against B, and its second put commits.
func TestCompatibleJoinsRacingInEtcdBothJoin(t *testing.T) {
	regA, regB := twoEtcdClients(t, "/both/nodes")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hooks := 0
	var errB error
	regA.beforeCommit = func() {
		hooks++
		if hooks == 1 {
			_, errB = Join(ctx, regB, decodeMember("decode-b", 16), true)
		}
	}
	if _, err := Join(ctx, regA, decodeMember("decode-a", 16), true); err != nil || errB != nil {
		t.Fatalf("A: %v, B: %v; want both joined", err, errB)
	}
	if hooks != 2 {
		t.Fatalf("A checked %d times; want twice (its first put lost the race)", hooks)
	}
	if names := registeredNames(t, regA); !slices.Equal(names, []string{"decode-a", "decode-b"}) {
		t.Fatalf("registered: %v; want decode-a and decode-b", names)
	}
}

// A registry that changes between every check and put makes Join give up
// after a bounded number of attempts with ErrJoinContended, leaving no
// record behind.
func TestJoinGivesUpOnARegistryThatKeepsChanging(t *testing.T) {
	regA, regB := twoEtcdClients(t, "/busy/nodes")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hooks := 0
	regA.beforeCommit = func() {
		hooks++
		if _, err := regB.Register(ctx, decodeMember(fmt.Sprintf("decode-%d", hooks), 16)); err != nil {
			t.Error(err)
		}
	}
	_, err := Join(ctx, regA, decodeMember("decode-a", 16), true)
	if !errors.Is(err, ErrJoinContended) || hooks != maxJoinAttempts {
		t.Fatalf("Join: %v after %d checks; want ErrJoinContended after %d", err, hooks, maxJoinAttempts)
	}
	if names := registeredNames(t, regA); slices.Contains(names, "decode-a") {
		t.Fatalf("registered: %v; want no decode-a", names)
	}
}

// With static --peers, Join waits for every listed peer to answer before it
// checks: started at the moment the peer list is (no peer read yet), a node
// whose page size differs from a listed decode node's is still refused, a
// compatible one joins, and one whose listed peer never answers refuses to
// start, naming that peer.
func TestStaticJoinChecksEveryListedPeer(t *testing.T) {
	l, err := StartLocal(LocalConfig{Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	pre, dec := l.Prefills[0], l.Decodes[0]
	dec.mu.Lock()
	decode := dec.self
	dec.mu.Unlock()
	gone, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ghost := gone.Addr().String()
	gone.Close() // nothing answers there
	self := Member{Name: "prefill-9", Role: RolePrefill, Control: "127.0.0.1:1", PoolPages: decode.PoolPages, PageTokens: decode.PageTokens,
		PageBytes: decode.PageBytes, ContextTokens: decode.ContextTokens, Model: decode.Model}
	wide := self
	wide.PageTokens *= 2
	cases := []struct {
		name  string
		peers []Peer
		self  Member
		want  error // nil: joins
	}{
		{"conflicting", []Peer{{Name: decode.Name, Control: decode.Control}}, wide, ErrWouldBreak},
		{"compatible", []Peer{{Name: decode.Name, Control: decode.Control}}, self, nil},
		{"unanswered", []Peer{{Name: decode.Name, Control: decode.Control}, {Name: "decode-9", Control: ghost}}, self, ErrPeersUnanswered},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			list := NewPeerList(ctx, c.peers, pre.cfg.Security, quietLog())
			list.JoinWait = time.Second
			_, err := Join(ctx, list, c.self, true)
			switch {
			case c.want == nil && err != nil:
				t.Fatalf("Join: %v; want joined", err)
			case c.want != nil && !errors.Is(err, c.want):
				t.Fatalf("Join: %v; want %v", err, c.want)
			case c.want == ErrPeersUnanswered && !strings.Contains(err.Error(), "decode-9 ("+ghost+")"):
				t.Fatalf("Join: %v; want it to name decode-9 at %s", err, ghost)
			}
			if err != nil {
				t.Logf("refused: %v", err)
			}
		})
	}
}

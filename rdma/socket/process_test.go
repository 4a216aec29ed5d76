package socket

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/rdma"
)

// pattern is the bytes the parent writes and the child expects.
func pattern(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*13 + i>>8)
	}
	return b
}

// endpoint is one side of the cross-process test: a device, a queue pair and
// a region for messages.
type endpoint struct {
	dev   *Device
	pd    rdma.ProtectionDomain
	cq    rdma.CompletionQueue
	qp    rdma.QueuePair
	inbox rdma.MemoryRegion
}

// newEndpoint opens node name's device with its certificate from the files
// in dir (pki.WriteFiles).
func newEndpoint(t testing.TB, dir, name string) *endpoint {
	tc, err := pki.Load(filepath.Join(dir, pki.CertFile(name)), filepath.Join(dir, pki.KeyFile(name)), filepath.Join(dir, pki.CAFile))
	if err != nil {
		t.Fatal(err)
	}
	d, err := Listen("tcp", "127.0.0.1:0", Config{TLS: tc})
	if err != nil {
		t.Fatal(err)
	}
	e := &endpoint{dev: d}
	e.pd, _ = d.AllocPD()
	e.cq, _ = d.CreateCQ(256)
	if e.qp, err = e.pd.CreateQP(e.cq, e.cq, 256); err != nil {
		t.Fatal(err)
	}
	if e.inbox, err = e.pd.Alloc(64, rdma.LocalWrite); err != nil {
		t.Fatal(err)
	}
	if err := e.qp.PostRecv(rdma.WorkRequest{ID: 1 << 63, Op: rdma.OpRecv, Local: rdma.SGE{MR: e.inbox, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	return e
}

// next waits for the next completion on e's queue; it must succeed.
func (e *endpoint) next() (rdma.Completion, error) {
	c := e.cq.Wait(1, 20*time.Second)
	if len(c) == 0 {
		return rdma.Completion{}, errors.New("no completion within 20s")
	}
	if c[0].Status != rdma.Success {
		return c[0], fmt.Errorf("completion %+v", c[0])
	}
	return c[0], nil
}

const regionBytes = 16 * 4096

// TestHelperResponder is the child process of TestWritesCrossProcesses; it
// does nothing unless the parent started it.
func TestHelperResponder(t *testing.T) {
	if os.Getenv("KVH_SOCKET_CHILD") != "1" {
		t.Skip("runs as the child of TestWritesCrossProcesses")
	}
	if err := responder(t); err != nil {
		fmt.Println("CHILD-ERROR", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// responder: publish the queue pair and a writable region, connect back to
// the parent, wait for its SEND, check the region, answer "ok" or "bad".
func responder(t *testing.T) error {
	e := newEndpoint(t, os.Getenv("KVH_SOCKET_CERTS"), "child")
	kv, err := e.pd.Alloc(regionBytes, rdma.LocalWrite|rdma.RemoteWrite)
	if err != nil {
		return err
	}
	info := e.qp.Info()
	fmt.Printf("INFO %s %d %d %s %d %d\n", info.Fabric, info.QPN, info.PSN, info.Node, kv.Addr(), kv.RKey())
	var peer rdma.ConnInfo
	if _, err := fmt.Fscan(os.Stdin, &peer.Fabric, &peer.QPN, &peer.PSN, &peer.Node); err != nil {
		return err
	}
	if err := e.qp.Connect(peer); err != nil {
		return err
	}
	c, err := e.next()
	if err != nil {
		return err
	}
	verdict := "bad"
	if c.Op == rdma.OpRecv && string(e.inbox.Bytes()[:c.Bytes]) == "done" && bytes.Equal(kv.Bytes(), pattern(regionBytes)) {
		verdict = "ok"
	}
	copy(e.inbox.Bytes(), verdict)
	if err := e.qp.PostSend(rdma.WorkRequest{ID: 2, Op: rdma.OpSend, Local: rdma.SGE{MR: e.inbox, Length: len(verdict)}}); err != nil {
		return err
	}
	_, err = e.next()
	return err
}

// The socket provider between two processes, each with its certificate from
// files of one authority: WRITEs from the parent land in the child's region,
// and the child, woken by the SEND behind them, finds every byte in place.
func TestWritesCrossProcesses(t *testing.T) {
	dir := t.TempDir()
	if err := testCA().WriteFiles(dir, false, "parent:prefill", "child:decode"); err != nil {
		t.Fatal(err)
	}
	child := exec.Command(os.Args[0], "-test.run=^TestHelperResponder$", "-test.count=1")
	child.Env = append(os.Environ(), "KVH_SOCKET_CHILD=1", "KVH_SOCKET_CERTS="+dir)
	stdin, _ := child.StdinPipe()
	stdout, _ := child.StdoutPipe()
	child.Stderr = os.Stderr
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	defer child.Process.Kill()
	lines := bufio.NewScanner(stdout)
	var remote rdma.ConnInfo
	var addr uint64
	var rkey uint32
	for lines.Scan() {
		if _, err := fmt.Sscanf(lines.Text(), "INFO %s %d %d %s %d %d", &remote.Fabric, &remote.QPN, &remote.PSN, &remote.Node, &addr, &rkey); err == nil {
			break
		}
	}
	if remote.Fabric == "" {
		t.Fatal("the child published no queue pair")
	}
	e := newEndpoint(t, dir, "parent")
	defer e.dev.Close()
	remote.Node = "child" // the name we know the child by, not the one it told
	if err := e.qp.Connect(remote); err != nil {
		t.Fatal(err)
	}
	info := e.qp.Info()
	fmt.Fprintf(stdin, "%s %d %d %s\n", info.Fabric, info.QPN, info.PSN, info.Node)
	src, _ := e.pd.Alloc(regionBytes, rdma.LocalWrite)
	copy(src.Bytes(), pattern(regionBytes))
	for i := 0; i < regionBytes/4096; i++ {
		if err := e.qp.PostSend(rdma.WorkRequest{ID: uint64(i), Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Offset: i * 4096, Length: 4096},
			RemoteAddr: addr + uint64(i*4096), RKey: rkey}); err != nil {
			t.Fatal(err)
		}
	}
	msg, _ := e.pd.Alloc(8, rdma.LocalWrite)
	copy(msg.Bytes(), "done")
	if err := e.qp.PostSend(rdma.WorkRequest{ID: 100, Op: rdma.OpSend, Local: rdma.SGE{MR: msg, Length: 4}}); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < regionBytes/4096+2; i++ { // 16 WRITEs, the SEND, the child's answer
		c, err := e.next()
		if err != nil {
			t.Fatal(err)
		}
		if c.Op == rdma.OpRecv {
			if got := string(e.inbox.Bytes()[:c.Bytes]); got != "ok" {
				t.Fatalf("the child says %q", got)
			}
		}
	}
	for lines.Scan() {
		t.Log("child:", lines.Text())
	}
	if err := child.Wait(); err != nil {
		t.Fatalf("child: %v", err)
	}
}

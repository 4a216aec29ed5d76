package main

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/rdmatest"
	"github.com/kvhandoff/kvhandoff/rdma/socket"
)

// The files `kvhandoff certs` writes are what two nodes need to connect
// queue pairs over TLS: a WRITE from one lands in the other; a second run
// into the same directory overwrites nothing; a name that cannot be a DNS
// name is refused, and so is a node without one of the three roles; each
// certificate carries its node's role, and the ticket key is written.
func TestCertsWritesWhatNodesConnectWith(t *testing.T) {
	dir := t.TempDir()
	if code, _, stderr := runCLI(t, "certs", "--dir", dir, "--nodes", "prefill-0,decode-0"); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	open := func(name string) rdma.Device {
		tc, err := pki.Load(filepath.Join(dir, name+".pem"), filepath.Join(dir, name+"-key.pem"), filepath.Join(dir, "ca.pem"))
		if err != nil {
			t.Fatal(err)
		}
		d, err := socket.Listen("tcp", "127.0.0.1:0", socket.Config{TLS: tc})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		return d
	}
	x := rdmatest.NewPair(t, open("prefill-0"), open("decode-0"))
	if x.B.Info().Node != "decode-0" {
		t.Fatalf("decode's identity is %q", x.B.Info().Node)
	}
	src, _ := x.PDA.Alloc(8, rdma.LocalWrite)
	dst, _ := x.PDB.Alloc(8, rdma.LocalWrite|rdma.RemoteWrite)
	copy(src.Bytes(), "over tls")
	if err := x.A.PostSend(rdma.WorkRequest{ID: 1, Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: 8}, RemoteAddr: dst.Addr(), RKey: dst.RKey()}); err != nil {
		t.Fatal(err)
	}
	if c := x.ASend.Wait(1, 10*time.Second); len(c) != 1 || c[0].Status != rdma.Success || string(dst.Bytes()) != "over tls" {
		t.Fatalf("WRITE: %+v", c)
	}
	if code, _, _ := runCLI(t, "certs", "--dir", dir, "--nodes", "decode-0"); code != 1 {
		t.Fatalf("a second run into the same directory: exit %d, want 1", code)
	}
	more := t.TempDir()
	if code, _, stderr := runCLI(t, "certs", "--dir", more, "--nodes", "decode-1", "--ca", filepath.Join(dir, "ca.pem"), "--ca-key", filepath.Join(dir, "ca-key.pem")); code != 0 {
		t.Fatalf("issuing from the existing authority: exit %d: %s", code, stderr)
	}
	if code, _, _ := runCLI(t, "certs", "--dir", t.TempDir(), "--nodes", "Decode_0"); code != 1 {
		t.Fatalf("a bad node name: exit %d, want 1", code)
	}
	for _, nodes := range []string{"intruder", "gpu-1:admin"} {
		if code, _, _ := runCLI(t, "certs", "--dir", t.TempDir(), "--nodes", nodes); code != 1 {
			t.Fatalf("--nodes %s (no role of the three): exit %d, want 1", nodes, code)
		}
	}
	// Each certificate carries its role, inferred or named; the ticket key's
	// halves are written beside the authority.
	roles := t.TempDir()
	if code, _, stderr := runCLI(t, "certs", "--dir", roles, "--nodes", "router,prefill-0,gpu-7:decode"); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for name, want := range map[string]pki.Role{"router": pki.RoleRouter, "prefill-0": pki.RolePrefill, "gpu-7": pki.RoleDecode} {
		tc, err := pki.Load(filepath.Join(roles, pki.CertFile(name)), filepath.Join(roles, pki.KeyFile(name)), filepath.Join(roles, pki.CAFile))
		if err != nil {
			t.Fatal(err)
		}
		if got, err := pki.OwnRole(tc); err != nil || got != want {
			t.Fatalf("%s: role %q, %v; want %q", name, got, err, want)
		}
	}
	if _, err := pki.LoadTicketKey(filepath.Join(roles, pki.TicketKeyFile)); err != nil {
		t.Fatal(err)
	}
	if _, err := pki.LoadTicketPublic(filepath.Join(roles, pki.TicketPublicFile)); err != nil {
		t.Fatal(err)
	}
	if code, _, _ := runCLI(t, "certs", "--nodes", "a"); code != 2 {
		t.Fatalf("no --dir: exit %d, want 2", code)
	}
}

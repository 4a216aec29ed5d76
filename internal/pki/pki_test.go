package pki

import (
	"crypto/ed25519"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
)

// handshake runs a TLS handshake between a dialer expecting serverName and
// an acceptor; it returns the two sides' errors.
func handshake(t *testing.T, dialer, acceptor *tls.Config, serverName string) (dialErr, acceptErr error) {
	t.Helper()
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	c := dialer.Clone()
	c.ServerName = serverName
	done := make(chan error, 1)
	go func() { done <- tls.Server(b, acceptor).Handshake(); b.Close() }()
	dialErr = tls.Client(a, c).Handshake()
	a.Close()
	return dialErr, <-done
}

func TestNodesOfOneAuthorityAuthenticateEachOther(t *testing.T) {
	ca, err := NewCA("test")
	if err != nil {
		t.Fatal(err)
	}
	decode, _ := ca.Config("decode-0")
	prefill, _ := ca.Config("prefill-0")
	if d, a := handshake(t, prefill, decode, "decode-0"); d != nil || a != nil {
		t.Fatalf("dial %v, accept %v", d, a)
	}
	if d, _ := handshake(t, prefill, decode, "decode-1"); d == nil {
		t.Fatal("a peer was accepted under a name its certificate does not carry")
	}
	other, _ := NewCA("other")
	stranger, _ := other.Config("decode-0")
	if d, _ := handshake(t, prefill, stranger, "decode-0"); d == nil {
		t.Fatal("a server certified by another authority was accepted")
	}
	if _, a := handshake(t, stranger, decode, "decode-0"); a == nil {
		t.Fatal("a client certified by another authority was accepted")
	}
	anonymous := &tls.Config{RootCAs: ca.Pool(), MinVersion: tls.VersionTLS13}
	if _, a := handshake(t, anonymous, decode, "decode-0"); a == nil {
		t.Fatal("a client without a certificate was accepted")
	}
	if n, err := Name(decode); err != nil || n != "decode-0" {
		t.Fatalf("Name: %q, %v", n, err)
	}
}

func TestWrittenFilesLoadBackAndAreNeverOverwritten(t *testing.T) {
	dir := t.TempDir()
	ca, _ := NewCA("deployment")
	if err := ca.WriteFiles(dir, true, "router", "prefill-0", "decode-0"); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{CAKeyFile, KeyFile("decode-0")} {
		st, err := os.Stat(filepath.Join(dir, f))
		if err != nil || st.Mode().Perm() != 0o600 {
			t.Fatalf("%s: %v, mode %v; want 0600", f, err, st.Mode())
		}
	}
	load := func(n string) *tls.Config {
		c, err := Load(filepath.Join(dir, CertFile(n)), filepath.Join(dir, KeyFile(n)), filepath.Join(dir, CAFile))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	if d, a := handshake(t, load("prefill-0"), load("decode-0"), "decode-0"); d != nil || a != nil {
		t.Fatalf("dial %v, accept %v", d, a)
	}
	again, err := LoadCA(filepath.Join(dir, CAFile), filepath.Join(dir, CAKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := again.WriteFiles(dir, false, "decode-0"); err == nil {
		t.Fatal("an existing node key was overwritten")
	}
	later := t.TempDir()
	if err := again.WriteFiles(later, false, "decode-1"); err != nil {
		t.Fatal(err)
	}
	c, err := Load(filepath.Join(later, CertFile("decode-1")), filepath.Join(later, KeyFile("decode-1")), filepath.Join(dir, CAFile))
	if err != nil {
		t.Fatal(err)
	}
	if d, a := handshake(t, load("router"), c, "decode-1"); d != nil || a != nil {
		t.Fatalf("a node issued later by the loaded authority: dial %v, accept %v", d, a)
	}
	if _, err := ca.Issue("Decode_0"); !errors.Is(err, ErrBadName) {
		t.Fatalf("bad name: %v", err)
	}
}

// A certificate carries the role it was issued for, as one URI SAN; a name
// that begins with its role gets that role; CheckPeer refuses another name,
// another role, and a certificate without a role, each with its error.
func TestCertificatesCarryTheirRoleAndCheckPeerHoldsThemToIt(t *testing.T) {
	ca, err := NewCA("test")
	if err != nil {
		t.Fatal(err)
	}
	leaf := func(name string, role Role) *x509.Certificate {
		c, err := ca.IssueAs(name, role)
		if err != nil {
			t.Fatal(err)
		}
		return c.Leaf
	}
	for name, want := range map[string]Role{"router": RoleRouter, "prefill-0": RolePrefill, "decode1": RoleDecode, "decoder": "", "intruder": "", "prefill.x": RolePrefill} {
		if got := InferRole(name); got != want {
			t.Errorf("InferRole(%q) = %q, want %q", name, got, want)
		}
	}
	p := leaf("prefill-0", RolePrefill)
	if r, err := RoleOf(p); err != nil || r != RolePrefill || len(p.URIs) != 1 || p.URIs[0].String() != "kvhandoff:role/prefill" {
		t.Fatalf("RoleOf: %q, %v (%v)", r, err, p.URIs)
	}
	if err := CheckPeer(p, "prefill-0", RolePrefill); err != nil {
		t.Fatal(err)
	}
	for what, c := range map[string]struct {
		err  error
		cert *x509.Certificate
		name string
		role Role
	}{
		"another name":             {ErrWrongName, p, "prefill-1", RolePrefill},
		"a decode node as prefill": {ErrWrongRole, leaf("decode-0", RoleDecode), "decode-0", RolePrefill},
		"no role":                  {ErrNoRole, leaf("prefill-0", ""), "prefill-0", RolePrefill},
	} {
		if err := CheckPeer(c.cert, c.name, c.role); !errors.Is(err, c.err) || !errors.Is(err, ErrPeerRefused) {
			t.Errorf("%s: %v, want %v", what, err, c.err)
		}
	}
	if _, err := ca.IssueAs("x", "admin"); err == nil {
		t.Fatal("a role that is none of the three was issued")
	}
	for _, bad := range []string{"intruder", "x:admin", "decoder"} {
		if _, _, err := ParseNode(bad); err == nil {
			t.Errorf("ParseNode(%q) took it", bad)
		}
	}
	if n, r, err := ParseNode("gpu-7:decode"); err != nil || n != "gpu-7" || r != RoleDecode {
		t.Fatalf("ParseNode: %q %q %v", n, r, err)
	}
}

// The ticket key's two halves load back and sign and verify together; the
// files are never overwritten, the private half is mode 0600.
func TestTicketKeyFilesLoadBack(t *testing.T) {
	dir := t.TempDir()
	if err := WriteTicketKey(dir); err != nil {
		t.Fatal(err)
	}
	if err := WriteTicketKey(dir); err == nil {
		t.Fatal("a ticket key was overwritten")
	}
	if st, err := os.Stat(filepath.Join(dir, TicketKeyFile)); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("%v, %v", err, st.Mode())
	}
	priv, err := LoadTicketKey(filepath.Join(dir, TicketKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	pub, err := LoadTicketPublic(filepath.Join(dir, TicketPublicFile))
	if err != nil {
		t.Fatal(err)
	}
	if !ed25519.Verify(pub, []byte("m"), ed25519.Sign(priv, []byte("m"))) {
		t.Fatal("the halves do not match")
	}
	if _, err := LoadTicketPublic(filepath.Join(dir, TicketKeyFile)); !errors.Is(err, ErrNotTicketKey) {
		t.Fatalf("the private half read as the public one: %v", err)
	}
}

package pki

import (
	"crypto/tls"
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

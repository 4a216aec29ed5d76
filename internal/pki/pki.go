// Package pki makes and loads the certificates kvhandoff's nodes authenticate
// each other with (docs/security.md): a certificate authority of the
// deployment, and one certificate per node naming the node the way the
// registry knows it and carrying its role (router, prefill or decode) as a
// URI SAN, kvhandoff:role/ROLE. Every connection a node accepts is TLS 1.3
// with both sides presenting a certificate of that authority, and a peer is
// accepted only under the name and in the role the caller expects (CheckPeer).
//
// The role is a URI SAN rather than an extended key usage OID because it is
// an identity, not a key usage: Go's verifier matches EKUs against the
// usage asked for (client or server authentication) and would treat an
// unknown OID as a usage to refuse or ignore, while URIs are parsed into
// x509.Certificate.URIs, printed by openssl, and the convention SPIFFE uses
// for workload identities.
//
// NewCA makes an authority in memory (tests and the demo throw it away);
// CA.Issue makes a node's certificate; CA.WriteFiles writes both as PEM files
// for a deployment (`kvhandoff certs`); Load reads them back into a
// *tls.Config. Config returns the *tls.Config a node uses both to accept and
// to dial; it is what package rdma/socket's Config.TLS takes.
package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"
)

// CA is a certificate authority: its certificate and its signing key.
type CA struct {
	Cert *x509.Certificate
	key  crypto.Signer
	der  []byte
}

// Validity is how long certificates this package makes are valid.
const Validity = 365 * 24 * time.Hour

// nameRule is what a node name may be: a DNS label or dotted labels, so that
// it can stand as a certificate's DNS name and be matched exactly.
var nameRule = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$`)

// ErrBadName is returned for a node name that cannot be a certificate's DNS
// name (lower-case letters, digits, '-' and '.').
var ErrBadName = errors.New("pki: a node name is lower-case letters, digits, '-' and '.', like a DNS name")

// Role is what a node does in a deployment; a certificate carries one.
type Role string

// The roles a certificate can carry.
const (
	RoleRouter  Role = "router"
	RolePrefill Role = "prefill"
	RoleDecode  Role = "decode"
)

// roleURI is the scheme and opaque prefix of a certificate's role URI:
// kvhandoff:role/prefill.
const (
	roleScheme = "kvhandoff"
	rolePrefix = "role/"
)

// Valid reports whether r is one of the three roles.
func (r Role) Valid() bool { return r == RoleRouter || r == RolePrefill || r == RoleDecode }

// Errors of a peer's identity; each wraps ErrPeerRefused, so a caller that
// only needs to know the peer was refused for who it is matches that.
var (
	// ErrPeerRefused: a peer's certificate is not the one of a node this
	// node accepts where it stands.
	ErrPeerRefused = errors.New("pki: peer refused")
	// ErrNoRole: the certificate carries no role (or more than one); it was
	// made before roles, or by hand.
	ErrNoRole = fmt.Errorf("%w: the certificate carries no single kvhandoff role", ErrPeerRefused)
	// ErrWrongRole: the certificate's role is not the one expected (a
	// decode certificate acting as a prefill node).
	ErrWrongRole = fmt.Errorf("%w: the certificate's role is not the one expected", ErrPeerRefused)
	// ErrWrongName: the certificate does not carry the name expected.
	ErrWrongName = fmt.Errorf("%w: the certificate does not carry the name expected", ErrPeerRefused)
	// ErrUnknownPeer: the name is not one the registry lists in that role.
	ErrUnknownPeer = fmt.Errorf("%w: a name the registry does not list in that role", ErrPeerRefused)
)

// RoleOf is the role cert carries: exactly one kvhandoff:role/ROLE URI of
// a known role, or ErrNoRole.
func RoleOf(cert *x509.Certificate) (Role, error) {
	var found Role
	n := 0
	for _, u := range cert.URIs {
		if u.Scheme != roleScheme || !strings.HasPrefix(u.Opaque, rolePrefix) {
			continue
		}
		n++
		found = Role(strings.TrimPrefix(u.Opaque, rolePrefix))
	}
	if n != 1 || !found.Valid() {
		return "", fmt.Errorf("%w (%d role URIs, %q)", ErrNoRole, n, found)
	}
	return found, nil
}

// CheckPeer checks that a peer's verified certificate carries name (as a
// DNS name) and role want. The chain was verified against the deployment's
// authority by the TLS handshake; this is who the peer is within it.
func CheckPeer(cert *x509.Certificate, name string, want Role) error {
	if err := cert.VerifyHostname(name); err != nil {
		return fmt.Errorf("%w: %q: %v", ErrWrongName, name, err)
	}
	got, err := RoleOf(cert)
	if err != nil {
		return fmt.Errorf("%q: %w", name, err)
	}
	if got != want {
		return fmt.Errorf("%w: %q is certified as %s, not %s", ErrWrongRole, name, got, want)
	}
	return nil
}

// InferRole is the role a node name begins with: "router", "prefill-0"
// and "decode1" name their roles; any other name has none ("").
func InferRole(name string) Role {
	for _, r := range []Role{RoleRouter, RolePrefill, RoleDecode} {
		rest, ok := strings.CutPrefix(name, string(r))
		if ok && (rest == "" || rest[0] == '-' || rest[0] == '.' || (rest[0] >= '0' && rest[0] <= '9')) {
			return r
		}
	}
	return ""
}

// ParseNode reads a node of `kvhandoff certs --nodes`: NAME:ROLE, or NAME
// alone when it begins with its role (InferRole).
func ParseNode(s string) (name string, role Role, err error) {
	name, r, explicit := strings.Cut(s, ":")
	role = Role(r)
	if !explicit {
		role = InferRole(name)
	}
	if !role.Valid() {
		return "", "", fmt.Errorf("pki: node %q: a role of router, prefill or decode is needed (NAME:ROLE, or a name that begins with its role)", s)
	}
	return name, role, nil
}

// NewCA makes a fresh authority named name, valid for Validity from now.
func NewCA(name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-time.Minute),
		NotAfter:              now.Add(Validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, key: key, der: der}, nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	return n
}

// Pool is the certificate pool that trusts exactly ca.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Cert)
	return p
}

// Issue makes the certificate of the node called name in the role its name
// begins with (InferRole; none if it begins with none, a certificate that
// no node accepts as a peer): see IssueAs.
func (ca *CA) Issue(name string) (tls.Certificate, error) {
	return ca.IssueAs(name, InferRole(name))
}

// IssueAs makes the certificate of the node called name in role: its only
// DNS name is name, its role a URI SAN kvhandoff:role/ROLE ("" writes
// none), and it serves both to accept connections and to dial them.
func (ca *CA) IssueAs(name string, role Role) (tls.Certificate, error) {
	if !nameRule.MatchString(name) {
		return tls.Certificate{}, fmt.Errorf("%w: %q", ErrBadName, name)
	}
	var uris []*url.URL
	switch {
	case role.Valid():
		uris = []*url.URL{{Scheme: roleScheme, Opaque: rolePrefix + string(role)}}
	case role != "":
		return tls.Certificate{}, fmt.Errorf("pki: role %q: router, prefill or decode", role)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: name},
		DNSNames:     []string{name},
		URIs:         uris,
		NotBefore:    now.Add(-time.Minute),
		NotAfter:     now.Add(Validity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		return tls.Certificate{}, err
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}

// Config is the TLS configuration of the node called name: a fresh
// certificate from ca, and ca as the only authority it trusts, for accepting
// (client certificates required) and for dialling.
func (ca *CA) Config(name string) (*tls.Config, error) {
	return ca.ConfigAs(name, InferRole(name))
}

// ConfigAs is Config for a certificate of role (IssueAs).
func (ca *CA) ConfigAs(name string, role Role) (*tls.Config, error) {
	cert, err := ca.IssueAs(name, role)
	if err != nil {
		return nil, err
	}
	return Config(cert, ca.Pool()), nil
}

// Config is a node's TLS configuration from its certificate and the
// authorities it trusts: TLS 1.3 only, peers' certificates required and
// verified against roots in both directions. The caller sets ServerName (the
// peer it expects) on a clone before dialling; package rdma/socket does.
func Config(cert tls.Certificate, roots *x509.CertPool) *tls.Config {
	return &tls.Config{
		Certificates: []tls.Certificate{cert},
		RootCAs:      roots,
		ClientCAs:    roots,
		ClientAuth:   tls.RequireAndVerifyClientCert,
		MinVersion:   tls.VersionTLS13,
	}
}

// The files WriteFiles writes in its directory.
const (
	CAFile    = "ca.pem"
	CAKeyFile = "ca-key.pem"
)

// CertFile and KeyFile are the files of node name's certificate and key.
func CertFile(name string) string { return name + ".pem" }

// KeyFile is the file of node name's private key.
func KeyFile(name string) string { return name + "-key.pem" }

// WriteFiles writes, into dir, the authority's certificate (CAFile) and, if
// withKey, its key (CAKeyFile, to issue more later), and for each node
// (NAME:ROLE, or a NAME that begins with its role: ParseNode) a certificate
// of that role (CertFile) and a key (KeyFile). Keys are written mode 0600. It
// refuses to overwrite an existing file: a deployment's keys are not
// replaced by accident.
func (ca *CA) WriteFiles(dir string, withKey bool, nodes ...string) error {
	type file struct {
		name string
		data []byte
		key  bool
	}
	files := []file{{CAFile, pemBlock("CERTIFICATE", ca.der), false}}
	if withKey {
		k, err := x509.MarshalPKCS8PrivateKey(ca.key)
		if err != nil {
			return err
		}
		files = append(files, file{CAKeyFile, pemBlock("PRIVATE KEY", k), true})
	}
	seen := map[string]bool{}
	for _, spec := range nodes {
		n, role, err := ParseNode(spec)
		if err != nil {
			return err
		}
		if seen[n] {
			return fmt.Errorf("pki: node %q named twice", n)
		}
		seen[n] = true
		cert, err := ca.IssueAs(n, role)
		if err != nil {
			return err
		}
		k, err := x509.MarshalPKCS8PrivateKey(cert.PrivateKey)
		if err != nil {
			return err
		}
		files = append(files, file{CertFile(n), pemBlock("CERTIFICATE", cert.Certificate[0]), false},
			file{KeyFile(n), pemBlock("PRIVATE KEY", k), true})
	}
	for _, f := range files {
		if _, err := os.Stat(filepath.Join(dir, f.name)); err == nil {
			return fmt.Errorf("pki: %s exists; not overwriting it", filepath.Join(dir, f.name))
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, f := range files {
		mode := os.FileMode(0o644)
		if f.key {
			mode = 0o600
		}
		out, err := os.OpenFile(filepath.Join(dir, f.name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
		if err != nil {
			return err
		}
		_, err = out.Write(f.data)
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func pemBlock(kind string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der})
}

// LoadCA reads an authority written by WriteFiles with its key, to issue
// more node certificates.
func LoadCA(certFile, keyFile string) (*CA, error) {
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return nil, err
	}
	keyPEM, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, err
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("pki: %s and %s: %w", certFile, keyFile, err)
	}
	signer, ok := pair.PrivateKey.(crypto.Signer)
	if !ok || !pair.Leaf.IsCA {
		return nil, fmt.Errorf("pki: %s is not a certificate authority with its key", certFile)
	}
	return &CA{Cert: pair.Leaf, key: signer, der: pair.Certificate[0]}, nil
}

// Load reads a node's certificate and key and the authority it trusts (the
// files of --tls-cert, --tls-key and --tls-ca) into the node's TLS
// configuration (see Config).
func Load(certFile, keyFile, caFile string) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("pki: %w", err)
	}
	caPEM, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("pki: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("pki: %s holds no PEM certificate", caFile)
	}
	return Config(cert, roots), nil
}

// Name is the node name a configuration's own certificate carries: its first
// DNS name.
func Name(cfg *tls.Config) (string, error) {
	if cfg == nil || len(cfg.Certificates) == 0 || len(cfg.Certificates[0].Certificate) == 0 {
		return "", errors.New("pki: the TLS configuration has no certificate")
	}
	leaf := cfg.Certificates[0].Leaf
	if leaf == nil {
		var err error
		if leaf, err = x509.ParseCertificate(cfg.Certificates[0].Certificate[0]); err != nil {
			return "", fmt.Errorf("pki: %w", err)
		}
	}
	if len(leaf.DNSNames) == 0 {
		return "", errors.New("pki: the certificate names no node (no DNS name)")
	}
	return leaf.DNSNames[0], nil
}

// OwnRole is the role a configuration's own certificate carries (RoleOf).
func OwnRole(cfg *tls.Config) (Role, error) {
	if cfg == nil || len(cfg.Certificates) == 0 || len(cfg.Certificates[0].Certificate) == 0 {
		return "", errors.New("pki: the TLS configuration has no certificate")
	}
	leaf := cfg.Certificates[0].Leaf
	if leaf == nil {
		var err error
		if leaf, err = x509.ParseCertificate(cfg.Certificates[0].Certificate[0]); err != nil {
			return "", fmt.Errorf("pki: %w", err)
		}
	}
	return RoleOf(leaf)
}

package pki

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// The files of the deployment's ticket key (WriteTicketKey): the router
// signs a ticket for each request it dispatches with the private key, and
// decode nodes, holding the public key only, reserve pages only for a
// Bootstrap that carries a valid one (docs/security.md).
//
// The ticket key is an ed25519 key pair of its own rather than the router's
// certificate key: a decode node then trusts exactly one signer for tickets
// (not any certificate the authority gives the router role), the router's
// TLS key never signs anything but handshakes, and the key can be rotated
// without reissuing certificates. Ed25519 signs and verifies in tens of
// microseconds with 64-byte signatures, small beside a handoff.
const (
	TicketKeyFile    = "ticket-key.pem" // the router's --ticket-key (mode 0600)
	TicketPublicFile = "ticket.pem"     // every decode node's --ticket-pub
)

// NewTicketKey makes a fresh ticket key pair.
func NewTicketKey() (ed25519.PublicKey, ed25519.PrivateKey, error) {
	return ed25519.GenerateKey(rand.Reader)
}

// WriteTicketKey writes a fresh ticket key pair into dir: TicketKeyFile
// (the private key, PKCS #8, mode 0600) and TicketPublicFile (PKIX). It
// refuses to overwrite either.
func WriteTicketKey(dir string) error {
	pub, priv, err := NewTicketKey()
	if err != nil {
		return err
	}
	privDER, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		return err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return err
	}
	for _, f := range []string{TicketKeyFile, TicketPublicFile} {
		if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
			return fmt.Errorf("pki: %s exists; not overwriting it", filepath.Join(dir, f))
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := writeNew(filepath.Join(dir, TicketKeyFile), pemBlock("PRIVATE KEY", privDER), 0o600); err != nil {
		return err
	}
	return writeNew(filepath.Join(dir, TicketPublicFile), pemBlock("PUBLIC KEY", pubDER), 0o644)
}

func writeNew(path string, data []byte, mode os.FileMode) error {
	out, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	_, err = out.Write(data)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	return err
}

// ErrNotTicketKey: a file that is not an ed25519 key of the kind asked for.
var ErrNotTicketKey = errors.New("pki: not an ed25519 ticket key")

func readPEM(file, kind string) ([]byte, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("pki: %w", err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != kind {
		return nil, fmt.Errorf("%w: %s holds no %s PEM block", ErrNotTicketKey, file, kind)
	}
	return blk.Bytes, nil
}

// LoadTicketKey reads the router's ticket signing key (TicketKeyFile).
func LoadTicketKey(file string) (ed25519.PrivateKey, error) {
	der, err := readPEM(file, "PRIVATE KEY")
	if err != nil {
		return nil, err
	}
	k, err := x509.ParsePKCS8PrivateKey(der)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrNotTicketKey, file, err)
	}
	priv, ok := k.(ed25519.PrivateKey)
	if !ok {
		return nil, fmt.Errorf("%w: %s holds a %T", ErrNotTicketKey, file, k)
	}
	return priv, nil
}

// LoadTicketPublic reads the ticket key's public half (TicketPublicFile),
// which decode nodes verify tickets with.
func LoadTicketPublic(file string) (ed25519.PublicKey, error) {
	der, err := readPEM(file, "PUBLIC KEY")
	if err != nil {
		return nil, err
	}
	k, err := x509.ParsePKIXPublicKey(der)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrNotTicketKey, file, err)
	}
	pub, ok := k.(ed25519.PublicKey)
	if !ok {
		return nil, fmt.Errorf("%w: %s holds a %T", ErrNotTicketKey, file, k)
	}
	return pub, nil
}

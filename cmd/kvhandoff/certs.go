package main

import (
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/kvhandoff/kvhandoff/internal/pki"
)

const certsUsage = `usage: kvhandoff certs --dir DIR --nodes NAME[:ROLE],... [flags]

Writes a certificate authority for a deployment, a certificate and key for
each node, and the router's ticket key, as PEM files the nodes read with
--tls-cert, --tls-key, --tls-ca, --ticket-key and --ticket-pub
(docs/security.md):

  DIR/ca.pem          the authority's certificate: every node's --tls-ca
  DIR/ca-key.pem      the authority's key (mode 0600): keep it offline; it issues more
  DIR/NAME.pem        node NAME's certificate: --tls-cert. Its only DNS name is
                      NAME, and it carries ROLE (router, prefill or decode) as a
                      URI, kvhandoff:role/ROLE
  DIR/NAME-key.pem    node NAME's key (mode 0600): --tls-key
  DIR/ticket-key.pem  the router's ticket signing key (ed25519, mode 0600): --ticket-key
  DIR/ticket.pem      its public half: every decode node's --ticket-pub

A node is accepted by its peers only under NAME and in ROLE, and only if the
registry lists it so. ROLE may be left out of a NAME that begins with it
(router, prefill-0, decode-1). With --ca and --ca-key, the nodes are issued
by that existing authority, and no new authority or ticket key is made.
Existing files are never overwritten.

`

// runCerts is `kvhandoff certs`.
func runCerts(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("certs", certsUsage, stderr)
	dir := fs.String("dir", "", "directory to write the files into (required)")
	nodes := fs.String("nodes", "", "comma-separated nodes, NAME or NAME:ROLE, as the registry knows them (required)")
	name := fs.String("ca-name", "kvhandoff", "the new authority's common name")
	caCert := fs.String("ca", "", "an existing authority's certificate, to issue from it")
	caKey := fs.String("ca-key", "", "that authority's key")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if *dir == "" || *nodes == "" || (*caCert == "") != (*caKey == "") {
		fmt.Fprintln(stderr, "kvhandoff certs: --dir and --nodes are required; --ca and --ca-key go together")
		return 2
	}
	var names []string
	for _, n := range strings.Split(*nodes, ",") {
		if n = strings.TrimSpace(n); n != "" {
			names = append(names, n)
		}
	}
	var (
		ca  *pki.CA
		err error
	)
	fresh := *caCert == ""
	if fresh {
		ca, err = pki.NewCA(*name)
	} else {
		ca, err = pki.LoadCA(*caCert, *caKey)
	}
	if err == nil {
		err = ca.WriteFiles(*dir, fresh, names...)
	}
	if err == nil && fresh {
		err = pki.WriteTicketKey(*dir)
	}
	if err != nil {
		fmt.Fprintln(stderr, "kvhandoff certs:", err)
		return 1
	}
	if fresh {
		fmt.Fprintf(stdout, "authority %s: %s, %s\n", *name, filepath.Join(*dir, pki.CAFile), filepath.Join(*dir, pki.CAKeyFile))
		fmt.Fprintf(stdout, "ticket key: %s (router), %s (decode nodes)\n", filepath.Join(*dir, pki.TicketKeyFile), filepath.Join(*dir, pki.TicketPublicFile))
	}
	for _, spec := range names {
		n, role, _ := pki.ParseNode(spec) // WriteFiles parsed each already
		fmt.Fprintf(stdout, "%s node %s: %s, %s\n", role, n, filepath.Join(*dir, pki.CertFile(n)), filepath.Join(*dir, pki.KeyFile(n)))
	}
	return 0
}

package main

import (
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/kvhandoff/kvhandoff/internal/pki"
)

const certsUsage = `usage: kvhandoff certs --dir DIR --nodes NAME,... [flags]

Writes a certificate authority for a deployment and a certificate and key for
each node, as PEM files the nodes read with --tls-cert, --tls-key and --tls-ca
(docs/security.md):

  DIR/ca.pem        the authority's certificate: every node's --tls-ca
  DIR/ca-key.pem    the authority's key (mode 0600): keep it offline; it issues more
  DIR/NAME.pem      node NAME's certificate (its only DNS name is NAME): --tls-cert
  DIR/NAME-key.pem  node NAME's key (mode 0600): --tls-key

A node is accepted by its peers only under NAME, the name the registry knows it
by. With --ca and --ca-key, the nodes are issued by that existing authority and
no new one is made. Existing files are never overwritten.

`

// runCerts is `kvhandoff certs`.
func runCerts(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("certs", certsUsage, stderr)
	dir := fs.String("dir", "", "directory to write the files into (required)")
	nodes := fs.String("nodes", "", "comma-separated node names, as the registry knows them (required)")
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
	if err != nil {
		fmt.Fprintln(stderr, "kvhandoff certs:", err)
		return 1
	}
	if fresh {
		fmt.Fprintf(stdout, "authority %s: %s, %s\n", *name, filepath.Join(*dir, pki.CAFile), filepath.Join(*dir, pki.CAKeyFile))
	}
	for _, n := range names {
		fmt.Fprintf(stdout, "node %s: %s, %s\n", n, filepath.Join(*dir, pki.CertFile(n)), filepath.Join(*dir, pki.KeyFile(n)))
	}
	return 0
}

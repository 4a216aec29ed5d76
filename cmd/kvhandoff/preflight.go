package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/preflight"
	"github.com/kvhandoff/kvhandoff/node"
)

// fromEtcd is the deployment the running nodes registered: each member's
// role, pool, page size, context and model, as node.Member records them.
func fromEtcd(endpoints, prefix string) (preflight.Deployment, error) {
	reg, err := node.NewEtcd(strings.Split(endpoints, ","), prefix, 5*time.Second, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		return preflight.Deployment{}, err
	}
	defer reg.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	members, err := node.Registered(ctx, reg)
	if err != nil {
		return preflight.Deployment{}, err
	}
	return node.Deployment(members), nil
}

const preflightUsage = `usage: kvhandoff preflight [flags]

Checks a deployment before it serves: every prefill or decode pool smaller than
the context length, every pair of nodes whose page size or model differs (the
check the 2026 incident lacked, docs/incident.md), then lists the machine's RDMA
devices and ports. The deployment comes from --file (YAML or JSON: context_tokens
and nodes of name, role, pool_tokens or pool_pages, page_tokens, page_bytes,
model), from --etcd (what the running nodes registered), or from the flags. Exit 0 iff no problem, 1 on any problem, 2 bad usage.

`

// runPreflight is kvhandoff preflight.
func runPreflight(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("preflight", preflightUsage, stderr)
	file := fs.String("file", "", "the deployment as YAML or JSON (instead of the flags below)")
	contextLen := fs.Int("context-len", 1024, "the context length the deployment advertises, in tokens")
	pool := fs.Int("pool-tokens", 0, "every node's KV pool in tokens (0: --prefill-pool-tokens and --decode-pool-tokens)")
	prefillPool := fs.Int("prefill-pool-tokens", 4096, "each prefill node's KV pool in tokens")
	decodePool := fs.Int("decode-pool-tokens", 4096, "each decode node's KV pool in tokens")
	prefills := fs.Int("prefills", 2, "prefill nodes")
	decodes := fs.Int("decodes", 2, "decode nodes")
	pageTokens := fs.Int("page-tokens", 16, "tokens per KV page, every node")
	modelID := fs.String("model", "kvhandoff-builtin", "the model every node serves")
	asJSON := fs.Bool("json", false, "one JSON object: ok, problems, devices")
	etcd := fs.String("etcd", "", "read the deployment from what the running nodes registered in this etcd cluster (host:port,...) instead")
	etcdPrefix := fs.String("etcd-prefix", "/kvhandoff/nodes/", "the registry's key prefix in etcd")
	if rc := parseFlags(fs, args, stderr); rc >= 0 {
		return rc
	}
	var d preflight.Deployment
	contextSet := false
	fs.Visit(func(f *flag.Flag) { contextSet = contextSet || f.Name == "context-len" })
	if *etcd != "" {
		var err error
		if d, err = fromEtcd(*etcd, *etcdPrefix); err != nil {
			fmt.Fprintf(stderr, "kvhandoff preflight: %v\n", err)
			return 2
		}
		if contextSet {
			d.ContextTokens = *contextLen // else the largest any node advertises
		}
	} else if *file != "" {
		data, err := os.ReadFile(*file)
		if err != nil {
			fmt.Fprintf(stderr, "kvhandoff preflight: %v\n", err)
			return 2
		}
		if d, err = preflight.Parse(data); err != nil {
			fmt.Fprintf(stderr, "kvhandoff preflight: %s: %v\n", *file, err)
			return 2
		}
	} else {
		if *pool > 0 {
			*prefillPool, *decodePool = *pool, *pool
		}
		if *contextLen < 1 || *prefillPool < 1 || *decodePool < 1 || *pageTokens < 1 || *prefills < 0 || *decodes < 0 {
			fmt.Fprintln(stderr, "kvhandoff preflight: sizes must be positive")
			return 2
		}
		d.ContextTokens = *contextLen
		for i := range *prefills {
			d.Nodes = append(d.Nodes, preflight.Node{Name: fmt.Sprintf("prefill-%d", i), Role: preflight.RolePrefill,
				PoolTokens: *prefillPool, PageTokens: *pageTokens, Model: *modelID})
		}
		for i := range *decodes {
			d.Nodes = append(d.Nodes, preflight.Node{Name: fmt.Sprintf("decode-%d", i), Role: preflight.RoleDecode,
				PoolTokens: *decodePool, PageTokens: *pageTokens, Model: *modelID})
		}
	}
	problems := preflight.Check(d)
	devices := preflight.Devices()
	if *asJSON {
		out := struct {
			OK            bool                `json:"ok"`
			ContextTokens int                 `json:"context_tokens"`
			Nodes         int                 `json:"nodes"`
			Problems      []preflight.Problem `json:"problems"`
			Devices       []preflight.Device  `json:"rdma_devices"`
		}{len(problems) == 0, d.Context(), len(d.Nodes), problems, devices}
		if out.Problems == nil {
			out.Problems = []preflight.Problem{}
		}
		if out.Devices == nil {
			out.Devices = []preflight.Device{}
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		enc.Encode(out)
	} else {
		fmt.Fprintf(stdout, "deployment: context %d tokens, %d nodes\n", d.Context(), len(d.Nodes))
		for _, n := range d.Nodes {
			if n.Role != preflight.RoleRouter {
				fmt.Fprintf(stdout, "  %-12s %-8s pool %d tokens, pages of %d tokens, model %s\n", n.Name, n.Role, n.Pool(), n.PageTokens, n.Model)
			}
		}
		if len(devices) == 0 {
			fmt.Fprintln(stdout, "RDMA devices: none (the in-process and socket providers need none)")
		} else {
			fmt.Fprintln(stdout, "RDMA devices:")
			for _, dev := range devices {
				if len(dev.Ports) == 0 {
					fmt.Fprintf(stdout, "  %s: no ports\n", dev.Name)
				}
				for _, p := range dev.Ports {
					fmt.Fprintf(stdout, "  %s port %s: %s (%s)\n", dev.Name, p.Port, p.State, p.Link)
				}
			}
		}
		if len(problems) == 0 {
			fmt.Fprintln(stdout, "preflight: ok")
		}
	}
	if len(problems) > 0 {
		fmt.Fprintf(stderr, "kvhandoff preflight: %d problem(s):\n", len(problems))
		for _, p := range problems {
			fmt.Fprintf(stderr, "  - %s\n", p.Message)
		}
		return 1
	}
	return 0
}

package preflight

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/Mellanox/rdmamap"
	"gopkg.in/yaml.v3"
)

// Roles of the nodes Check looks at; a router holds no KV and is not checked.
const (
	RolePrefill = "prefill"
	RoleDecode  = "decode"
	RoleRouter  = "router"
)

// Node is one node of a deployment, in the field names node.Member registers.
type Node struct {
	Name string `yaml:"name" json:"name"`
	Role string `yaml:"role" json:"role"`
	// PoolTokens is the KV pool in tokens; left 0, it is PoolPages*PageTokens.
	PoolTokens int    `yaml:"pool_tokens" json:"pool_tokens,omitempty"`
	PoolPages  int    `yaml:"pool_pages" json:"pool_pages,omitempty"`
	PageTokens int    `yaml:"page_tokens" json:"page_tokens"`
	PageBytes  int    `yaml:"page_bytes" json:"page_bytes,omitempty"` // 0: not known, not compared
	Model      string `yaml:"model" json:"model"`
	// ContextTokens is the context the node advertises; 0 means the deployment's.
	ContextTokens int `yaml:"context_tokens" json:"context_tokens,omitempty"`
}

// Pool is the node's KV pool in tokens.
func (n Node) Pool() int {
	if n.PoolTokens > 0 {
		return n.PoolTokens
	}
	return n.PoolPages * n.PageTokens
}

// Deployment is what Check checks: the context length the deployment
// advertises to clients and its nodes.
type Deployment struct {
	// ContextTokens is the advertised context; 0 means the largest any node
	// advertises.
	ContextTokens int    `yaml:"context_tokens" json:"context_tokens"`
	Nodes         []Node `yaml:"nodes" json:"nodes"`
}

// Context is the context length the deployment advertises.
func (d Deployment) Context() int {
	if d.ContextTokens > 0 {
		return d.ContextTokens
	}
	c := 0
	for _, n := range d.Nodes {
		c = max(c, n.ContextTokens)
	}
	return c
}

// ErrDeployment is a description that cannot be checked (malformed, or a
// node without a name or role).
var ErrDeployment = errors.New("preflight: bad deployment description")

// Parse reads a deployment in YAML or JSON (JSON is YAML). Unknown fields
// are an error: a misspelt pool_tokens must not pass as a missing one.
func Parse(data []byte) (Deployment, error) {
	var d Deployment
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&d); err != nil {
		return d, fmt.Errorf("%w: %v", ErrDeployment, err)
	}
	return d, d.validate()
}

func (d Deployment) validate() error {
	if d.ContextTokens < 0 {
		return fmt.Errorf("%w: context_tokens %d", ErrDeployment, d.ContextTokens)
	}
	seen := map[string]bool{}
	for i, n := range d.Nodes {
		switch {
		case n.Name == "":
			return fmt.Errorf("%w: node %d has no name", ErrDeployment, i)
		case seen[n.Name]:
			return fmt.Errorf("%w: two nodes are named %q", ErrDeployment, n.Name)
		case n.Role != RolePrefill && n.Role != RoleDecode && n.Role != RoleRouter:
			return fmt.Errorf("%w: node %q has role %q (want prefill, decode or router)", ErrDeployment, n.Name, n.Role)
		case n.Role != RoleRouter && (n.Pool() < 1 || n.PageTokens < 1):
			return fmt.Errorf("%w: node %q has a pool of %d tokens in pages of %d tokens", ErrDeployment, n.Name, n.Pool(), n.PageTokens)
		case n.PoolTokens < 0 || n.PoolPages < 0 || n.PageBytes < 0 || n.ContextTokens < 0:
			return fmt.Errorf("%w: node %q has a negative size", ErrDeployment, n.Name)
		}
		seen[n.Name] = true
	}
	return nil
}

// Kind is what a Problem is about.
type Kind string

// The kinds of problem.
const (
	ShortPool        Kind = "short-pool"
	PageSizeMismatch Kind = "page-size-mismatch"
	ModelMismatch    Kind = "model-mismatch"
	MissingRole      Kind = "missing-role"
)

// Problem is one thing wrong with a deployment.
type Problem struct {
	Kind    Kind     `json:"kind"`
	Nodes   []string `json:"nodes"`
	Message string   `json:"message"`
}

func (p Problem) String() string { return p.Message }

// Check names every problem of d: every prefill or decode pool smaller than
// the context, every pair of KV nodes whose page size or model differs, and a
// missing role. No problem means the deployment may serve.
func Check(d Deployment) []Problem {
	var out []Problem
	ctx := d.Context()
	var kvNodes []Node
	has := map[string]bool{}
	for _, n := range d.Nodes {
		if n.Role == RoleRouter {
			continue
		}
		kvNodes = append(kvNodes, n)
		has[n.Role] = true
	}
	for _, role := range []string{RolePrefill, RoleDecode} {
		if !has[role] {
			out = append(out, Problem{Kind: MissingRole, Message: fmt.Sprintf("the deployment has no %s node", role)})
		}
	}
	if ctx == 0 {
		out = append(out, Problem{Kind: ShortPool, Message: "the deployment advertises no context length: give context_tokens (or --context-len) to check the pools against"})
	}
	for _, n := range kvNodes {
		if ctx > 0 && n.Pool() < ctx {
			out = append(out, Problem{Kind: ShortPool, Nodes: []string{n.Name}, Message: fmt.Sprintf(
				"%s pool of %s holds %s tokens, fewer than the context length of %s: a prompt of %s to %s tokens passes a router that checks the context and reaches a node that cannot hold it (the 2026 incident)",
				n.Role, n.Name, group(n.Pool()), group(ctx), group(n.Pool()+1), group(ctx))})
		}
	}
	for i, a := range kvNodes {
		for _, b := range kvNodes[i+1:] {
			if a.PageTokens != b.PageTokens || (a.PageBytes > 0 && b.PageBytes > 0 && a.PageBytes != b.PageBytes) {
				out = append(out, Problem{Kind: PageSizeMismatch, Nodes: []string{a.Name, b.Name}, Message: fmt.Sprintf(
					"page size differs: %s has pages of %s, %s of %s", a.Name, pageSize(a), b.Name, pageSize(b))})
			}
			if a.Model != b.Model {
				out = append(out, Problem{Kind: ModelMismatch, Nodes: []string{a.Name, b.Name}, Message: fmt.Sprintf(
					"model differs: %s serves %q, %s serves %q", a.Name, a.Model, b.Name, b.Model)})
			}
		}
	}
	return out
}

func pageSize(n Node) string {
	s := fmt.Sprintf("%d tokens", n.PageTokens)
	if n.PageBytes > 0 {
		s += fmt.Sprintf(" (%s bytes)", group(n.PageBytes))
	}
	return s
}

// group writes n with thousands separators: pool sizes are read by people.
func group(n int) string {
	s := strconv.Itoa(n)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// Port is one port of an RDMA device.
type Port struct {
	Port  string `json:"port"`
	State string `json:"state"` // as sysfs says it, e.g. "4: ACTIVE"; "unknown" if unreadable
	Link  string `json:"link_layer,omitempty"`
}

// Device is an RDMA device and its ports.
type Device struct {
	Name  string `json:"name"`
	Ports []Port `json:"ports"`
}

// Devices lists the machine's RDMA devices (rdmamap, from sysfs), each port
// with its state; none on a machine without RDMA.
func Devices() []Device {
	var out []Device
	for _, name := range rdmamap.GetRdmaDeviceList() {
		d := Device{Name: name}
		ports := rdmamap.GetPorts(name)
		sort.Strings(ports)
		for _, p := range ports {
			dir := filepath.Join(rdmamap.RdmaClassDir, name, rdmamap.RdmaPortsdir, p)
			d.Ports = append(d.Ports, Port{Port: p, State: readSysfs(filepath.Join(dir, "state")), Link: readSysfs(filepath.Join(dir, "link_layer"))})
		}
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func readSysfs(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(b))
}

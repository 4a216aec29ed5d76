package node

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/kvhandoff/kvhandoff/internal/preflight"
)

// ErrWouldBreak is a node refusing to join: its record would add a problem
// to the deployment's preflight check (a pool smaller than the context
// length, a page size or a model differing from a registered node's).
var ErrWouldBreak = errors.New("node: joining would break the deployment")

// Registered is every member reg holds now (a watch's initial Joined
// events, then nothing more is waited for).
func Registered(ctx context.Context, reg Registry) ([]Member, error) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	changes, err := reg.Watch(wctx)
	if err != nil {
		return nil, err
	}
	byName := map[string]Member{}
	var order []string
	// Every registry reports its members present now before Watch returns
	// (buffered), so reading until the channel is empty reads them all.
	for {
		select {
		case c, ok := <-changes:
			if !ok {
				return members(byName, order), nil
			}
			switch c.Kind {
			case Joined:
				if _, seen := byName[c.Member.Name]; !seen {
					order = append(order, c.Member.Name)
				}
				byName[c.Member.Name] = c.Member
			case Lost:
				delete(byName, c.Member.Name)
			}
			continue
		default:
		}
		return members(byName, order), nil
	}
}

func members(byName map[string]Member, order []string) []Member {
	var out []Member
	for _, n := range order {
		if m, ok := byName[n]; ok {
			out = append(out, m)
		}
	}
	return out
}

// Deployment is members as internal/preflight checks them; the context
// length is the largest any member advertises.
func Deployment(members []Member) preflight.Deployment {
	var d preflight.Deployment
	for _, m := range members {
		d.Nodes = append(d.Nodes, preflight.Node{Name: m.Name, Role: string(m.Role), PoolPages: m.PoolPages, PageTokens: m.PageTokens,
			PageBytes: m.PageBytes, Model: m.Model, ContextTokens: m.ContextTokens})
	}
	return d
}

// CheckJoin is the start-up check of kvhandoff serve: it reads what reg
// holds now, adds self (in place of a record of the same name: a node
// restarting before its old lease expired), and runs preflight.Check on the
// deployment without self and with it. A problem that only the deployment
// with self has is one self would cause: CheckJoin then returns an error
// matching ErrWouldBreak that names each such problem. Problems the
// deployment already had are not self's to refuse on.
//
// CheckJoin only reads: another node may register between it and self's
// own registration. Join closes that gap where the registry can.
func CheckJoin(ctx context.Context, reg Registry, self Member) error {
	if err := self.validate(); err != nil {
		return err
	}
	if self.Role == RoleRouter {
		return nil // a router holds no KV
	}
	held, err := Registered(ctx, reg)
	if err != nil {
		return fmt.Errorf("node: reading the registry before joining: %w", err)
	}
	return joinProblems(held, self)
}

// checkedRegistry is a registry that can put a record on the condition
// that a check of what it holds passes and still holds when the record is
// put (Etcd).
type checkedRegistry interface {
	RegisterChecked(ctx context.Context, m Member, check func(held []Member) error) (<-chan struct{}, error)
}

// ErrPeersUnanswered is Join refusing to start in a static deployment: a
// listed peer did not answer, so the join check could not cover it.
var ErrPeersUnanswered = errors.New("node: listed peers did not answer")

// Join registers self in reg, as Registry.Register; with check, only if
// CheckJoin's check passes. In etcd the check and the put are one
// transaction (Etcd.RegisterChecked): two nodes that would conflict,
// joining at once, cannot both pass. In a PeerList (static --peers) it
// first waits up to JoinWait for every listed peer to answer, so that the
// check covers them all, and fails with ErrPeersUnanswered naming those
// that did not. Call it once the node's control API answers: its peers
// read its record there. Other registries run CheckJoin, then Register (in
// a Static registry every member is one process's).
func Join(ctx context.Context, reg Registry, self Member, check bool) (<-chan struct{}, error) {
	if !check || self.Role == RoleRouter {
		return reg.Register(ctx, self)
	}
	if err := self.validate(); err != nil {
		return nil, err
	}
	if cr, ok := reg.(checkedRegistry); ok {
		return cr.RegisterChecked(ctx, self, func(held []Member) error { return joinProblems(held, self) })
	}
	if pl, ok := reg.(*PeerList); ok {
		wctx, cancel := context.WithTimeout(ctx, pl.JoinWait)
		missing := pl.awaitPeers(wctx)
		cancel()
		if len(missing) > 0 {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			var names []string
			for _, p := range missing {
				names = append(names, p.Name+" ("+p.Control+")")
			}
			return nil, fmt.Errorf("%w: %s did not answer within %v, so joining could not be checked against them", ErrPeersUnanswered, strings.Join(names, ", "), pl.JoinWait)
		}
	}
	if err := CheckJoin(ctx, reg, self); err != nil {
		return nil, err
	}
	return reg.Register(ctx, self)
}

// joinProblems is CheckJoin's judgement of self against the members held.
func joinProblems(held []Member, self Member) error {
	var others []Member
	for _, m := range held {
		if m.Name != self.Name {
			others = append(others, m)
		}
	}
	before := map[string]bool{}
	for _, p := range preflight.Check(Deployment(others)) {
		before[string(p.Kind)+"\x00"+p.Message] = true
	}
	var added []string
	for _, p := range preflight.Check(Deployment(append(others, self))) {
		if !before[string(p.Kind)+"\x00"+p.Message] {
			added = append(added, p.Message)
		}
	}
	if len(added) > 0 {
		return fmt.Errorf("%w: %s would add %d problem(s): %s", ErrWouldBreak, self.Name, len(added), strings.Join(added, "; "))
	}
	return nil
}

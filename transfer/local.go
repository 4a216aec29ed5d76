package transfer

import (
	"crypto/rand"
	"errors"
	"fmt"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// ConnectLocal connects a queue pair between two endpoints of one process
// without an out-of-band exchange: each side learns the other's connection
// info and limits directly, as Dial and Serve would tell them. For tests and
// benchmarks; nodes in their own processes use Dial and Serve. prefillName
// and decodeName are the names each side will know the other by.
func ConnectLocal(p *Prefill, prefillName string, d *Decode, decodeName string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if p.cfg.PageTokens != d.cfg.PageTokens || p.cfg.PageBytes != d.cfg.PageBytes {
		return fmt.Errorf("%w: pages of %d tokens, %d bytes on prefill, %d tokens, %d bytes on decode",
			ErrSetup, p.cfg.PageTokens, p.cfg.PageBytes, d.cfg.PageTokens, d.cfg.PageBytes)
	}
	cp, err := p.newConn(decodeName, min(d.cfg.MaxRequestPages, p.cfg.MaxRequestPages))
	if err != nil {
		return err
	}
	cd, err := d.newConn(prefillName, min(d.cfg.MaxRequestPages, p.cfg.MaxRequestPages))
	if err != nil {
		p.cut(cp, err)
		return err
	}
	// No exchange, so no handshake to derive the tag key from: a fresh secret
	// both sides are given.
	secret := make([]byte, protocol.TagKeySecretSize)
	rand.Read(secret)
	key, err := protocol.NewTagKey(secret, protocol.SumXXH3)
	if err != nil {
		p.cut(cp, err)
		d.cut(cd, err)
		return err
	}
	cp.tagKey, cd.tagKey = key, key
	if err := errors.Join(cd.qp.Connect(cp.qp.Info()), cp.qp.Connect(cd.qp.Info())); err != nil {
		p.cut(cp, err)
		d.cut(cd, err)
		return err
	}
	d.goLive(cd)
	p.goLive(cp)
	return nil
}

// Package admission holds the connections a listener has accepted but not
// yet authenticated (their TLS handshake and hello), at most a fixed number
// at once, and decides which to drop when a new one arrives and the table is
// full, so that a flood of idle connections from one source cannot evict the
// handshake of a peer at another source.
//
// The policy: connections are grouped by source (the remote IPv4 address, the
// /64 prefix of a remote IPv6 address; every connection over another network,
// a Unix socket say, is one source). When the table is full, the newcomer is
// admitted and one connection is dropped: a silent one (no byte of its
// handshake read yet) before one that has spoken; among those, the oldest of
// the source that holds the most, counting the newcomer with its source;
// between sources that hold as many, the oldest connection goes. So a flood
// of connections that never send a byte, from any number of addresses,
// evicts only its own once the genuine peer's handshake has begun; and a
// source loses a speaking handshake to a newcomer from another source only
// while it holds more than that source does: an attacker dialling from one
// address, even sending a byte on each, evicts only its own connections,
// however fast it dials. It does not stop an attacker that speaks from as many
// source addresses as the table has room for: those hold one place each, and
// then the oldest goes, genuine or not (each connection still lasts at most
// its handshake deadline, which the caller sets); nor a flood that catches a
// genuine connection in the moment between its accept and its first byte.
//
// The usage loop of a listener:
//
//	t := admission.New(128)
//	for {
//		conn, _ := ln.Accept()
//		watched, ok := t.Admit(conn)
//		if !ok { // closed
//			conn.Close()
//			continue
//		}
//		go func() {
//			conn.SetDeadline(time.Now().Add(handshakeTimeout))
//			// ... handshake and hello, reading watched ...
//			if !t.Done(conn) {
//				// evicted meanwhile: conn is closed; drop it
//			}
//		}()
//	}
package admission

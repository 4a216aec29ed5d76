package admission

import (
	"fmt"
	"net"
	"testing"
)

// fakeConn is a connection from addr that records whether it was closed.
type fakeConn struct {
	net.Conn
	addr   net.Addr
	closed bool
}

func (c *fakeConn) RemoteAddr() net.Addr { return c.addr }
func (c *fakeConn) Close() error         { c.closed = true; return nil }
func (c *fakeConn) Read(p []byte) (int, error) {
	p[0] = 0x16 // a TLS record's first byte
	return 1, nil
}

func from(ip string, port int) *fakeConn {
	return &fakeConn{addr: &net.TCPAddr{IP: net.ParseIP(ip), Port: port}}
}

func TestFloodFromOneSourceEvictsOnlyItsOwn(t *testing.T) {
	tab := New(8)
	genuine := []*fakeConn{from("127.0.0.1", 1), from("127.0.0.1", 2)}
	for _, g := range genuine {
		tab.Admit(g)
	}
	var flood []*fakeConn
	for i := range 10000 {
		c := from("127.0.0.2", 1024+i)
		flood = append(flood, c)
		if _, ok := tab.Admit(c); !ok {
			t.Fatal("refused while open")
		}
		if tab.Len() > 8 {
			t.Fatalf("holds %d, more than 8", tab.Len())
		}
	}
	for i, g := range genuine {
		if g.closed || !tab.Done(g) {
			t.Fatalf("genuine handshake %d evicted by a one-source flood", i)
		}
	}
	// The flood churned through its own: all but the newest 6 are closed.
	for i, c := range flood {
		if want := i < len(flood)-6; c.closed != want {
			t.Fatalf("flood connection %d closed=%v, want %v", i, c.closed, want)
		}
	}
}

func TestSilentConnectionsGoBeforeOnesThatSpoke(t *testing.T) {
	tab := New(4)
	genuine := from("127.0.0.1", 1)
	w, _ := tab.Admit(genuine)
	if _, err := w.Read(make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	// An idle flood from the genuine peer's own address and from many
	// others: none of it evicts the handshake that has begun.
	for i := range 1000 {
		tab.Admit(from("127.0.0.1", 2+i))
		tab.Admit(from(fmt.Sprintf("10.0.%d.%d", i/250, i%250+1), 1))
	}
	if genuine.closed || !tab.Done(genuine) {
		t.Fatal("an idle flood evicted a handshake that had spoken")
	}
}

func TestNewcomerFromAnotherSourceEvictsTheHeaviestSourcesOldest(t *testing.T) {
	tab := New(4)
	a1, b1, b2, b3 := from("10.0.0.1", 1), from("10.0.0.2", 1), from("10.0.0.2", 2), from("10.0.0.2", 3)
	for _, c := range []*fakeConn{a1, b1, b2, b3} {
		tab.Admit(c)
	}
	tab.Admit(from("10.0.0.3", 1))
	if !b1.closed || a1.closed || b2.closed {
		t.Fatalf("want b1 (the heaviest source's oldest) evicted; a1 %v b1 %v b2 %v", a1.closed, b1.closed, b2.closed)
	}
}

func TestEqualSourcesLoseTheOldestConnection(t *testing.T) {
	tab := New(3)
	cs := []*fakeConn{from("10.0.0.1", 1), from("10.0.0.2", 1), from("10.0.0.3", 1)}
	for _, c := range cs {
		tab.Admit(c)
	}
	tab.Admit(from("10.0.0.4", 1))
	if !cs[0].closed || cs[1].closed || cs[2].closed {
		t.Fatalf("want the oldest evicted among equal sources: %v %v %v", cs[0].closed, cs[1].closed, cs[2].closed)
	}
}

func TestASourceLosesToAnotherOnlyWhileItHoldsMore(t *testing.T) {
	// a holds 2, b holds 1: a newcomer from b counts 2, as many as a, so
	// the oldest of the two goes (a's first); a newcomer from b when a holds
	// 1 and b 2 evicts b's own oldest.
	tab := New(3)
	a1, a2, b1 := from("10.0.0.1", 1), from("10.0.0.1", 2), from("10.0.0.2", 1)
	for _, c := range []*fakeConn{a1, b1, a2} {
		tab.Admit(c)
	}
	b2 := from("10.0.0.2", 2)
	tab.Admit(b2)
	if !a1.closed || b1.closed {
		t.Fatalf("a1 %v b1 %v: want a1 evicted", a1.closed, b1.closed)
	}
	tab.Admit(from("10.0.0.2", 3))
	if !b1.closed || a2.closed {
		t.Fatalf("b1 %v a2 %v: want b's own oldest evicted", b1.closed, a2.closed)
	}
}

func TestDoneReportsEvictionAndIsIdempotent(t *testing.T) {
	tab := New(1)
	c1, c2 := from("10.0.0.1", 1), from("10.0.0.1", 2)
	tab.Admit(c1)
	tab.Admit(c2)
	if tab.Done(c1) {
		t.Fatal("Done of an evicted connection reported true")
	}
	if !tab.Done(c2) || tab.Done(c2) {
		t.Fatal("Done: want true once, then false")
	}
	if tab.Len() != 0 {
		t.Fatalf("holds %d after Done", tab.Len())
	}
}

func TestCloseClosesTheHeldAndRefusesNew(t *testing.T) {
	tab := New(4)
	c := from("10.0.0.1", 1)
	tab.Admit(c)
	tab.Close()
	if !c.closed || tab.Len() != 0 {
		t.Fatal("Close left a connection open")
	}
	if _, ok := tab.Admit(from("10.0.0.1", 2)); ok {
		t.Fatal("admitted after Close")
	}
}

func TestSourceGroupsByAddressNotPort(t *testing.T) {
	for _, c := range []struct {
		addr net.Addr
		want string
	}{
		{&net.TCPAddr{IP: net.ParseIP("127.0.0.1"), Port: 5}, "127.0.0.1"},
		{&net.TCPAddr{IP: net.ParseIP("::ffff:127.0.0.1"), Port: 6}, "127.0.0.1"},
		{&net.TCPAddr{IP: net.ParseIP("2001:db8:1:2:3:4:5:6"), Port: 7}, "2001:db8:1:2::/64"},
		{&net.TCPAddr{IP: net.ParseIP("2001:db8:1:2:ffff::1"), Port: 8}, "2001:db8:1:2::/64"},
		{&net.UnixAddr{Name: "@", Net: "unix"}, "unix"},
		{nil, ""},
	} {
		if got := Source(c.addr); got != c.want {
			t.Errorf("Source(%v) = %q, want %q", c.addr, got, c.want)
		}
	}
}

func ExampleSource() {
	fmt.Println(Source(&net.TCPAddr{IP: net.ParseIP("192.0.2.7"), Port: 40000}))
	// Output: 192.0.2.7
}

package demo

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// portPicker hands out the loopback addresses that the serve processes are
// told to listen on (their static --peers need them before any starts).
//
// Listening on port 0 and closing, the obvious way, lets the kernel pick
// from its ephemeral range, independently each time: two picks of one run
// can be the same port (the demo's start-up flake: docs/demo.md), and a
// connection's source port comes from the same range. Either way the second
// process to bind the port exits with "address already in use". So the
// picker draws outside the ephemeral range, where only an explicit bind
// takes a port, checks each port free when it draws it, and never hands a
// port out twice.
type portPicker struct {
	ranges [][2]int // the ranges drawn from, each [lo, hi)
	used   map[int]bool
	rng    *rand.Rand
}

// portFloor is the lowest port drawn: clear of the well-known and most
// registered services' ports.
const portFloor = 10000

// newPortPicker reads the kernel's ephemeral range and draws outside it.
// Its seed is not the demo's, so that two runs at once with the same --seed
// draw different ports (at random: with the demo's 15 ports, two runs at
// once share one about 1 time in 100, and the second to start then fails
// with the node that could not bind, by name).
func newPortPicker() *portPicker {
	lo, hi := ephemeralRange()
	p := &portPicker{used: map[int]bool{}, rng: rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))}
	for _, r := range [][2]int{{portFloor, lo}, {hi + 1, 65536}} {
		if r[1] > r[0] {
			p.ranges = append(p.ranges, r)
		}
	}
	return p
}

// ephemeralRange is the kernel's ephemeral port range: Linux's
// ip_local_port_range, or IANA's 49152–65535 (other systems, or an
// unreadable file).
func ephemeralRange() (lo, hi int) {
	const ianaLo, ianaHi = 49152, 65535
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return ianaLo, ianaHi
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return ianaLo, ianaHi
	}
	lo, err1 := strconv.Atoi(f[0])
	hi, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil || lo <= 0 || hi < lo || hi > 65535 {
		return ianaLo, ianaHi
	}
	return lo, hi
}

// errNoPort: too few ports outside the ephemeral range, or every port drawn
// was taken.
var errNoPort = errors.New("demo: no free loopback port outside the ephemeral range")

// addr returns 127.0.0.1:PORT for a port free now and not handed out before.
func (p *portPicker) addr() (string, error) {
	total := 0
	for _, r := range p.ranges {
		total += r[1] - r[0]
	}
	if total < 1000 {
		return "", fmt.Errorf("%w: %d ports there (ip_local_port_range)", errNoPort, total)
	}
	for range 200 {
		n := p.rng.IntN(total)
		port := 0
		for _, r := range p.ranges {
			if n < r[1]-r[0] {
				port = r[0] + n
				break
			}
			n -= r[1] - r[0]
		}
		if p.used[port] {
			continue
		}
		a := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		ln, err := net.Listen("tcp", a)
		if err != nil {
			continue // another program's
		}
		ln.Close()
		p.used[port] = true
		return a, nil
	}
	return "", errNoPort
}

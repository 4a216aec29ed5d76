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
// can be the same port (about 1 run in 100 with the demo's 17 addresses),
// and a connection's source port comes from the same range. Either way the
// second process to bind exits with "address already in use", and the
// deployment never comes up. So the picker draws from below the ephemeral
// range, where only an explicit bind takes a port, checks each port free
// when it draws it, and never hands a port out twice.
type portPicker struct {
	lo, hi int // the range drawn from, [lo, hi)
	used   map[int]bool
	rng    *rand.Rand
}

// portFloor is the lowest port drawn: clear of the well-known and most
// registered services' ports.
const portFloor = 10000

// newPortPicker reads the kernel's ephemeral range and draws below it. Its
// seed is not the demo's: two runs at once with the same --seed must not
// draw the same ports.
func newPortPicker() *portPicker {
	return &portPicker{lo: portFloor, hi: ephemeralLow(), used: map[int]bool{}, rng: rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))}
}

// ephemeralLow is the first port of the kernel's ephemeral range: Linux's
// ip_local_port_range, or IANA's 49152 (other systems, or an unreadable
// file).
func ephemeralLow() int {
	const iana = 49152
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return iana
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return iana
	}
	lo, err := strconv.Atoi(f[0])
	if err != nil || lo <= 0 {
		return iana
	}
	return lo
}

// errNoPort: the range is too narrow, or every port drawn was taken.
var errNoPort = errors.New("demo: no free loopback port below the ephemeral range")

// addr returns 127.0.0.1:PORT for a port free now and not handed out before.
func (p *portPicker) addr() (string, error) {
	if p.hi-p.lo < 1000 {
		return "", fmt.Errorf("%w: the ephemeral range starts at %d", errNoPort, p.hi)
	}
	for range 200 {
		port := p.lo + p.rng.IntN(p.hi-p.lo)
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

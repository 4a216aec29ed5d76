// Package admissiontest floods a listener with connections that never
// handshake, from one source address, for the tests of the listeners that
// use package admission.
package admissiontest

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Flood dials addr (TCP) from the IP address source, with dialers
// goroutines each holding at most 200 of its connections open and never
// sending a byte, until the returned stop is called (or each has dialled
// 200,000 times); stop waits for them, closes their connections and
// returns how many dials connected. Flood returns once the first has
// connected, so the flood is under way.
func Flood(t testing.TB, addr, source string, dialers int) (stop func() int64) {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(source)}, Timeout: time.Second}
	done := make(chan struct{})
	var dials atomic.Int64
	var wg sync.WaitGroup
	started := make(chan struct{})
	var once sync.Once
	for range dialers {
		wg.Go(func() {
			var held []net.Conn
			defer func() {
				for _, c := range held {
					c.Close()
				}
			}()
			for range 200000 {
				select {
				case <-done:
					return
				default:
				}
				c, err := d.Dial("tcp", addr)
				if err != nil {
					continue
				}
				dials.Add(1)
				once.Do(func() { close(started) })
				held = append(held, c)
				if len(held) > 200 {
					held[0].Close()
					held = held[1:]
				}
			}
		})
	}
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		close(done)
		wg.Wait()
		t.Fatalf("the flood from %s never connected to %s", source, addr)
	}
	var stopOnce sync.Once
	stop = func() int64 {
		stopOnce.Do(func() { close(done); wg.Wait() })
		return dials.Load()
	}
	t.Cleanup(func() { stop() })
	return stop
}

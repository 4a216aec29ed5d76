//go:build verbs

package verbs

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// IBWriteBW runs perftest's ib_write_bw on device d as server and client on
// the same host (out-of-band exchange over TCP on loopback), with size-byte
// messages, iters of them, and returns the client's average bandwidth in
// bytes per second: the baseline the verbs provider is measured against.
//
// ib_write_bw prints its average with two decimals in Gbit/s, so a short run
// on a slow emulated device (Soft-RoCE under QEMU on a loaded host) can read
// 0.00: a baseline no ratio can be taken against. Such a run is repeated with
// four times the messages, twice at most (three runs), before it is an error.
func IBWriteBW(d *Device, size, iters int) (float64, error) {
	iters = max(iters, 5)
	for try := 0; ; try++ {
		bw, err := ibWriteBW(d, size, iters)
		if err != nil || bw > 0 {
			return bw, err
		}
		if try == 2 {
			return 0, fmt.Errorf("verbs: ib_write_bw averaged 0.00 Gbit/s for %d-byte messages over %d of them, three times", size, iters)
		}
		iters *= 4
	}
}

func ibWriteBW(d *Device, size, iters int) (float64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	args := []string{"-d", d.name, "-x", strconv.Itoa(d.gidIndex), "-s", strconv.Itoa(size), "-n", strconv.Itoa(iters),
		"-F", "--report_gbits", "-p", "18515"}
	var serverOut bytes.Buffer
	server := exec.CommandContext(ctx, "ib_write_bw", args...)
	server.Stdout, server.Stderr = &serverOut, &serverOut
	if err := server.Start(); err != nil {
		return 0, fmt.Errorf("verbs: ib_write_bw: %w", err)
	}
	defer server.Wait()
	defer server.Process.Kill()
	var out []byte
	var err error
	for try := 0; try < 50; try++ { // the server needs a moment to listen
		time.Sleep(100 * time.Millisecond)
		out, err = exec.CommandContext(ctx, "ib_write_bw", append(args, "127.0.0.1")...).CombinedOutput()
		if err == nil {
			break
		}
	}
	if err != nil {
		return 0, fmt.Errorf("verbs: ib_write_bw client: %v\n%s\nserver:\n%s", err, out, serverOut.String())
	}
	return parseIBWriteBW(out, size)
}

// parseIBWriteBW finds the result row of ib_write_bw --report_gbits:
// "#bytes #iterations BW peak[Gb/sec] BW average[Gb/sec] MsgRate[Mpps]".
func parseIBWriteBW(out []byte, size int) (float64, error) {
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 4 && f[0] == strconv.Itoa(size) {
			gbps, err := strconv.ParseFloat(f[3], 64)
			if err != nil {
				return 0, fmt.Errorf("verbs: ib_write_bw row %q: %w", sc.Text(), err)
			}
			return gbps * 1e9 / 8, nil
		}
	}
	return 0, fmt.Errorf("verbs: no result row for %d bytes in ib_write_bw's output:\n%s", size, out)
}

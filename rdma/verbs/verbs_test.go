//go:build verbs

package verbs

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/rdmatest"
)

var _ rdma.Faults = (*QP)(nil)

// open opens the first RDMA device, twice over the test: two contexts, as two
// nodes would have. Without a device the test skips, unless KVH_VERBS_REQUIRED
// is set (the Soft-RoCE VM sets it), where a missing device is a failure.
func open(t *testing.T) *Device {
	t.Helper()
	d, err := Open(os.Getenv("KVH_VERBS_DEVICE"))
	if err != nil {
		if os.Getenv("KVH_VERBS_REQUIRED") != "" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func pair(t *testing.T) *rdmatest.Pair { return rdmatest.NewPair(t, open(t), open(t)) }

// TestConformance holds the device to the suite. Soft-RoCE (rxe, as the VM
// names it) is held to its one known deviation: its windows open their whole
// region to the bound queue pair's peer (docs/transport.md). Every other
// device is held to the full window semantics: passing is what puts its
// driver on rangeCheckingDrivers; the provider itself trusts no device name.
func TestConformance(t *testing.T) {
	d := open(t)
	rdmatest.RunOptions(t, pair, rdmatest.Options{WindowRangesUnchecked: strings.HasPrefix(d.Name(), "rxe") && !rangeCheckingDrivers[d.driver]})
}

// TestWindowRangesUncheckedUnlessTheDriverIsAllowListed: whatever a device
// is called, its windows count as unchecked (one window per page, on the
// page's own registration, in transfer.Decode) unless its kernel driver is
// on the allow-list; an rxe device renamed to look like a NIC gets no
// run-wide windows.
func TestWindowRangesUncheckedUnlessTheDriverIsAllowListed(t *testing.T) {
	for _, d := range []*Device{
		{name: "rxe0"},
		{name: "mlx5_0", driver: ""},        // rxe renamed: no parent device
		{name: "roce0", driver: "rdma_rxe"}, // however sysfs names it
		{name: "mlx5_0", driver: "mlx5_core"},
	} {
		if !(&pd{d: d}).WindowRangesUnchecked() {
			t.Errorf("device %q (driver %q), on no allow-list, reports checked window ranges", d.name, d.driver)
		}
	}
	rangeCheckingDrivers["test_driver"] = true
	defer delete(rangeCheckingDrivers, "test_driver")
	if (&pd{d: &Device{name: "rxe0", driver: "test_driver"}}).WindowRangesUnchecked() {
		t.Error("an allow-listed driver reports unchecked window ranges")
	}
}

func TestDeviceListingPortAndCounters(t *testing.T) {
	d := open(t)
	found := false
	for _, name := range Devices() {
		found = found || name == d.Name()
	}
	if !found {
		t.Fatalf("rdmamap lists %v, not the open device %s", Devices(), d.Name())
	}
	if st, active, err := d.PortState(); err != nil || !active {
		t.Fatalf("port state %q, %v", st, err)
	}
	gid := d.gid
	if gid[10] != 0xff || gid[11] != 0xff {
		t.Fatalf("GID %x at index %d is not IPv4-mapped (RoCE v2)", gid, d.GIDIndex())
	}
	before, err := d.Counters()
	if err != nil || len(before) == 0 {
		t.Fatalf("counters %v, %v", before, err)
	}
	x := pair(t)
	src, _ := x.PDA.Alloc(1<<16, rdma.LocalWrite)
	dst, _ := x.PDB.Alloc(1<<16, rdma.LocalWrite|rdma.RemoteWrite)
	if err := x.A.PostSend(rdma.WorkRequest{ID: 1, Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: 1 << 16}, RemoteAddr: dst.Addr(), RKey: dst.RKey()}); err != nil {
		t.Fatal(err)
	}
	if c := x.ASend.Wait(1, 10e9); len(c) != 1 || c[0].Status != rdma.Success {
		t.Fatalf("WRITE: %+v", c)
	}
	// The kernel caches a port's hw_counters for their "lifespan" (about
	// 10 ms), so a read right after the WRITE may still show the old values:
	// read again until one moves, with a generous bound.
	var after map[string]uint64
	moved := false
	for deadline := time.Now().Add(5 * time.Second); !moved && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
		after, _ = d.Counters()
		for name, v := range after {
			moved = moved || v > before[name]
		}
	}
	if !moved {
		t.Fatalf("no counter moved within 5 s of a 64 KiB WRITE: %v", after)
	}
	t.Logf("device %s, GID index %d, %d counters", d.Name(), d.GIDIndex(), len(after))
}

func TestParseIBWriteBWFindsTheAverageOfItsSizeRow(t *testing.T) {
	out := []byte(`
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 65536      200              0.45               0.40 		   0.000763
---------------------------------------------------------------------------------------
`)
	got, err := parseIBWriteBW(out, 65536)
	if err != nil || got != 0.40e9/8 {
		t.Fatalf("got %v, %v; want 5e7 bytes/s", got, err)
	}
	if _, err := parseIBWriteBW(out, 4096); err == nil {
		t.Fatal("a missing row must be an error, not a zero baseline")
	}
}

// The parts of the hostile-peer suite a NIC answers for: wrapped and
// out-of-range addresses and lengths, unknown keys, overflowing local
// buffers. A NIC's keys are not secrets and it has no identities
// (docs/security.md), so those parts do not apply.
func TestHostilePeers(t *testing.T) {
	rdmatest.RunHostile(t, rdmatest.Hostile{Devices: func(t *testing.T) (rdma.Device, rdma.Device) { return open(t), open(t) }})
}

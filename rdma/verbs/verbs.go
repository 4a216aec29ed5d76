//go:build verbs

package verbs

/*
#cgo LDFLAGS: -libverbs
#include <infiniband/verbs.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>

// ibv_query_port is a macro and ibv_post_send, ibv_post_recv, ibv_poll_cq and
// ibv_req_notify_cq are static inline: cgo reaches them through these.

static int kvh_query_port(struct ibv_context *c, uint8_t port, struct ibv_port_attr *a) {
	return ibv_query_port(c, port, a);
}

// kvh_pick_gid scans the GID table for an IPv4-mapped GID (RoCE v2), falling
// back to the first non-zero one; it returns the index or -1.
static int kvh_pick_gid(struct ibv_context *c, uint8_t port, int len, union ibv_gid *out) {
	int fallback = -1;
	for (int i = 0; i < len && i < 256; i++) {
		union ibv_gid g;
		if (ibv_query_gid(c, port, i, &g)) continue;
		int zero = 1;
		for (int k = 0; k < 16; k++) if (g.raw[k]) { zero = 0; break; }
		if (zero) continue;
		int mapped = 1;
		for (int k = 0; k < 10; k++) if (g.raw[k]) { mapped = 0; break; }
		if (mapped && g.raw[10] == 0xff && g.raw[11] == 0xff) { *out = g; return i; }
		if (fallback < 0) { fallback = i; *out = g; }
	}
	return fallback;
}

static struct ibv_qp *kvh_create_qp(struct ibv_pd *pd, struct ibv_cq *scq, struct ibv_cq *rcq, uint32_t depth) {
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof a);
	a.send_cq = scq; a.recv_cq = rcq; a.qp_type = IBV_QPT_RC;
	a.cap.max_send_wr = depth; a.cap.max_recv_wr = depth;
	a.cap.max_send_sge = 1; a.cap.max_recv_sge = 1;
	return ibv_create_qp(pd, &a);
}

static int kvh_to_init(struct ibv_qp *qp, uint8_t port) {
	struct ibv_qp_attr a; memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_INIT; a.pkey_index = 0; a.port_num = port;
	a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

static int kvh_to_rtr(struct ibv_qp *qp, uint8_t port, enum ibv_mtu mtu, uint32_t dqpn, uint32_t rq_psn,
                      const uint8_t *dgid, uint16_t dlid, int sgid_idx) {
	struct ibv_qp_attr a; memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR; a.path_mtu = mtu; a.dest_qp_num = dqpn; a.rq_psn = rq_psn;
	a.max_dest_rd_atomic = 1; a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1; memcpy(a.ah_attr.grh.dgid.raw, dgid, 16); a.ah_attr.grh.sgid_index = sgid_idx;
	a.ah_attr.grh.hop_limit = 64; a.ah_attr.dlid = dlid; a.ah_attr.port_num = port; a.ah_attr.sl = 0;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
		IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

// retry_cnt is 6, not 7: rxe (and some NICs) read 7 as "retry forever", and a
// requester whose responder was fenced must fail in bounded time: 7 tries of
// 4.096 us * 2^14 = 67 ms each, about half a second.
static int kvh_to_rts(struct ibv_qp *qp, uint32_t sq_psn) {
	struct ibv_qp_attr a; memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTS; a.timeout = 14; a.retry_cnt = 6; a.rnr_retry = 7; a.sq_psn = sq_psn; a.max_rd_atomic = 1;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
		IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

static int kvh_to_error(struct ibv_qp *qp) {
	struct ibv_qp_attr a; memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_ERR;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

static int kvh_qp_state(struct ibv_qp *qp) {
	struct ibv_qp_attr a; struct ibv_qp_init_attr i;
	if (ibv_query_qp(qp, &a, IBV_QP_STATE, &i)) return -1;
	return a.qp_state;
}

static int kvh_post_send(struct ibv_qp *qp, uint64_t id, int opcode, uint32_t imm,
                         uint64_t addr, uint32_t len, uint32_t lkey, uint64_t raddr, uint32_t rkey) {
	struct ibv_sge s = { .addr = addr, .length = len, .lkey = lkey };
	struct ibv_send_wr wr, *bad; memset(&wr, 0, sizeof wr);
	wr.wr_id = id; wr.sg_list = &s; wr.num_sge = len ? 1 : 0;
	wr.opcode = opcode; wr.send_flags = IBV_SEND_SIGNALED;
	wr.imm_data = htobe32(imm);
	wr.wr.rdma.remote_addr = raddr; wr.wr.rdma.rkey = rkey;
	return ibv_post_send(qp, &wr, &bad);
}

// Memory windows, type 2: bound and invalidated by work requests on the
// queue pair whose peer may use them.
static struct ibv_mw *kvh_alloc_mw(struct ibv_pd *pd) { return ibv_alloc_mw(pd, IBV_MW_TYPE_2); }
static uint32_t kvh_mw_rkey(struct ibv_mw *mw) { return mw->rkey; }

static int kvh_post_bind(struct ibv_qp *qp, uint64_t id, struct ibv_mw *mw, uint32_t rkey, struct ibv_mr *mr,
                         uint64_t addr, uint64_t len) {
	struct ibv_send_wr wr, *bad; memset(&wr, 0, sizeof wr);
	wr.wr_id = id; wr.opcode = IBV_WR_BIND_MW; wr.send_flags = IBV_SEND_SIGNALED;
	wr.bind_mw.mw = mw; wr.bind_mw.rkey = rkey;
	wr.bind_mw.bind_info.mr = mr; wr.bind_mw.bind_info.addr = addr; wr.bind_mw.bind_info.length = len;
	wr.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_WRITE;
	int rc = ibv_post_send(qp, &wr, &bad);
	// For a type-2 window the library leaves mw->rkey as it was; the next
	// bind names the window by it, and the kernel (rxe) refuses a stale one.
	if (rc == 0) mw->rkey = rkey;
	return rc;
}

static int kvh_post_inv(struct ibv_qp *qp, uint64_t id, uint32_t rkey) {
	struct ibv_send_wr wr, *bad; memset(&wr, 0, sizeof wr);
	wr.wr_id = id; wr.opcode = IBV_WR_LOCAL_INV; wr.send_flags = IBV_SEND_SIGNALED;
	wr.invalidate_rkey = rkey;
	return ibv_post_send(qp, &wr, &bad);
}

static int kvh_post_recv(struct ibv_qp *qp, uint64_t id, uint64_t addr, uint32_t len, uint32_t lkey) {
	struct ibv_sge s = { .addr = addr, .length = len, .lkey = lkey };
	struct ibv_recv_wr wr, *bad; memset(&wr, 0, sizeof wr);
	wr.wr_id = id; wr.sg_list = &s; wr.num_sge = len ? 1 : 0;
	return ibv_post_recv(qp, &wr, &bad);
}

struct kvh_wc { uint64_t id; int32_t status; int32_t opcode; uint32_t imm; uint32_t flags; uint32_t len; uint32_t qpn; };

static int kvh_poll(struct ibv_cq *cq, int max, struct kvh_wc *out) {
	struct ibv_wc wc[64];
	if (max > 64) max = 64;
	int n = ibv_poll_cq(cq, max, wc);
	for (int i = 0; i < n; i++) {
		out[i].id = wc[i].wr_id; out[i].status = wc[i].status; out[i].opcode = wc[i].opcode;
		out[i].imm = be32toh(wc[i].imm_data); out[i].flags = wc[i].wc_flags; out[i].len = wc[i].byte_len;
		out[i].qpn = wc[i].qp_num;
	}
	return n;
}

static int kvh_arm(struct ibv_cq *cq) { return ibv_req_notify_cq(cq, 0); }

static int kvh_nonblock(struct ibv_comp_channel *ch) {
	int f = fcntl(ch->fd, F_GETFL);
	return fcntl(ch->fd, F_SETFL, f | O_NONBLOCK);
}

// kvh_wait waits up to ms for the channel's event and consumes it: 1 if an
// event came, 0 on timeout, -1 on error.
static int kvh_wait(struct ibv_comp_channel *ch, int ms) {
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	int r = poll(&p, 1, ms);
	if (r <= 0) return r;
	struct ibv_cq *cq; void *ctx;
	if (ibv_get_cq_event(ch, &cq, &ctx)) return errno == EAGAIN ? 0 : -1;
	ibv_ack_cq_events(cq, 1);
	return 1;
}

static int kvh_errno(void) { return errno; }
*/
import "C"

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/Mellanox/rdmamap"

	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/internal/soft"
)

// Devices lists the RDMA devices of this host (from sysfs, through rdmamap).
func Devices() []string { return rdmamap.GetRdmaDeviceList() }

// errnoErr wraps the C errno of a failed call.
func errnoErr(what string, rc C.int) error {
	e := syscall.Errno(C.kvh_errno())
	if rc > 0 {
		e = syscall.Errno(rc) // ibv_post_* and ibv_modify_qp return the error itself
	}
	return fmt.Errorf("verbs: %s: %w", what, e)
}

// Device is an open RDMA device and its first port.
type Device struct {
	name     string
	driver   string // kernel driver, from sysfs ("" unknown)
	ctx      *C.struct_ibv_context
	port     C.uint8_t
	mtu      C.enum_ibv_mtu
	gidIndex int
	gid      [16]byte
	lid      uint16

	mu     sync.Mutex
	pds    []*pd
	cqs    []*cq
	qps    []*QP
	wrs    map[uint64]posted // work requests on the NIC, by the ID given to it
	nextWR uint64
	closed bool
}

// posted is what the provider remembers of a work request on the NIC.
type posted struct {
	id uint64
	op rdma.Opcode
}

// Open opens the device called name ("" for the first) and checks that its
// port 1 is ACTIVE.
func Open(name string) (*Device, error) {
	var n C.int
	list := C.ibv_get_device_list(&n)
	if list == nil {
		return nil, errnoErr("ibv_get_device_list", -1)
	}
	defer C.ibv_free_device_list(list)
	var dev *C.struct_ibv_device
	var names []string
	for _, x := range unsafe.Slice(list, int(n)) {
		dn := C.GoString(C.ibv_get_device_name(x))
		names = append(names, dn)
		if dev == nil && (name == "" || name == dn) {
			dev, name = x, dn
		}
	}
	if dev == nil {
		return nil, fmt.Errorf("verbs: no device %q among %v", name, names)
	}
	d := &Device{name: name, driver: driverOf(name), port: 1, wrs: map[uint64]posted{}}
	if d.ctx = C.ibv_open_device(dev); d.ctx == nil {
		return nil, errnoErr("ibv_open_device "+name, -1)
	}
	var pa C.struct_ibv_port_attr
	if rc := C.kvh_query_port(d.ctx, d.port, &pa); rc != 0 {
		C.ibv_close_device(d.ctx)
		return nil, errnoErr("ibv_query_port", rc)
	}
	if pa.state != C.IBV_PORT_ACTIVE {
		C.ibv_close_device(d.ctx)
		return nil, fmt.Errorf("verbs: %s port %d is %s, not ACTIVE", name, d.port, portState(pa.state))
	}
	d.mtu, d.lid = pa.active_mtu, uint16(pa.lid)
	var gid C.union_ibv_gid
	if d.gidIndex = int(C.kvh_pick_gid(d.ctx, d.port, C.int(pa.gid_tbl_len), &gid)); d.gidIndex < 0 {
		C.ibv_close_device(d.ctx)
		return nil, fmt.Errorf("verbs: %s has no usable GID", name)
	}
	copy(d.gid[:], C.GoBytes(unsafe.Pointer(&gid), 16))
	return d, nil
}

func portState(s C.enum_ibv_port_state) string {
	return C.GoString(C.ibv_port_state_str(s))
}

// Name implements rdma.Device.
func (d *Device) Name() string { return d.name }

// GIDIndex is the index of the GID the device's queue pairs use.
func (d *Device) GIDIndex() int { return d.gidIndex }

// PortState is the port's state as libibverbs names it ("active", ...), and
// whether it is ACTIVE.
func (d *Device) PortState() (name string, active bool, err error) {
	var pa C.struct_ibv_port_attr
	if rc := C.kvh_query_port(d.ctx, d.port, &pa); rc != 0 {
		return "", false, errnoErr("ibv_query_port", rc)
	}
	return portState(pa.state), pa.state == C.IBV_PORT_ACTIVE, nil
}

// Counters are the port's counters from sysfs (counters and hw_counters,
// through rdmamap), by name.
func (d *Device) Counters() (map[string]uint64, error) {
	out := map[string]uint64{}
	hw, errHW := rdmamap.GetRdmaSysfsHwStats(d.name, int(d.port))
	for _, e := range hw {
		out[e.Name] = e.Value
	}
	st, errSt := rdmamap.GetRdmaSysfsStats(d.name, int(d.port))
	for _, e := range st {
		out[e.Name] = e.Value
	}
	if errHW != nil && errSt != nil {
		return nil, fmt.Errorf("verbs: counters of %s: %v; %v", d.name, errHW, errSt)
	}
	return out, nil
}

// AllocPD implements rdma.Device.
func (d *Device) AllocPD() (rdma.ProtectionDomain, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("%w: device closed", rdma.ErrBadRequest)
	}
	p := C.ibv_alloc_pd(d.ctx)
	if p == nil {
		return nil, errnoErr("ibv_alloc_pd", -1)
	}
	x := &pd{d: d, pd: p}
	d.pds = append(d.pds, x)
	return x, nil
}

// CreateCQ implements rdma.Device: a completion queue with its own completion
// channel.
func (d *Device) CreateCQ(depth int) (rdma.CompletionQueue, error) {
	if depth < 1 {
		return nil, fmt.Errorf("%w: CQ depth %d", rdma.ErrBadRequest, depth)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("%w: device closed", rdma.ErrBadRequest)
	}
	ch := C.ibv_create_comp_channel(d.ctx)
	if ch == nil {
		return nil, errnoErr("ibv_create_comp_channel", -1)
	}
	if rc := C.kvh_nonblock(ch); rc < 0 {
		C.ibv_destroy_comp_channel(ch)
		return nil, errnoErr("fcntl O_NONBLOCK", rc)
	}
	c := C.ibv_create_cq(d.ctx, C.int(depth), nil, ch, 0)
	if c == nil {
		C.ibv_destroy_comp_channel(ch)
		return nil, errnoErr("ibv_create_cq", -1)
	}
	x := &cq{d: d, cq: c, ch: ch, soft: soft.New()}
	d.cqs = append(d.cqs, x)
	return x, nil
}

// Close implements rdma.Device: queue pairs to the error state, then every
// resource released in dependency order (queue pairs, completion queues,
// memory regions, protection domains, the device).
func (d *Device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	qps, cqs, pds := d.qps, d.cqs, d.pds
	d.mu.Unlock()
	for _, q := range qps {
		q.ToError()
		C.ibv_destroy_qp(q.qp)
	}
	for _, c := range cqs {
		c.mu.Lock()
		C.ibv_destroy_cq(c.cq)
		C.ibv_destroy_comp_channel(c.ch)
		c.cq, c.ch = nil, nil
		c.mu.Unlock()
	}
	for _, p := range pds {
		for _, m := range p.mrs {
			C.ibv_dereg_mr(m.mr)
			if m.mapped {
				syscall.Munmap(m.buf[:cap(m.buf)])
			}
		}
		C.ibv_dealloc_pd(p.pd)
	}
	C.ibv_close_device(d.ctx)
	return nil
}

type pd struct {
	d   *Device
	pd  *C.struct_ibv_pd
	mu  sync.Mutex
	mrs []*mr
}

type mr struct {
	pd     *pd
	mr     *C.struct_ibv_mr
	buf    []byte
	mapped bool
}

func (m *mr) Addr() uint64  { return uint64(uintptr(unsafe.Pointer(&m.buf[0]))) }
func (m *mr) Len() int      { return len(m.buf) }
func (m *mr) LKey() uint32  { return uint32(m.mr.lkey) }
func (m *mr) RKey() uint32  { return uint32(m.mr.rkey) }
func (m *mr) Bytes() []byte { return m.buf }

func access(a rdma.Access) C.int {
	var f C.int
	if a&(rdma.LocalWrite|rdma.RemoteWrite) != 0 {
		f |= C.IBV_ACCESS_LOCAL_WRITE // remote write requires local write
	}
	if a&rdma.RemoteWrite != 0 {
		f |= C.IBV_ACCESS_REMOTE_WRITE
	}
	if a&rdma.RemoteRead != 0 {
		f |= C.IBV_ACCESS_REMOTE_READ
	}
	if a&rdma.WindowBind != 0 {
		f |= C.IBV_ACCESS_MW_BIND | C.IBV_ACCESS_LOCAL_WRITE // a window's remote write requires local write
	}
	return f
}

// rangeCheckingDrivers lists the kernel drivers (sysfs device/driver) known
// to check a window key's WRITE against the window's range, not only its
// region's: none is known yet. Soft-RoCE (rdma_rxe) is known not to
// (measured on Linux 6.1 by the conformance suite in the VM). A driver joins
// the list only once the conformance suite, run on it as an unlisted driver
// (held to the full window semantics), passes.
var rangeCheckingDrivers = map[string]bool{}

// WindowRangesUnchecked implements rdma.UncheckedWindowRanges, failing
// closed: every device's windows count as opening their whole region unless
// its driver is on rangeCheckingDrivers. Never by device name: an rxe device
// can be called anything, and a device wrongly trusted here would get
// run-wide windows that open the whole pool.
func (p *pd) WindowRangesUnchecked() bool { return !rangeCheckingDrivers[p.d.driver] }

// driverOf names the kernel driver bound to RDMA device name, from sysfs;
// "" where there is none to read (Soft-RoCE and soft-iWARP have no parent
// device), which no allow-list names.
func driverOf(name string) string {
	link, err := os.Readlink(filepath.Join("/sys/class/infiniband", name, "device", "driver"))
	if err != nil {
		return ""
	}
	return filepath.Base(link)
}

// AllocWindow implements rdma.WindowDomain: ibv_alloc_mw, type 2.
func (p *pd) AllocWindow() (rdma.MemoryWindow, error) {
	mw := C.kvh_alloc_mw(p.pd)
	if mw == nil {
		return nil, errnoErr("ibv_alloc_mw (type 2)", -1)
	}
	return &window{pd: p, mw: mw, key: uint32(C.kvh_mw_rkey(mw))}, nil
}

// window is a type-2 memory window. Its key's upper 24 bits are the NIC's
// index of the window; the lower 8 are the consumer's, drawn from
// crypto/rand on every bind (different from the key before): all the
// randomness verbs allows.
type window struct {
	pd     *pd
	mu     sync.Mutex
	mw     *C.struct_ibv_mw
	key    uint32
	closed bool
}

// RKey implements rdma.MemoryWindow.
func (w *window) RKey() uint32 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.key
}

// Close implements rdma.MemoryWindow: ibv_dealloc_mw, which invalidates a
// bound window before it returns.
func (w *window) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil
	}
	w.closed = true
	if rc := C.ibv_dealloc_mw(w.mw); rc != 0 {
		return errnoErr("ibv_dealloc_mw", rc)
	}
	return nil
}

// chooseKey draws the key wr (a bind of w) will bind under, when it is
// posted, even if it is held (Pause) before it reaches the NIC: RKey reports
// it at once, and the held bind carries it in wr.RKey.
func (w *window) chooseKey(wr *rdma.WorkRequest) {
	w.mu.Lock()
	defer w.mu.Unlock()
	key := w.key
	for key&0xFF == w.key&0xFF {
		key = w.key&^0xFF | soft.Random32()&0xFF
	}
	w.key, wr.RKey = key, key
}

// postWindowLocked posts a bind (under the key chooseKey drew) or an
// invalidate of wr's window; the caller holds q.mu.
func (q *QP) postWindowLocked(wr rdma.WorkRequest) error {
	w := wr.Window.(*window) // checked by PostSend
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return fmt.Errorf("%w: window closed", rdma.ErrBadRequest)
	}
	id := q.d.remember(wr.ID, wr.Op)
	if wr.Op == rdma.OpInvalidate {
		// The key the NIC holds now: that of the last bind posted.
		return q.d.posted(id, "ibv_post_send (LOCAL_INV)", C.kvh_post_inv(q.qp, C.uint64_t(id), C.kvh_mw_rkey(w.mw)))
	}
	m, _ := q.checkLocal(wr.Local)
	rc := C.kvh_post_bind(q.qp, C.uint64_t(id), w.mw, C.uint32_t(wr.RKey), m.mr, C.uint64_t(m.Addr()+uint64(wr.Local.Offset)), C.uint64_t(wr.Local.Length))
	return q.d.posted(id, "ibv_post_send (BIND_MW)", rc)
}

// Alloc implements rdma.ProtectionDomain with anonymous mmap'd memory, which
// the Go collector never sees or moves.
func (p *pd) Alloc(size int, a rdma.Access) (rdma.MemoryRegion, error) {
	if size <= 0 {
		return nil, fmt.Errorf("%w: region of %d bytes", rdma.ErrBadRequest, size)
	}
	pageSize := syscall.Getpagesize()
	buf, err := syscall.Mmap(-1, 0, (size+pageSize-1)/pageSize*pageSize, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return nil, fmt.Errorf("verbs: mmap %d bytes: %w", size, err)
	}
	m, err := p.register(buf[:size], a)
	if err != nil {
		syscall.Munmap(buf)
		return nil, err
	}
	m.mapped = true
	return m, nil
}

// Register implements rdma.ProtectionDomain. buf must lie outside the Go heap
// (mmap'd, C or device memory): the NIC keeps writing it after this returns.
func (p *pd) Register(buf []byte, a rdma.Access) (rdma.MemoryRegion, error) {
	if len(buf) == 0 {
		return nil, fmt.Errorf("%w: empty region", rdma.ErrBadRequest)
	}
	return p.register(buf, a)
}

func (p *pd) register(buf []byte, a rdma.Access) (*mr, error) {
	r := C.ibv_reg_mr(p.pd, unsafe.Pointer(&buf[0]), C.size_t(len(buf)), access(a))
	if r == nil {
		return nil, errnoErr("ibv_reg_mr", -1)
	}
	m := &mr{pd: p, mr: r, buf: buf}
	p.mu.Lock()
	p.mrs = append(p.mrs, m)
	p.mu.Unlock()
	return m, nil
}

// Deregister implements rdma.Deregistrar: ibv_dereg_mr, which the kernel
// refuses (EBUSY) while a window is bound on the region.
func (p *pd) Deregister(m rdma.MemoryRegion) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, x := range p.mrs {
		if rdma.MemoryRegion(x) != m {
			continue
		}
		if rc := C.ibv_dereg_mr(x.mr); rc != 0 {
			return fmt.Errorf("%w: %w", rdma.ErrBadRequest, errnoErr("ibv_dereg_mr", rc))
		}
		if x.mapped {
			syscall.Munmap(x.buf[:cap(x.buf)])
		}
		p.mrs = append(p.mrs[:i], p.mrs[i+1:]...)
		return nil
	}
	return fmt.Errorf("%w: deregistration of a region this protection domain has not registered", rdma.ErrBadRequest)
}

// CreateQP implements rdma.ProtectionDomain: an RC queue pair in RESET.
func (p *pd) CreateQP(sendCQ, recvCQ rdma.CompletionQueue, depth int) (rdma.QueuePair, error) {
	s, ok1 := sendCQ.(*cq)
	r, ok2 := recvCQ.(*cq)
	if !ok1 || !ok2 || depth < 1 || s.d != p.d || r.d != p.d {
		return nil, fmt.Errorf("%w: CQs of another device or provider, or depth %d", rdma.ErrBadRequest, depth)
	}
	qp := C.kvh_create_qp(p.pd, s.cq, r.cq, C.uint32_t(depth))
	if qp == nil {
		return nil, errnoErr("ibv_create_qp", -1)
	}
	q := &QP{d: p.d, pd: p, qp: qp, sendCQ: s, recvCQ: r, depth: depth, psn: soft.Random32() & 0xFFFFFF}
	if rc := C.kvh_to_init(qp, p.d.port); rc != 0 {
		C.ibv_destroy_qp(qp)
		return nil, errnoErr("modify QP to INIT", rc)
	}
	p.d.mu.Lock()
	p.d.qps = append(p.d.qps, q)
	p.d.mu.Unlock()
	return q, nil
}

// cq is a completion queue on the NIC plus the completions the provider makes
// itself (work requests it held back and flushed).
type cq struct {
	d    *Device
	mu   sync.Mutex // ibv_poll_cq on one CQ from one goroutine at a time
	cq   *C.struct_ibv_cq
	ch   *C.struct_ibv_comp_channel
	soft *soft.Queue
	wcs  [64]C.struct_kvh_wc
}

// spin is how long Wait busy-polls before it sleeps on the completion channel.
const spin = 20 * time.Microsecond

// Poll implements rdma.CompletionQueue.
func (c *cq) Poll(max int) []rdma.Completion {
	out := c.soft.Poll(max)
	if len(out) >= max {
		return out
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cq == nil {
		return out
	}
	n := int(C.kvh_poll(c.cq, C.int(min(max-len(out), len(c.wcs))), &c.wcs[0]))
	if n <= 0 {
		return out
	}
	c.d.mu.Lock()
	defer c.d.mu.Unlock()
	for _, w := range c.wcs[:n] {
		p := c.d.wrs[uint64(w.id)]
		delete(c.d.wrs, uint64(w.id))
		x := rdma.Completion{WRID: p.id, Op: p.op, Status: status(w.status), HasImm: w.flags&C.IBV_WC_WITH_IMM != 0}
		if x.Status == rdma.Success {
			switch w.opcode {
			case C.IBV_WC_RECV:
				x.Op, x.Bytes = rdma.OpRecv, int(w.len)
			case C.IBV_WC_RECV_RDMA_WITH_IMM:
				x.Op = rdma.OpRecvImm
			}
		}
		if x.HasImm {
			x.Imm = uint32(w.imm)
		}
		out = append(out, x)
	}
	return out
}

func status(s C.int32_t) rdma.Status {
	switch s {
	case C.IBV_WC_SUCCESS:
		return rdma.Success
	case C.IBV_WC_REM_ACCESS_ERR, C.IBV_WC_LOC_PROT_ERR, C.IBV_WC_REM_INV_REQ_ERR:
		return rdma.RemoteAccessError
	case C.IBV_WC_LOC_LEN_ERR:
		return rdma.LocalLengthError
	case C.IBV_WC_WR_FLUSH_ERR:
		return rdma.FlushError
	case C.IBV_WC_RNR_RETRY_EXC_ERR:
		return rdma.ReceiverNotReady
	}
	return rdma.TransportError
}

// Wait implements rdma.CompletionQueue: busy polls for a moment, then sleeps
// on the completion channel (in slices of a millisecond, so completions the
// provider makes itself are seen too).
func (c *cq) Wait(max int, timeout time.Duration) []rdma.Completion {
	start := time.Now()
	for time.Since(start) < min(spin, timeout) {
		if out := c.Poll(max); len(out) > 0 {
			return out
		}
	}
	for {
		c.mu.Lock()
		if c.cq == nil {
			c.mu.Unlock()
			return c.soft.Poll(max)
		}
		C.kvh_arm(c.cq)
		c.mu.Unlock()
		// Armed first, polled second: a completion that arrived in between
		// is found here, one that arrives later raises the event.
		if out := c.Poll(max); len(out) > 0 {
			return out
		}
		left := timeout - time.Since(start)
		if left <= 0 {
			return nil
		}
		c.mu.Lock()
		ch := c.ch
		c.mu.Unlock()
		if ch == nil {
			continue
		}
		C.kvh_wait(ch, C.int(min(left, time.Millisecond)/time.Millisecond+1))
	}
}

// QP is a reliable-connected queue pair on the NIC.
type QP struct {
	d      *Device
	pd     *pd
	qp     *C.struct_ibv_qp
	sendCQ *cq
	recvCQ *cq
	depth  int
	psn    uint32

	mu        sync.Mutex
	connected bool
	failed    bool // moved to the error state by ToError
	paused    bool
	held      []rdma.WorkRequest // posted while paused, not yet on the NIC
	corrupt   bool
}

// Info implements rdma.QueuePair.
func (q *QP) Info() rdma.ConnInfo {
	return rdma.ConnInfo{Fabric: q.d.name, QPN: uint32(q.qp.qp_num), GID: q.d.gid, LID: q.d.lid, PSN: q.psn}
}

// Connect implements rdma.QueuePair: INIT → RTR → RTS towards remote.
func (q *QP) Connect(remote rdma.ConnInfo) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.connected || q.failed {
		return fmt.Errorf("%w: connect twice or after an error", rdma.ErrBadRequest)
	}
	gid := remote.GID
	if rc := C.kvh_to_rtr(q.qp, q.d.port, q.d.mtu, C.uint32_t(remote.QPN), C.uint32_t(remote.PSN&0xFFFFFF),
		(*C.uint8_t)(unsafe.Pointer(&gid[0])), C.uint16_t(remote.LID), C.int(q.d.gidIndex)); rc != 0 {
		return fmt.Errorf("%w: %v", rdma.ErrUnknownPeer, errnoErr("modify QP to RTR", rc))
	}
	if rc := C.kvh_to_rts(q.qp, C.uint32_t(q.psn)); rc != 0 {
		return errnoErr("modify QP to RTS", rc)
	}
	q.connected = true
	return nil
}

// State implements rdma.QueuePair, asking the NIC: a work request that failed
// there has moved the queue pair to the error state on its own.
func (q *QP) State() rdma.QPState {
	q.mu.Lock()
	failed := q.failed
	q.mu.Unlock()
	if failed {
		return rdma.StateError
	}
	switch C.kvh_qp_state(q.qp) {
	case C.IBV_QPS_RTS:
		return rdma.StateRTS
	case C.IBV_QPS_ERR, C.IBV_QPS_SQE, -1:
		return rdma.StateError
	}
	return rdma.StateReset
}

func (q *QP) checkLocal(s rdma.SGE) (*mr, error) {
	m, ok := s.MR.(*mr)
	// Offset+Length can overflow int: compare the length with what is left.
	if !ok || m == nil || m.pd != q.pd || s.Offset < 0 || s.Length < 0 || s.Offset > len(m.buf) || s.Length > len(m.buf)-s.Offset || s.Length > 1<<31-1 {
		return nil, fmt.Errorf("%w: local buffer outside its region or not of this protection domain", rdma.ErrBadRequest)
	}
	return m, nil
}

// PostSend implements rdma.QueuePair.
func (q *QP) PostSend(wr rdma.WorkRequest) error {
	switch wr.Op {
	case rdma.OpWrite, rdma.OpWriteImm, rdma.OpSend, rdma.OpBind:
		if _, err := q.checkLocal(wr.Local); err != nil {
			return err
		}
	case rdma.OpInvalidate:
	default:
		return fmt.Errorf("%w: %v on the send queue", rdma.ErrBadRequest, wr.Op)
	}
	if wr.Op == rdma.OpBind || wr.Op == rdma.OpInvalidate {
		w, ok := wr.Window.(*window)
		if !ok || w.pd != q.pd {
			return fmt.Errorf("%w: %v of no window of this protection domain", rdma.ErrBadRequest, wr.Op)
		}
		if wr.Op == rdma.OpBind {
			w.chooseKey(&wr)
		}
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	switch {
	case q.failed:
		return rdma.ErrQPError
	case !q.connected:
		return rdma.ErrNotConnected
	case q.paused:
		if len(q.held) >= q.depth {
			return rdma.ErrQueueFull
		}
		q.held = append(q.held, wr)
		return nil
	}
	return q.postSendLocked(wr)
}

// postSendLocked hands wr to the NIC; the caller holds q.mu.
func (q *QP) postSendLocked(wr rdma.WorkRequest) error {
	if wr.Op == rdma.OpBind || wr.Op == rdma.OpInvalidate {
		return q.postWindowLocked(wr)
	}
	m, _ := q.checkLocal(wr.Local)
	addr := m.Addr() + uint64(wr.Local.Offset)
	lkey := m.LKey()
	if q.corrupt && wr.Op != rdma.OpSend {
		q.corrupt = false
		if wr.Local.Length > 0 {
			// The payload in transit is damaged: send a damaged copy.
			b, err := q.pd.Alloc(wr.Local.Length, rdma.LocalWrite)
			if err != nil {
				return err
			}
			copy(b.Bytes(), m.buf[wr.Local.Offset:wr.Local.Offset+wr.Local.Length])
			rdma.Damage(b.Bytes()[:wr.Local.Length])
			addr, lkey = b.Addr(), b.LKey()
		}
	}
	var op C.int
	switch {
	case wr.Op == rdma.OpWrite:
		op = C.IBV_WR_RDMA_WRITE
	case wr.Op == rdma.OpWriteImm:
		op = C.IBV_WR_RDMA_WRITE_WITH_IMM
	case wr.HasImm:
		op = C.IBV_WR_SEND_WITH_IMM
	default:
		op = C.IBV_WR_SEND
	}
	id := q.d.remember(wr.ID, wr.Op)
	rc := C.kvh_post_send(q.qp, C.uint64_t(id), op, C.uint32_t(wr.Imm), C.uint64_t(addr), C.uint32_t(wr.Local.Length),
		C.uint32_t(lkey), C.uint64_t(wr.RemoteAddr), C.uint32_t(wr.RKey))
	return q.d.posted(id, "ibv_post_send", rc)
}

// remember records a work request before it goes to the NIC and returns the
// ID the NIC will report.
func (d *Device) remember(id uint64, op rdma.Opcode) uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.nextWR++
	d.wrs[d.nextWR] = posted{id, op}
	return d.nextWR
}

// posted forgets a work request the NIC refused and maps the refusal.
func (d *Device) posted(id uint64, what string, rc C.int) error {
	if rc == 0 {
		return nil
	}
	d.mu.Lock()
	delete(d.wrs, id)
	d.mu.Unlock()
	if rc == C.ENOMEM {
		return rdma.ErrQueueFull
	}
	return fmt.Errorf("%w: %v", rdma.ErrBadRequest, errnoErr(what, rc))
}

// PostRecv implements rdma.QueuePair. Receives may be posted before the queue
// pair is connected.
func (q *QP) PostRecv(wr rdma.WorkRequest) error {
	if wr.Op != rdma.OpRecv {
		return fmt.Errorf("%w: %v on the receive queue", rdma.ErrBadRequest, wr.Op)
	}
	m, err := q.checkLocal(wr.Local)
	if err != nil {
		return err
	}
	q.mu.Lock()
	failed := q.failed
	q.mu.Unlock()
	if failed {
		return rdma.ErrQPError
	}
	id := q.d.remember(wr.ID, rdma.OpRecv)
	rc := C.kvh_post_recv(q.qp, C.uint64_t(id), C.uint64_t(m.Addr()+uint64(wr.Local.Offset)), C.uint32_t(wr.Local.Length), C.uint32_t(m.LKey()))
	return q.d.posted(id, "ibv_post_recv", rc)
}

// ToError implements rdma.QueuePair: the NIC flushes what it holds, and the
// provider flushes what it held back.
func (q *QP) ToError() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.failed {
		return nil
	}
	q.failed = true
	for _, wr := range q.held {
		q.sendCQ.soft.Push(rdma.Completion{WRID: wr.ID, Op: wr.Op, Status: rdma.FlushError})
	}
	q.held = nil
	if rc := C.kvh_to_error(q.qp); rc != 0 {
		return errnoErr("modify QP to ERR", rc)
	}
	return nil
}

// Pause implements rdma.Faults: work requests posted from now on stay in the
// provider until Resume.
func (q *QP) Pause() {
	q.mu.Lock()
	q.paused = true
	q.mu.Unlock()
}

// Resume implements rdma.Faults: the held work requests go to the NIC, in order.
func (q *QP) Resume() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.paused = false
	held := q.held
	q.held = nil
	for i, wr := range held {
		if err := q.postSendLocked(wr); err != nil {
			for _, w := range held[i:] {
				q.sendCQ.soft.Push(rdma.Completion{WRID: w.ID, Op: w.Op, Status: rdma.FlushError})
			}
			return
		}
	}
}

// CorruptNext implements rdma.Faults: the next WRITE is sent from a damaged
// copy of its payload; the source is untouched.
func (q *QP) CorruptNext() {
	q.mu.Lock()
	q.corrupt = true
	q.mu.Unlock()
}

package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/inproc"
	"github.com/kvhandoff/kvhandoff/rdma/socket"
	"github.com/kvhandoff/kvhandoff/rdma/throughput"
	"github.com/kvhandoff/kvhandoff/transfer"
)

const benchHandoffUsage = `usage: kvhandoff bench handoff [flags]

Measures end-to-end handoffs through real endpoints: a transfer.Prefill and a
transfer.Decode, each on its own run loop, joined by one queue pair. Each
request is --pages pages of --page-bytes; --window requests are in flight at
once. A handoff is timed from Submit on the prefill node to the decode node's
outcome, after it read the verified pages (Acquire, a check of each page's
marker, Finish). Next to it, in the same run, the provider's raw WRITE
throughput for the same page size (rdma/throughput, what bench transfer
measures), and the ratio of the two. Rounds alternate, handoffs then raw
WRITEs, --reps times; each keeps its best round (the latencies are the best
handoff round's).

Providers:
  inproc   the in-process provider
  socket   the socket provider over TLS 1.3 on loopback (two devices, one process)

flags:
`

// handoffRow is one provider's result.
type handoffRow struct {
	Provider       string  `json:"provider"`
	PageBytes      int     `json:"page_bytes"`
	Pages          int     `json:"pages_per_request"`
	Requests       int     `json:"requests"`
	Window         int     `json:"window"`
	Reps           int     `json:"reps"`
	HandoffsPerSec float64 `json:"handoffs_per_sec"`
	Gbps           float64 `json:"gbps"`
	RawGbps        float64 `json:"raw_gbps"`
	Ratio          float64 `json:"ratio"`
	P50Micros      float64 `json:"p50_us"`
	P99Micros      float64 `json:"p99_us"`
}

// handoffDevices makes a prefill and a decode device of a provider.
var handoffDevices = map[string]func() (p, d rdma.Device, close func(), err error){
	"inproc": func() (rdma.Device, rdma.Device, func(), error) {
		f := inproc.NewFabric("bench-handoff")
		return f.Device("prefill"), f.Device("decode"), func() {}, nil
	},
	"socket": func() (rdma.Device, rdma.Device, func(), error) {
		ca, err := pki.NewCA("bench-handoff")
		if err != nil {
			return nil, nil, nil, err
		}
		var devs []*socket.Device
		closeAll := func() {
			for _, d := range devs {
				d.Close()
			}
		}
		for _, name := range []string{"prefill", "decode"} {
			tc, err := ca.Config(name)
			if err == nil {
				var d *socket.Device
				if d, err = socket.Listen("tcp", "127.0.0.1:0", socket.Config{TLS: tc}); err == nil {
					devs = append(devs, d)
				}
			}
			if err != nil {
				closeAll()
				return nil, nil, nil, err
			}
		}
		return devs[0], devs[1], closeAll, nil
	},
}

// markedKV is the benchmark's KV source: it writes only a marker (request
// and page) at the head of each page, so the measurement is the handoff's,
// not a generator's; the decode side checks every marker.
type markedKV struct{}

func (markedKV) FillKV(id protocol.RequestID, _ int, pages [][]byte) error {
	for i, p := range pages {
		binary.LittleEndian.PutUint64(p, uint64(id))
		binary.LittleEndian.PutUint64(p[8:], uint64(i))
	}
	return nil
}

func runBenchHandoff(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("bench handoff", benchHandoffUsage, stderr)
	providers := fs.String("provider", "inproc,socket", "comma-separated providers: inproc, socket")
	pageBytes := fs.Int("page-bytes", 64<<10, "bytes per page")
	pages := fs.Int("pages", 16, "pages per request")
	requests := fs.Int("requests", 1000, "requests timed")
	window := fs.Int("window", 8, "requests in flight at once")
	reps := fs.Int("reps", 3, "rounds, alternating handoffs and raw WRITEs; the best of each counts")
	jsonOut := fs.Bool("json", false, "print exactly one JSON object on stdout")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if *pageBytes < 64 || *pages < 1 || *requests < 1 || *window < 1 || *reps < 1 {
		fmt.Fprintln(stderr, "kvhandoff bench handoff: --page-bytes must be at least 64, --pages, --requests, --window and --reps at least 1")
		return 2
	}
	var rows []handoffRow
	for _, name := range strings.Split(*providers, ",") {
		mk, ok := handoffDevices[name]
		if !ok {
			fmt.Fprintf(stderr, "kvhandoff bench handoff: unknown provider %q\n", name)
			return 2
		}
		row, err := measureHandoff(mk, *pageBytes, *pages, *requests, *window, *reps)
		if err != nil {
			fmt.Fprintf(stderr, "kvhandoff bench handoff: %s: %v\n", name, err)
			return 1
		}
		row.Provider = name
		rows = append(rows, row)
	}
	if *jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(struct {
			Rows []handoffRow `json:"rows"`
		}{rows}); err != nil {
			fmt.Fprintf(stderr, "kvhandoff bench handoff: %v\n", err)
			return 2
		}
		return 0
	}
	tw := tabwriter.NewWriter(stdout, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "provider\tpage\tpages\thandoffs/s\tGbit/s\traw Gbit/s\tratio\tp50 µs\tp99 µs\t")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%d KiB\t%d\t%.0f\t%.2f\t%.2f\t%.2f\t%.0f\t%.0f\t\n", r.Provider, r.PageBytes>>10, r.Pages,
			r.HandoffsPerSec, r.Gbps, r.RawGbps, r.Ratio, r.P50Micros, r.P99Micros)
	}
	tw.Flush()
	return 0
}

// measureHandoff runs reps rounds of requests handoffs through a Prefill and
// a Decode endpoint on one provider, each followed by a round of the
// provider's raw WRITEs on two other devices of the same provider.
func measureHandoff(mk func() (rdma.Device, rdma.Device, func(), error), pageBytes, pages, requests, window, reps int) (handoffRow, error) {
	row := handoffRow{PageBytes: pageBytes, Pages: pages, Requests: requests, Window: window, Reps: reps}
	devP, devD, closeDevs, err := mk()
	if err != nil {
		return row, err
	}
	defer closeDevs()
	const pageTokens = 16
	p, err := transfer.NewPrefill(devP, transfer.PrefillConfig{Pages: 2 * window * pages, PageTokens: pageTokens, PageBytes: pageBytes,
		MaxRequestPages: pages, KV: markedKV{}})
	if err != nil {
		return row, err
	}
	defer p.Close()
	d, err := transfer.NewDecode(devD, transfer.DecodeConfig{Pages: window * pages, PageTokens: pageTokens, PageBytes: pageBytes,
		Timeout: time.Minute})
	if err != nil {
		return row, err
	}
	defer d.Close()
	if err := transfer.ConnectLocal(p, "prefill", d, "decode"); err != nil {
		return row, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for _, run := range []func(context.Context) error{p.Run, d.Run} {
		wg.Add(1)
		go func() { defer wg.Done(); run(ctx) }()
	}

	// A request's window slot comes back once both nodes reported it.
	var (
		mu      sync.Mutex
		started = map[protocol.RequestID]time.Time{}
		ended   = map[protocol.RequestID]int{}
		lat     []time.Duration
		failure error
	)
	slots := make(chan struct{}, window)
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		if failure == nil {
			failure = err
		}
	}
	done := func(id protocol.RequestID, err error, decode bool) {
		mu.Lock()
		defer mu.Unlock()
		if err != nil && failure == nil {
			failure = fmt.Errorf("request %d: %w", id, err)
		}
		if decode {
			lat = append(lat, time.Since(started[id]))
		}
		if ended[id]++; ended[id] == 2 {
			delete(ended, id)
			delete(started, id)
			<-slots
		}
	}
	watch := func(e interface {
		Notify() <-chan struct{}
		Events() []transfer.Event
	}, decode bool) {
		defer wg.Done()
		for {
			select {
			case <-ctx.Done():
				return
			case <-e.Notify():
			}
			for _, ev := range e.Events() {
				switch ev.Kind {
				case transfer.Verified:
					got, err := d.Acquire(ev.Request)
					if err == nil {
						for i, page := range got {
							if binary.LittleEndian.Uint64(page) != uint64(ev.Request) || binary.LittleEndian.Uint64(page[8:]) != uint64(i) {
								err = fmt.Errorf("page %d holds another page's KV", i)
								break
							}
						}
						if ferr := d.Finish(ev.Request); err == nil {
							err = ferr
						}
					}
					if err != nil {
						fail(fmt.Errorf("request %d: %w", ev.Request, err))
					}
				case transfer.Outcome:
					done(ev.Request, ev.Err, decode)
				}
			}
		}
	}
	wg.Add(2)
	go watch(p, false)
	go watch(d, true)

	rawP, rawD, closeRaw, err := mk()
	if err != nil {
		return row, err
	}
	defer closeRaw()
	// Rounds alternate, handoffs then raw WRITEs, and each keeps its best: on
	// a shared machine the load moves, and both sides of the ratio should
	// see the same moments.
	tokens := pages * pageTokens
	next := protocol.RequestID(1)
	for r := 0; r < reps; r++ {
		mu.Lock()
		lat = lat[:0]
		mu.Unlock()
		start := time.Now()
		for i := 0; i < requests; i++ {
			id := next
			next++
			select {
			case slots <- struct{}{}:
			case <-time.After(30 * time.Second):
				return row, fmt.Errorf("no window slot after 30 s: a handoff hangs")
			}
			mu.Lock()
			started[id] = time.Now()
			err := failure
			mu.Unlock()
			if err != nil {
				return row, err
			}
			if err := p.Submit(id, "decode", tokens); err != nil {
				return row, err
			}
		}
		for i := 0; i < window; i++ { // every slot back: every request ended on both nodes
			select {
			case slots <- struct{}{}:
			case <-time.After(30 * time.Second):
				return row, fmt.Errorf("the last handoffs hang")
			}
		}
		elapsed := time.Since(start).Seconds()
		for i := 0; i < window; i++ {
			<-slots
		}
		mu.Lock()
		err, sorted := failure, slices.Sorted(slices.Values(lat))
		mu.Unlock()
		if err != nil {
			return row, err
		}
		if len(sorted) != requests {
			return row, fmt.Errorf("%d of %d handoffs reported on decode", len(sorted), requests)
		}
		if rate := float64(requests) / elapsed; rate > row.HandoffsPerSec {
			row.HandoffsPerSec = rate
			row.Gbps = float64(requests*pages*pageBytes) * 8 / elapsed / 1e9
			row.P50Micros = float64(sorted[len(sorted)/2]) / 1e3
			row.P99Micros = float64(sorted[min(len(sorted)-1, len(sorted)*99/100)]) / 1e3
		}
		raw, _, err := throughput.Write(rawP, rawD, pageBytes, min(requests*pages*pageBytes, 256<<20), 1)
		if err != nil {
			return row, err
		}
		row.RawGbps = max(row.RawGbps, raw*8/1e9)
	}
	row.Ratio = row.Gbps / row.RawGbps
	return row, nil
}

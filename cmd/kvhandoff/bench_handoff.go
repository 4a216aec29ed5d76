package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/node"
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

--prefix (default 0.75) adds, for the in-process providers, prefix reuse
rows: requests of --pages pages whose prompts share that fraction of their
pages, handed off one at a time with the decode node's prefix cache (reuse)
and without (no-reuse, scope 0), rounds alternating in the same run: pages
and bytes prefill WRITEs per request, the time from Submit to the decode
node holding the verified pages (the handoff's share of the time to first
token: the KV source writes markers, no model computes), and on the reuse
row the ratios to no-reuse.

--stream-prompts (default 64,256,1024) adds, for the in-process providers,
time to first token rows: prompts of those token counts, the built-in model
computing their KV on the prefill node (engine.Source) and the first token on
the decode node, with the prefill computed whole before its pages move and
streamed in chunks of --chunk-pages pages (each chunk's pages sent while the
next is computed), requests alternating between the two in the same run;
the p50 of each and the ratio streamed / whole (both must generate the same
first token). --stream-link gives each row set a link from the prefill node
to the decode node: 0 is the provider's own speed; a rate in Gbit/s paces the
prefill node's sends in order at that rate (an emulated link, as netem's rate
is), since here a CPU computes the KV slowly and moves it in a copy, the
reverse of a GPU prefill sending its KV over a network.

--bugs compares the decode node's defenses in the same run: a list of
research switch sets separated by ';' ("none;pool-wide-key" is per-grant
windows, a bind and a revoke per request, against one key for the pool, the
behaviour before them); rounds alternate over the sets, one row each. The
name trace in a set has both endpoints write their protocol events to a
file (docs/trace.md): "none;trace" is tracing's cost, in the same run.

Providers:
  inproc           the in-process provider
  socket           the socket provider over TLS 1.3 on loopback (two devices, one process)
  socket-process   the same, with the decode node in another process (this binary,
                   started by the benchmark) and the queue pair set up by Dial and
                   Serve; latency is to the prefill node's outcome (its WRITEs and
                   Done complete), the decode process checks every page it reads;
                   the raw baseline is the socket provider's, in one process

flags:
`

// handoffRow is one provider's result.
type handoffRow struct {
	Provider       string  `json:"provider"`
	Bugs           string  `json:"bugs"` // research switches on the decode node ("none": every defense)
	PageBytes      int     `json:"page_bytes"`
	Pages          int     `json:"pages_per_request"`
	Requests       int     `json:"requests"`
	Window         int     `json:"window"`
	Reps           int     `json:"reps"`
	LatencyTo      string  `json:"latency_to"` // decode-read: to the decode node's outcome; prefill-done: to the prefill node's
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

func (markedKV) FillKV(id protocol.RequestID, _ int, _ []uint32, memory [][]byte) error {
	for i, p := range memory {
		binary.LittleEndian.PutUint64(p, uint64(id))
		binary.LittleEndian.PutUint64(p[8:], uint64(i))
	}
	return nil
}

func runBenchHandoff(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("bench handoff", benchHandoffUsage, stderr)
	providers := fs.String("provider", "inproc,socket,socket-process", "comma-separated providers: inproc, socket, socket-process")
	pageBytes := fs.Int("page-bytes", 64<<10, "bytes per page")
	pages := fs.Int("pages", 16, "pages per request")
	requests := fs.Int("requests", 1000, "requests timed")
	window := fs.Int("window", 8, "requests in flight at once")
	reps := fs.Int("reps", 3, "rounds, alternating handoffs and raw WRITEs; the best of each counts")
	decodeNode := fs.String("decode-node", "", "internal: run as the decode process of socket-process, with the certificates in this directory")
	jsonOut := fs.Bool("json", false, "print exactly one JSON object on stdout")
	bugList := fs.String("bugs", "none", "research switch sets on the decode node, separated by ';', alternated round by round (in-process providers)")
	streamPrompts := fs.String("stream-prompts", "64,256,1024", "time to first token rows (in-process providers): prompts of these token counts, the built-in model computing, the prefill whole and streamed; none: no rows")
	chunkPages := fs.Int("chunk-pages", node.DefaultPrefillChunkPages, "the streamed prefill's chunk in pages (--stream-prompts)")
	streamLink := fs.String("stream-link", "0,1", "time to first token rows: the link from the prefill node to the decode node, comma-separated rates in Gbit/s, each its own rows (0: the provider's own speed; others emulated by pacing the prefill node's sends)")
	streamRequests := fs.Int("stream-requests", 5, "requests per prompt length, mode and round (--stream-prompts)")
	prefix := fs.Float64("prefix", 0.75, "prefix reuse rows (in-process providers): requests whose prompts share this fraction of their pages, with and without the decode node's prefix cache; 0: none")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if *pageBytes < 64 || *pages < 1 || *requests < 1 || *window < 1 || *reps < 1 {
		fmt.Fprintln(stderr, "kvhandoff bench handoff: --page-bytes must be at least 64, --pages, --requests, --window and --reps at least 1")
		return 2
	}
	lengths, err := parsePromptLengths(*streamPrompts, llama.BuiltinConfig.SeqLen)
	var links []float64
	if err == nil {
		links, err = parseLinkRates(*streamLink)
	}
	if err == nil && (*chunkPages < 1 || *streamRequests < 1) {
		err = fmt.Errorf("--chunk-pages and --stream-requests must be at least 1")
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvhandoff bench handoff: %v\n", err)
		return 2
	}
	if *decodeNode != "" {
		return serveDecodeNode(*decodeNode, *pageBytes, *pages, *window, stdout, stderr)
	}
	shared := int(*prefix * float64(*pages))
	if *prefix < 0 || *prefix >= 1 || *prefix > 0 && (shared < 1 || shared >= *pages) {
		fmt.Fprintln(stderr, "kvhandoff bench handoff: --prefix is a fraction in [0, 1) that leaves at least one page shared and one written")
		return 2
	}
	var sets []research.Switches
	var traced []bool
	for _, list := range strings.Split(*bugList, ";") {
		names := strings.Split(list, ",")
		traced = append(traced, slices.Contains(names, "trace"))
		sw, err := research.Parse(strings.Join(slices.DeleteFunc(names, func(n string) bool { return n == "trace" }), ","))
		if err != nil {
			fmt.Fprintf(stderr, "kvhandoff bench handoff: --bugs: %v\n", err)
			return 2
		}
		sets = append(sets, sw)
	}
	var rows []handoffRow
	var prefixRows []prefixRow
	var streamRows []streamRow
	for _, name := range strings.Split(*providers, ",") {
		separate := name == "socket-process"
		mk, ok := handoffDevices[strings.TrimSuffix(name, "-process")]
		if !ok {
			fmt.Fprintf(stderr, "kvhandoff bench handoff: unknown provider %q\n", name)
			return 2
		}
		if separate && (len(sets) > 1 || sets[0].Any() || traced[0]) {
			fmt.Fprintln(stderr, "kvhandoff bench handoff: --bugs applies to the in-process providers only")
			return 2
		}
		// Rounds alternate over the sets, so that each sees the same moments
		// of a shared machine; each set keeps its best round.
		best := make([]handoffRow, len(sets))
		rounds, per := *reps, 1
		if len(sets) == 1 {
			rounds, per = 1, *reps // one setup (one decode process) for every round
		}
		for r := 0; r < rounds; r++ {
			for i, sw := range sets {
				row, err := measureHandoff(mk, separate, sw, traced[i], *pageBytes, *pages, *requests, *window, per)
				if err != nil {
					fmt.Fprintf(stderr, "kvhandoff bench handoff: %s (bugs %v): %v\n", name, sw, err)
					return 1
				}
				if row.HandoffsPerSec > best[i].HandoffsPerSec {
					raw := max(row.RawGbps, best[i].RawGbps)
					best[i] = row
					best[i].RawGbps = raw
				} else {
					best[i].RawGbps = max(row.RawGbps, best[i].RawGbps)
				}
			}
		}
		for i, row := range best {
			row.Provider, row.Bugs, row.Reps = name, sets[i].String(), *reps
			if traced[i] {
				row.Bugs = strings.TrimPrefix(row.Bugs+"+trace", "none+")
			}
			row.Ratio = row.Gbps / row.RawGbps
			rows = append(rows, row)
		}
		if shared > 0 && !separate {
			// One request at a time: its time to its pages is the handoff's
			// share of the time to first token, not a queue's.
			pr, err := measurePrefixReuse(mk, *pageBytes, *pages, shared, min(*requests, 200), *reps)
			if err != nil {
				fmt.Fprintf(stderr, "kvhandoff bench handoff: %s, prefix reuse: %v\n", name, err)
				return 1
			}
			for _, r := range pr {
				r.Provider, r.Prefix = name, float64(shared)/float64(*pages)
				prefixRows = append(prefixRows, r)
			}
		}
		for _, link := range links {
			for _, tokens := range lengths {
				if separate {
					break
				}
				r, err := measureStreaming(mk, link, tokens, *chunkPages, *streamRequests, *reps)
				if err != nil {
					fmt.Fprintf(stderr, "kvhandoff bench handoff: %s, streaming prefill of %d tokens (link %g Gbit/s): %v\n", name, tokens, link, err)
					return 1
				}
				r.Provider = name
				streamRows = append(streamRows, r)
			}
		}
	}
	if *jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(struct {
			Rows       []handoffRow `json:"rows"`
			PrefixRows []prefixRow  `json:"prefix_rows,omitempty"`
			StreamRows []streamRow  `json:"stream_rows,omitempty"`
		}{rows, prefixRows, streamRows}); err != nil {
			fmt.Fprintf(stderr, "kvhandoff bench handoff: %v\n", err)
			return 2
		}
		return 0
	}
	tw := tabwriter.NewWriter(stdout, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "provider\tbugs\tpage\tpages\thandoffs/s\tGbit/s\traw Gbit/s\tratio\tp50 µs\tp99 µs\t")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%d KiB\t%d\t%.0f\t%.2f\t%.2f\t%.2f\t%.0f\t%.0f\t\n", r.Provider, r.Bugs, r.PageBytes>>10, r.Pages,
			r.HandoffsPerSec, r.Gbps, r.RawGbps, r.Ratio, r.P50Micros, r.P99Micros)
	}
	tw.Flush()
	if len(prefixRows) > 0 {
		fmt.Fprintln(stdout)
		tw = tabwriter.NewWriter(stdout, 2, 8, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "provider\tmode\tshared\tpages\tpages written\tKiB written\tttft p50 µs\tttft p99 µs\tratio pages\tratio ttft\t")
		for _, r := range prefixRows {
			ratio := func(x float64) string {
				if r.Mode != "reuse" {
					return ""
				}
				return fmt.Sprintf("%.2f", x)
			}
			fmt.Fprintf(tw, "%s\t%s\t%.0f%%\t%d\t%.1f\t%.0f\t%.0f\t%.0f\t%s\t%s\t\n", r.Provider, r.Mode, 100*r.Prefix, r.Pages, r.PagesWritten,
				r.BytesWritten/1024, r.TTFTP50Micros, r.TTFTP99Micros, ratio(r.PagesRatio), ratio(r.TTFTRatio))
		}
		tw.Flush()
	}
	if len(streamRows) > 0 {
		fmt.Fprintln(stdout)
		tw = tabwriter.NewWriter(stdout, 2, 8, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "provider\tlink Gbit/s\tprompt tokens\tpages\tchunk pages\tttft whole p50 µs\tttft streamed p50 µs\tratio\t")
		for _, r := range streamRows {
			link := "own"
			if r.LinkGbps > 0 {
				link = strconv.FormatFloat(r.LinkGbps, 'g', -1, 64)
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%.0f\t%.0f\t%.2f\t\n", r.Provider, link, r.PromptTokens, r.Pages, r.ChunkPages, r.WholeTTFTMicros, r.StreamTTFTMicros, r.Ratio)
		}
		tw.Flush()
	}
	return 0
}

const benchPageTokens = 16

// handoffSetup is a prefill endpoint with a queue pair to decode peer "decode",
// running; d is the decode endpoint when it lives in this process, nil when
// it is another process (which checks what it reads itself).
type handoffSetup struct {
	p         *transfer.Prefill
	d         *transfer.Decode
	close     func() error // stops everything; for a decode process, its verdict
	handedOff int          // requests that succeeded on the prefill node, set before close
}

// localSetup runs both endpoints in this process on two devices of a provider.
func localSetup(ctx context.Context, mk func() (rdma.Device, rdma.Device, func(), error), bugs research.Switches, traced bool, pageBytes, pages, window int) (*handoffSetup, error) {
	devP, devD, closeDevs, err := mk()
	if err != nil {
		return nil, err
	}
	var sink *trace.Sink
	if traced { // a file, as serve --trace writes, removed at the end
		f, err := os.CreateTemp("", "kvhandoff-bench-trace-*")
		if err != nil {
			closeDevs()
			return nil, err
		}
		name := f.Name()
		f.Close()
		if sink, err = trace.Create(name); err != nil {
			closeDevs()
			return nil, err
		}
		inner := closeDevs
		closeDevs = func() { inner(); sink.Close(); os.Remove(name) }
	}
	p, err := transfer.NewPrefill(devP, transfer.PrefillConfig{Pages: 2 * window * pages, PageTokens: benchPageTokens, PageBytes: pageBytes,
		MaxRequestPages: pages, KV: markedKV{}, Trace: sink.NewWriter("prefill", "prefill")})
	if err != nil {
		closeDevs()
		return nil, err
	}
	d, err := transfer.NewDecode(devD, transfer.DecodeConfig{Pages: window * pages, PageTokens: benchPageTokens, PageBytes: pageBytes,
		Timeout: time.Minute, Research: bugs, Trace: sink.NewWriter("decode", "decode")})
	if err == nil {
		err = transfer.ConnectLocal(p, "prefill", d, "decode")
	}
	if err != nil {
		closeDevs()
		return nil, err
	}
	return &handoffSetup{p: p, d: d, close: func() error { p.Close(); d.Close(); closeDevs(); return nil }}, nil
}

// measureHandoff runs reps rounds of requests handoffs through a Prefill and
// a Decode endpoint on one provider, each followed by a round of the
// provider's raw WRITEs on two other devices of the same provider.
func measureHandoff(mk func() (rdma.Device, rdma.Device, func(), error), separate bool, bugs research.Switches, traced bool, pageBytes, pages, requests, window, reps int) (row handoffRow, err error) {
	row = handoffRow{PageBytes: pageBytes, Pages: pages, Requests: requests, Window: window, Reps: reps, LatencyTo: "decode-read"}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var setup *handoffSetup
	if separate {
		setup, err = processSetup(ctx, pageBytes, pages, window)
		row.LatencyTo = "prefill-done"
	} else {
		setup, err = localSetup(ctx, mk, bugs, traced, pageBytes, pages, window)
	}
	if err != nil {
		return row, err
	}
	p, d := setup.p, setup.d
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
		if cerr := setup.close(); err == nil && cerr != nil {
			err = cerr
		}
	}()
	runs := []func(context.Context) error{p.Run}
	if d != nil {
		runs = append(runs, d.Run)
	}
	for _, run := range runs {
		wg.Add(1)
		go func() { defer wg.Done(); run(ctx) }()
	}
	// Outcomes that end a request: both nodes' here, the prefill node's when
	// decode is another process.
	legs := 1
	if d != nil {
		legs = 2
	}

	// A request's window slot comes back once every leg here reported it.
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
		if decode || d == nil {
			lat = append(lat, time.Since(started[id]))
		}
		if ended[id]++; ended[id] == legs {
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
					if err := readMarked(d, ev.Request); err != nil {
						fail(err)
					}
				case transfer.Outcome:
					done(ev.Request, ev.Err, decode)
				}
			}
		}
	}
	wg.Add(1)
	go watch(p, false)
	if d != nil {
		wg.Add(1)
		go watch(d, true)
	}

	rawP, rawD, closeRaw, err := mk()
	if err != nil {
		return row, err
	}
	defer closeRaw()
	// Rounds alternate, handoffs then raw WRITEs, and each keeps its best: on
	// a shared machine the load moves, and both sides of the ratio should
	// see the same moments.
	tokens := pages * benchPageTokens
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
	setup.handedOff = reps * requests
	row.Ratio = row.Gbps / row.RawGbps
	return row, nil
}

// processSetup starts the decode node as another process (this binary, with
// --decode-node) on the socket provider over TLS, and connects this
// process's prefill endpoint to it by Dial. The decode process checks the
// markers of every page it reads and reports when its stdin closes.
func processSetup(ctx context.Context, pageBytes, pages, window int) (*handoffSetup, error) {
	dir, err := os.MkdirTemp("", "kvhandoff-bench-")
	if err != nil {
		return nil, err
	}
	ca, err := pki.NewCA("bench-handoff")
	if err == nil {
		err = ca.WriteFiles(dir, false, "prefill", "decode")
	}
	var tc *tls.Config
	if err == nil {
		tc, err = pki.Load(filepath.Join(dir, pki.CertFile("prefill")), filepath.Join(dir, pki.KeyFile("prefill")), filepath.Join(dir, pki.CAFile))
	}
	self, serr := os.Executable()
	if err == nil {
		err = serr
	}
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	cmd := exec.Command(self, "bench", "handoff", "--decode-node", dir, "--page-bytes", fmt.Sprint(pageBytes),
		"--pages", fmt.Sprint(pages), "--window", fmt.Sprint(window))
	cmd.Stderr = os.Stderr
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	lines := bufio.NewScanner(stdout)
	handedOff := 0 // requests the prefill node completed, for the decode process to wait for
	stop := func() error {
		fmt.Fprintln(stdin, handedOff)
		stdin.Close()
		var verdict string
		for lines.Scan() {
			verdict = lines.Text()
		}
		werr := cmd.Wait()
		os.RemoveAll(dir)
		if werr != nil || !strings.HasPrefix(verdict, "ok ") {
			return fmt.Errorf("the decode process: %q, %v", verdict, werr)
		}
		return nil
	}
	var addr string
	if lines.Scan() {
		addr, _ = strings.CutPrefix(lines.Text(), "listening ")
	}
	if addr == "" {
		stop()
		return nil, errors.New("the decode process did not start")
	}
	dev, err := socket.Listen("tcp", "127.0.0.1:0", socket.Config{TLS: tc})
	if err != nil {
		stop()
		return nil, err
	}
	p, err := transfer.NewPrefill(dev, transfer.PrefillConfig{Pages: 2 * window * pages, PageTokens: benchPageTokens, PageBytes: pageBytes,
		MaxRequestPages: pages, KV: markedKV{}})
	if err == nil {
		err = p.Dial(ctx, "decode", addr, transfer.SetupConfig{Name: "prefill", TLS: tc})
	}
	if err != nil {
		dev.Close()
		stop()
		return nil, err
	}
	setup := &handoffSetup{p: p}
	setup.close = func() error {
		handedOff = setup.handedOff
		err := stop()
		p.Close()
		dev.Close()
		return err
	}
	return setup, nil
}

// serveDecodeNode is the decode process of processSetup: a socket device and
// a Decode endpoint under the certificates in dir, serving one prefill node;
// it reads and checks every verified request and, when stdin closes, prints
// "ok N" (N requests read, none wrong) or what went wrong, and exits.
func serveDecodeNode(dir string, pageBytes, pages, window int, stdout, stderr io.Writer) int {
	tc, err := pki.Load(filepath.Join(dir, pki.CertFile("decode")), filepath.Join(dir, pki.KeyFile("decode")), filepath.Join(dir, pki.CAFile))
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	dev, err := socket.Listen("tcp", "127.0.0.1:0", socket.Config{TLS: tc})
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	defer dev.Close()
	d, err := transfer.NewDecode(dev, transfer.DecodeConfig{Pages: 2 * window * pages, PageTokens: benchPageTokens, PageBytes: pageBytes,
		Timeout: time.Minute})
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	defer d.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go d.Serve(ctx, ln, transfer.SetupConfig{Name: "decode", TLS: tc})
	go d.Run(ctx)
	var (
		mu      sync.Mutex
		read    int
		problem error
	)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for {
			select {
			case <-ctx.Done():
				return
			case <-d.Notify():
			}
			for _, ev := range d.Events() {
				var err error
				switch {
				case ev.Kind == transfer.Verified:
					err = readMarked(d, ev.Request)
				case ev.Err != nil:
					err = fmt.Errorf("request %d: %w", ev.Request, ev.Err)
				}
				mu.Lock()
				if err != nil && problem == nil {
					problem = err
				}
				if ev.Kind == transfer.Outcome && ev.Err == nil {
					read++
				}
				mu.Unlock()
			}
		}
	}()
	fmt.Fprintf(stdout, "listening %s\n", ln.Addr())
	// The prefill process says how many requests it handed off, then closes stdin.
	var want int
	fmt.Fscan(os.Stdin, &want)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Millisecond) {
		mu.Lock()
		n, bad := read, problem
		mu.Unlock()
		if n >= want || bad != nil || time.Now().After(deadline) {
			break
		}
	}
	cancel()
	<-watched
	if problem == nil && read < want {
		problem = fmt.Errorf("only %d of %d requests read", read, want)
	}
	if problem != nil {
		fmt.Fprintf(stdout, "failed after %d: %v\n", read, problem)
		return 1
	}
	fmt.Fprintf(stdout, "ok %d\n", read)
	return 0
}

// readMarked reads a verified request and checks every page's marker.
func readMarked(d *transfer.Decode, id protocol.RequestID) error {
	got, err := d.Acquire(id)
	if err != nil {
		return err
	}
	for i, ref := range got {
		page := d.Payload(ref.Page)
		if binary.LittleEndian.Uint64(page) != uint64(id) || binary.LittleEndian.Uint64(page[8:]) != uint64(i) {
			err = fmt.Errorf("request %d page %d holds another page's KV", id, i)
			break
		}
	}
	if ferr := d.Finish(id); err == nil {
		err = ferr
	}
	return err
}

package node

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"
)

// HTTPLimits bound what clients of the router's API can hold: every
// connection is closed within a bounded time whatever the client sends (or
// does not), and what a request may make the router allocate is bounded by
// the limits, not by what the client sends. A zero field takes its default;
// a negative one turns that bound off (tests show what it defends).
type HTTPLimits struct {
	// HeaderTimeout bounds reading a request's headers; 10 s by default.
	HeaderTimeout time.Duration
	// BodyTimeout bounds reading a request's body from the end of its
	// headers; 30 s by default. A body not in by then is a 408 and the
	// connection closes.
	BodyTimeout time.Duration
	// IdleTimeout bounds a keep-alive connection between requests; 60 s by
	// default.
	IdleTimeout time.Duration
	// WriteTimeout bounds each write of an answer to its client: the whole
	// of a response, or one event of a stream (a stream may last as long
	// as its generation; a client that stops reading may not hold it). 30 s
	// by default. Past it the connection is closed and the request
	// cancelled on both legs, as if the client had gone.
	WriteTimeout time.Duration
	// MaxHeaderBytes bounds a request's headers; 64 KiB by default.
	MaxHeaderBytes int
	// MaxBodyBytes bounds a request's body (the JSON decoder holds at most
	// this much); 1 MiB by default. A longer body is a 400.
	MaxBodyBytes int64
	// MaxConns bounds the connections open at once (and so the goroutines
	// serving them); past it, new connections wait in the listen queue.
	// 1024 by default.
	MaxConns int
}

func (l *HTTPLimits) defaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&l.HeaderTimeout, 10*time.Second)
	def(&l.BodyTimeout, 30*time.Second)
	def(&l.IdleTimeout, 60*time.Second)
	def(&l.WriteTimeout, 30*time.Second)
	if l.MaxHeaderBytes == 0 {
		l.MaxHeaderBytes = 64 << 10
	}
	if l.MaxBodyBytes == 0 {
		l.MaxBodyBytes = 1 << 20
	}
	if l.MaxConns == 0 {
		l.MaxConns = 1024
	}
}

// on is d if the bound is on, else 0 (net/http's "no timeout").
func on(d time.Duration) time.Duration { return max(d, 0) }

// maxTenantLen bounds the tenant header: it is logged on every line of
// its request.
const maxTenantLen = 64

// checkTenant says why a tenant name is refused: longer than maxTenantLen,
// or a byte other than ASCII letters, digits and . _ - : (a name that
// cannot forge log fields or split lines).
func checkTenant(t string) error {
	if len(t) > maxTenantLen {
		return fmt.Errorf("%w: the %s header is %d bytes, at most %d", ErrBadRequest, TenantHeader, len(t), maxTenantLen)
	}
	for i := 0; i < len(t); i++ {
		c := t[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-' || c == ':') {
			return fmt.Errorf("%w: the %s header holds byte %#02x at offset %d (letters, digits and . _ - : only)", ErrBadRequest, TenantHeader, c, i)
		}
	}
	return nil
}

// bodyDeadline gives every request's body BodyTimeout from the end of its
// headers (net/http's ReadTimeout would also cut the connection's
// background read while the handler runs, cancelling a long request's
// context); decodeBody lifts it once the body is in.
func bodyDeadline(h http.Handler, limits HTTPLimits) http.Handler {
	if limits.BodyTimeout < 0 {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.NewResponseController(w).SetReadDeadline(time.Now().Add(limits.BodyTimeout))
		h.ServeHTTP(w, r)
	})
}

// writeDeadline gives each write of an answer WriteTimeout (net/http's
// WriteTimeout would bound the whole handler, and so a stream's length):
// the deadline is set as the handler writes its status line, its body, or
// flushes an event, so it measures the client's reading, not the
// generation. A write past it fails, and so do the ones after.
type writeDeadline struct {
	http.ResponseWriter
	rc *http.ResponseController
	d  time.Duration
}

func writeDeadlines(h http.Handler, limits HTTPLimits) http.Handler {
	if limits.WriteTimeout < 0 {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(&writeDeadline{ResponseWriter: w, rc: http.NewResponseController(w), d: limits.WriteTimeout}, r)
	})
}

func (w *writeDeadline) arm() { w.rc.SetWriteDeadline(time.Now().Add(w.d)) }

func (w *writeDeadline) WriteHeader(code int) {
	w.arm()
	w.ResponseWriter.WriteHeader(code)
}

func (w *writeDeadline) Write(b []byte) (int, error) {
	w.arm()
	return w.ResponseWriter.Write(b)
}

// FlushError is what http.ResponseController's Flush calls.
func (w *writeDeadline) FlushError() error {
	w.arm()
	return w.rc.Flush()
}

// Unwrap lets http.ResponseController reach the connection.
func (w *writeDeadline) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// serveAPI serves h on ln in plaintext HTTP under limits until ctx ends,
// then shuts down, giving calls in flight a moment.
func serveAPI(ctx context.Context, ln net.Listener, h http.Handler, limits HTTPLimits, log *slog.Logger) error {
	srv := &http.Server{Handler: bodyDeadline(writeDeadlines(h, limits), limits), ReadHeaderTimeout: on(limits.HeaderTimeout),
		IdleTimeout: on(limits.IdleTimeout), MaxHeaderBytes: max(limits.MaxHeaderBytes, 0),
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	if limits.IdleTimeout < 0 {
		// net/http falls back to ReadTimeout, then to no bound at all.
		srv.IdleTimeout = 0
	}
	if limits.MaxConns > 0 {
		ln = &limitListener{Listener: ln, slots: make(chan struct{}, limits.MaxConns), closed: make(chan struct{})}
	}
	return serveUntil(ctx, srv, ln)
}

// limitListener holds at most cap(slots) connections open: Accept waits for
// a slot, and a connection's Close frees it.
type limitListener struct {
	net.Listener
	slots     chan struct{}
	closeOnce sync.Once
	closed    chan struct{}
}

func (l *limitListener) Accept() (net.Conn, error) {
	select {
	case l.slots <- struct{}{}:
	case <-l.closed:
		return nil, net.ErrClosed
	}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.slots
		return nil, err
	}
	return &limitConn{Conn: c, release: func() { <-l.slots }}, nil
}

func (l *limitListener) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

type limitConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

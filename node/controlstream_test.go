package node

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// The control API's streamed answer (handleStream, controlClient.stream),
// here over plaintext HTTP/1.1 (TLS deployments use HTTP/2): each frame
// reaches the caller while the handler is still running (the handler goes
// on only once the caller has the first); a failure after the first frame
// is the last frame, with its identity; a failure before any frame is the
// usual error answer; a stream that breaks off before its end is
// ErrUnreachable; a malformed frame is ErrPeerFailed, not a broken node.
func TestControlStreamDeliversEachFrameAtOnce(t *testing.T) {
	s := newControlServer(Security{Insecure: true}, nil, quietLog())
	// Each call's release, made before the server runs (read-only after).
	release := map[protocol.RequestID]chan struct{}{1: make(chan struct{}), 2: make(chan struct{}), 6: make(chan struct{})}
	handleStream(s, "/control/v1/frames", func(ctx context.Context, in *cancelCall, send func(legAnswer) error) error {
		if err := send(legAnswer{Tokens: []int{1}}); err != nil {
			return err
		}
		select {
		case <-release[in.ID]:
		case <-ctx.Done():
			return ctx.Err()
		}
		if err := send(legAnswer{Tokens: []int{2, 3}}); err != nil {
			return err
		}
		if in.ID == 2 {
			return fmt.Errorf("%w: after two frames", protocol.ErrTagMismatch)
		}
		return nil
	})
	handleStream(s, "/control/v1/refused", func(context.Context, *cancelCall, func(legAnswer) error) error {
		return fmt.Errorf("%w: before any frame", protocol.ErrTokenMismatch)
	})
	s.mux.HandleFunc("/control/v1/broken", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", frameType)
		fmt.Fprintln(w, `{"tokens":[1]}`)
	})
	s.mux.HandleFunc("/control/v1/malformed", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", frameType)
		fmt.Fprintln(w, `{"tokens":["a"]}`)
	})
	srv := httptest.NewServer(s.mux)
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	c := newControlClient(Security{Insecure: true})
	defer c.close()
	for _, id := range []protocol.RequestID{1, 2} {
		var got [][]int
		err := c.stream(context.Background(), "n", addr, "/control/v1/frames", cancelCall{ID: id}, func(f legAnswer) error {
			got = append(got, f.Tokens)
			if len(got) == 1 {
				close(release[id])
			}
			return nil
		})
		if fmt.Sprint(got) != "[[1] [2 3]]" || (id == 1) != (err == nil) || (id == 2) != errors.Is(err, protocol.ErrTagMismatch) {
			t.Fatalf("call %d: frames %v, err %v", id, got, err)
		}
	}
	frames := 0
	count := func(legAnswer) error { frames++; return nil }
	if err := c.stream(context.Background(), "n", addr, "/control/v1/refused", cancelCall{ID: 3}, count); !errors.Is(err, protocol.ErrTokenMismatch) || frames != 0 {
		t.Fatalf("refused: %v after %d frames", err, frames)
	}
	if err := c.stream(context.Background(), "n", addr, "/control/v1/broken", cancelCall{ID: 4}, count); !errors.Is(err, ErrUnreachable) || frames != 1 {
		t.Fatalf("broken off: %v after %d frames", err, frames)
	}
	if err := c.stream(context.Background(), "n", addr, "/control/v1/malformed", cancelCall{ID: 5}, count); !errors.Is(err, protocol.ErrPeerFailed) || errors.Is(err, ErrUnreachable) || frames != 1 {
		t.Fatalf("malformed: %v after %d frames", err, frames)
	}
	// A caller's refusal of a frame ends the call with its error.
	stop := errors.New("too many")
	if err := c.stream(context.Background(), "n", addr, "/control/v1/frames", cancelCall{ID: 6}, func(legAnswer) error { return stop }); !errors.Is(err, stop) {
		t.Fatalf("a refused frame: %v", err)
	}
}

// The router tells a decode node which life of a prefill node is lost. A
// decode node of wire version 3, whose record names no wire version and
// whose control API refuses the life (an unknown field), is told without
// it, as it was then: its cut by name is still the fence during a rolling
// upgrade.
func TestAPeerLostCallNamesTheLifeOnlyToANodeThatKnowsLives(t *testing.T) {
	s := newControlServer(Security{Insecure: true}, nil, quietLog())
	var mu sync.Mutex
	var got []string
	handle(s, "/new"+pathPeerLost, func(_ context.Context, c *peerLostCall) (any, error) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, fmt.Sprintf("new %s %d", c.Peer, c.Incarnation))
		return struct{}{}, nil
	})
	type oldPeerLostCall struct {
		Peer string `json:"peer"`
	}
	handle(s, "/old"+pathPeerLost, func(_ context.Context, c *oldPeerLostCall) (any, error) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, "old "+c.Peer)
		return struct{}{}, nil
	})
	srv := httptest.NewServer(s.mux)
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	c := newControlClient(Security{Insecure: true})
	defer c.close()
	peer := Member{Name: "prefill-0", Incarnation: 42}
	// The path carries the node's version here: the prefix stands in for
	// an address.
	for _, version := range []string{"new", "old"} {
		node := Member{Name: "decode-0", Control: addr + "/" + version, Wire: protocol.Version}
		if version == "old" {
			node.Wire = 0 // published none
		}
		if err := tellPeerLost(context.Background(), c, node, peer); err != nil {
			t.Fatalf("%s decode node: %v", version, err)
		}
	}
	if want := "[new prefill-0 42 old prefill-0]"; fmt.Sprint(got) != want {
		t.Fatalf("the decode nodes were told %v, want %s", got, want)
	}
}

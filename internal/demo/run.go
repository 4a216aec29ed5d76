package demo

import (
	"context"
	"sync"
	"time"
)

// Client sends one request to the deployment and returns what the client
// got: the generated tokens and text of a success, or the error.
type Client interface {
	Complete(ctx context.Context, r Request) (tokens []int, text string, err error)
}

// CachedClient is a Client that also says how many of the prompt's tokens
// the deployment read from its prefix cache (usage's cached_tokens).
type CachedClient interface {
	CompleteCached(ctx context.Context, r Request) (tokens []int, text string, cached int, err error)
}

// Classify names a failure's outcome and reason (the deployment's closed set).
type Classify func(err error) (Kind, string)

// Run sends every request of w through c from concurrency clients at once.
// A request with Disconnect has its context cancelled that long after it was
// sent: the client goes away mid-transfer. progress, if not nil, is called
// once per finished request. Outcomes come back in request order.
func Run(ctx context.Context, w Workload, c Client, classify Classify, concurrency int, progress func()) []Outcome {
	outs := make([]Outcome, len(w.Requests))
	next := make(chan int)
	start := time.Now()
	var wg sync.WaitGroup
	for range max(1, concurrency) {
		wg.Go(func() {
			for i := range next {
				outs[i] = one(ctx, w.Requests[i], c, classify, start)
				if progress != nil {
					progress()
				}
			}
		})
	}
	for i := range w.Requests {
		select {
		case next <- i:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			for j := i; j < len(w.Requests); j++ {
				outs[j] = Outcome{Request: w.Requests[j], Kind: Cancelled, Reason: "cancelled", Err: runStopped + " before the request was sent"}
			}
			break
		}
	}
	close(next)
	wg.Wait()
	return outs
}

// runStopped starts the message of a request the run never sent.
const runStopped = "demo: the run was stopped"

func one(ctx context.Context, r Request, c Client, classify Classify, runStart time.Time) Outcome {
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if r.Disconnect > 0 {
		t := time.AfterFunc(r.Disconnect, cancel)
		defer t.Stop()
	}
	start := time.Now()
	var tokens []int
	var text string
	var cached int
	var err error
	if cc, ok := c.(CachedClient); ok {
		tokens, text, cached, err = cc.CompleteCached(rctx, r)
	} else {
		tokens, text, err = c.Complete(rctx, r)
	}
	o := Outcome{Request: r, Latency: time.Since(start), Cached: cached, Sent: start.Sub(runStart), Ended: time.Since(runStart)}
	if err != nil {
		o.Kind, o.Reason = classify(err)
		o.Err = err.Error()
		return o
	}
	o.Kind, o.Tokens, o.Text = OK, tokens, text
	return o
}

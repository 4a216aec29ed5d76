// Package llama is the engine's transformer: a decoder-only model in the llama
// architecture (RMSNorm, rotary positions, multi-head attention with grouped
// key/value heads, SwiGLU feed-forward), its weights, and where they come from.
//
// # Weights
//
// Config is the architecture (llama2.c's seven header fields, plus RotaryDims
// for partial rotary positions). Weights holds every matrix as float32 in
// llama2.c's order and orientation: a matrix W of shape (out, in) is row-major,
// so out[i] = Σ_j W[i*in+j]·x[j].
//
// Two sources, one reader and one writer:
//   - a checkpoint in llama2.c's format (ReadCheckpoint, WriteCheckpoint): a
//     header of seven int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
//     vocab_size, seq_len; a negative vocab_size means the classifier is not
//     shared with the token embedding), then the float32 arrays, then the
//     legacy rotary tables llama2.c's exporter writes and its reader skips. A
//     checkpoint made by llama2.c's own tools, such as stories15M.bin, runs
//     unchanged. Its tokenizer.bin is read by ReadTokenizer (llama2.c's layout:
//     max_token_length, then per token a float32 score, an int32 length and
//     the bytes) and encoded with llama2.c's BPE;
//   - the built-in model (Builtin): deterministic weights from a seed, a byte
//     vocabulary, written and read through the same checkpoint code. Its
//     weights are constructed, not trained, so that it copies: an induction
//     head continues any text that already occurred in what it attends over.
//     KV read from another request's pages therefore puts that request's text,
//     its canary, into the output (docs/engine.md).
//
// A model that is not llama2.c's (partial rotary) carries a small trailer
// after the arrays; llama2.c ignores it.
//
// # Sampling
//
// Sampler picks the next token from logits: greedy at temperature 0, else
// seeded sampling with temperature and top-p, so a seed replays a generation.
//
// The forward pass itself is a backend's job (package backend).
package llama

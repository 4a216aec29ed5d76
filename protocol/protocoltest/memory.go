package protocoltest

import (
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/protocol/checksum"
)

// Memory is a node's KV pages: a payload and a tag record slot per page. It
// is both a Sender's SourceMemory and a Receiver's PageMemory.
type Memory struct {
	payloads, tags [][]byte
}

// NewMemory returns pages of pageBytes zero bytes each, with zeroed (torn)
// tag records.
func NewMemory(pages, pageBytes int) *Memory {
	m := &Memory{}
	for range pages {
		m.payloads = append(m.payloads, make([]byte, pageBytes))
		m.tags = append(m.tags, make([]byte, protocol.TagSize))
	}
	return m
}

// Tenant is the request that used decode pages before a test: pages are
// never zeroed between requests, so they start with its KV and a valid tag
// record for it.
const Tenant = protocol.RequestID(1 << 40)

// FillTenant writes an earlier tenant's KV into every page, each with a tag
// record that verifies for Tenant under key (the tenant came over that
// queue pair): a read of a page nobody wrote for the reader finds plausible,
// checksummed, foreign KV.
func (m *Memory) FillTenant(key *protocol.TagKey) {
	for i, kv := range m.payloads {
		for j := range kv {
			kv[j] = byte(0xE0 ^ i ^ j)
		}
		copy(m.tags[i], protocol.Tag{Request: Tenant, Index: uint32(i), Tokens: 1, Sum: checksum.Sum(kv)}.Append(nil, key))
	}
}

// Len is the number of pages.
func (m *Memory) Len() int { return len(m.payloads) }

// Page implements protocol.SourceMemory.
func (m *Memory) Page(p uint32) []byte { return m.payloads[p] }

// Payload implements protocol.PageMemory.
func (m *Memory) Payload(p uint32) []byte { return m.payloads[p] }

// TagRecord implements protocol.PageMemory.
func (m *Memory) TagRecord(p uint32) []byte { return m.tags[p] }

// Pattern is request id's KV for page index: recognisable, so that a read of
// anything else is caught byte for byte.
func Pattern(id protocol.RequestID, index, size int) []byte {
	b := make([]byte, size)
	FillPattern(b, id, index)
	return b
}

// FillPattern writes Pattern(id, index, len(b)) into b.
func FillPattern(b []byte, id protocol.RequestID, index int) {
	for j := range b {
		b[j] = byte(uint64(id)*131 + uint64(index)*17 + uint64(j))
	}
}

// HoldsPattern says whether b is Pattern(id, index, len(b)).
func HoldsPattern(b []byte, id protocol.RequestID, index int) bool {
	for j := range b {
		if b[j] != byte(uint64(id)*131+uint64(index)*17+uint64(j)) {
			return false
		}
	}
	return true
}

// FillPrompt writes the KV of page index of prompt (at pageTokens tokens a
// page) into b: a function of the prompt's tokens up to the end of the page
// and nothing else, as a model's KV is, so that requests sharing a prefix
// compute the same bytes for its pages.
func FillPrompt(b []byte, prompt []uint32, pageTokens, index int) {
	seed := promptSeed(prompt, pageTokens, index)
	for j := range b {
		b[j] = byte(seed>>(8*(j%8))) ^ byte(j)
	}
}

// HoldsPrompt says whether b is what FillPrompt writes for page index.
func HoldsPrompt(b []byte, prompt []uint32, pageTokens, index int) bool {
	seed := promptSeed(prompt, pageTokens, index)
	for j := range b {
		if b[j] != byte(seed>>(8*(j%8)))^byte(j) {
			return false
		}
	}
	return true
}

// promptSeed is an FNV-1a hash of the prompt's tokens up to the end of page
// index, and the index.
func promptSeed(prompt []uint32, pageTokens, index int) uint64 {
	h := uint64(14695981039346656037)
	end := min(len(prompt), (index+1)*pageTokens)
	for _, t := range prompt[:end] {
		for k := range 4 {
			h ^= uint64(byte(t >> (8 * k)))
			h *= 1099511628211
		}
	}
	h ^= uint64(index)
	return h * 1099511628211
}

// SharedPrompt is request id's prompt of tokens tokens whose first shared
// tokens are the same for every request (a system prompt, an earlier turn)
// and the rest its own.
func SharedPrompt(id protocol.RequestID, tokens, shared int) []uint32 {
	p := make([]uint32, tokens)
	for i := range p {
		if i < shared {
			p[i] = uint32(i)
		} else {
			p[i] = uint32(id)<<16 | uint32(i)
		}
	}
	return p
}

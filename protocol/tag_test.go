package protocol

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"testing"

	"github.com/kvhandoff/kvhandoff/protocol/checksum"
)

func pageWithTag(size int, t Tag, key *TagKey) (payload, record []byte) {
	payload = make([]byte, size)
	for i := range payload {
		payload[i] = byte(i*31 + int(t.Index))
	}
	t.Sum = key.Sum(payload)
	return payload, t.Append(nil, key)
}

var want = Expect{Request: 42, Index: 3, Epoch: 9, Tokens: 16}

// strangerKey is a key made from another secret: anyone who is not this queue
// pair's sender.
var strangerKey = mustTagKey(bytes.Repeat([]byte{0xa5}, TagKeySecretSize), SumXXH3)

func TestTagRoundTrips(t *testing.T) {
	in := Tag{Request: 42, Epoch: 9, Index: 3, Tokens: 16, Sum: 0xfeed}
	rec := in.Append(nil, testKey)
	if len(rec) != TagSize {
		t.Fatalf("%d bytes", len(rec))
	}
	out, err := ParseTag(rec, testKey)
	if err != nil || out != in {
		t.Fatalf("%+v %v", out, err)
	}
}

func TestVerifyPageAcceptsTheGrantedPage(t *testing.T) {
	for _, key := range []*TagKey{testKey, keyedTestKey} {
		payload, rec := pageWithTag(4096, Tag{Request: 42, Epoch: 9, Index: 3, Tokens: 16}, key)
		if err := VerifyPage(rec, payload, want, key); err != nil {
			t.Fatalf("%v: %v", key.PayloadSum(), err)
		}
	}
}

// A page whose record was written for anything else is another request's page.
func TestVerifyPageRejectsForeignStaleOrMisplacedRecords(t *testing.T) {
	for name, tag := range map[string]Tag{
		"another request":   {Request: 41, Epoch: 9, Index: 3, Tokens: 16},
		"an older epoch":    {Request: 42, Epoch: 8, Index: 3, Tokens: 16},
		"another index":     {Request: 42, Epoch: 9, Index: 2, Tokens: 16},
		"other token count": {Request: 42, Epoch: 9, Index: 3, Tokens: 1},
	} {
		payload, rec := pageWithTag(4096, tag, testKey)
		err := VerifyPage(rec, payload, want, testKey)
		wantErr := ErrTagMismatch
		if name == "other token count" {
			wantErr = ErrTokenMismatch
		}
		if !errors.Is(err, wantErr) {
			t.Errorf("%s: got %v, want %v", name, err, wantErr)
		}
	}
}

func TestVerifyPageRejectsCorruptPayloadAndGarbageRecords(t *testing.T) {
	payload, rec := pageWithTag(4096, Tag{Request: 42, Epoch: 9, Index: 3, Tokens: 16}, testKey)
	payload[1000] ^= 0x10
	if err := VerifyPage(rec, payload, want, testKey); !errors.Is(err, ErrChecksumMismatch) {
		t.Fatalf("corrupted payload: %v", err)
	}
	payload[1000] ^= 0x10
	for i := 0; i < TagSize; i++ { // any damaged byte of the record
		for _, flip := range []byte{0x01, 0x80} {
			bad := bytes.Clone(rec)
			bad[i] ^= flip
			err := VerifyPage(bad, payload, want, testKey)
			// The header says whether this is a record at all; past it, the
			// MAC fails: not what this queue pair's sender wrote.
			wantErr := ErrTagMismatch
			if i < 8 && !(i == 5 && flip == 0x01) { // byte 5 flipped to 1 is another valid payload sum kind
				wantErr = ErrTagMalformed
			}
			if !errors.Is(err, wantErr) {
				t.Fatalf("record byte %d ^ %#x: %v, want %v", i, flip, err, wantErr)
			}
		}
	}
	if err := VerifyPage(make([]byte, TagSize), payload, want, testKey); !errors.Is(err, ErrTagMalformed) {
		t.Fatalf("a zeroed record: %v", err)
	}
	if err := VerifyPage(rec[:TagSize-1], payload, want, testKey); !errors.Is(err, ErrTagMalformed) {
		t.Fatalf("a short record: %v", err)
	}
	if err := VerifyPage(rec, payload, want, nil); !errors.Is(err, ErrNoPeerKey) {
		t.Fatalf("no key: %v", err)
	}
}

// A stranger (no key) that writes a well-formed record for exactly the
// expected page, with the right payload sum, fails verification with
// ErrTagMismatch; so does last version's unkeyed record, which anyone could
// compute.
func TestForgedRecordFailsWithoutTheKey(t *testing.T) {
	payload, forged := pageWithTag(4096, Tag{Request: 42, Epoch: 9, Index: 3, Tokens: 16}, strangerKey)
	if err := VerifyPage(forged, payload, want, strangerKey); err != nil {
		t.Fatalf("the forgery is well-formed under its own key: %v", err)
	}
	if err := VerifyPage(forged, payload, want, testKey); !errors.Is(err, ErrTagMismatch) {
		t.Fatalf("a stranger's record: %v, want ErrTagMismatch", err)
	}
	// Version 1: the same fields, closed by an XXH3 of the 40 bytes before.
	v1 := append([]byte("KVTG"), 1, 0, 0, 0)
	v1 = binary.BigEndian.AppendUint64(v1, 42)
	v1 = binary.BigEndian.AppendUint64(v1, 9)
	v1 = binary.BigEndian.AppendUint32(v1, 3)
	v1 = binary.BigEndian.AppendUint32(v1, 16)
	v1 = binary.BigEndian.AppendUint64(v1, checksum.Sum(payload))
	v1 = binary.BigEndian.AppendUint64(v1, checksum.Sum(v1))
	if err := VerifyPage(v1, payload, want, testKey); !errors.Is(err, ErrTagMalformed) {
		t.Fatalf("an unkeyed record: %v", err)
	}
	// The stranger's best try under version 2's layout: its record with this
	// queue pair's MAC bytes guessed as its own.
	copy(forged[tagMACOffset:], rec8(Tag{Request: 42, Epoch: 9, Index: 3, Tokens: 16, Sum: checksum.Sum(payload)}.Append(nil, strangerKey)))
	if err := VerifyPage(forged, payload, want, testKey); !errors.Is(err, ErrTagMismatch) {
		t.Fatalf("a guessed MAC: %v", err)
	}
}

func rec8(rec []byte) []byte { return rec[tagMACOffset:TagSize] }

// The end-to-end forgery of issue 12: a stranger WRITEs its own KV and a
// well-formed record over a granted page before the sender's Done; the
// receiver fails the request with ErrTagMismatch and hands nothing to read.
func TestReceiverRefusesAStrangersPage(t *testing.T) {
	mem := newLazyMemory(64)
	r := boundsReceiver(t, ReceiverConfig{Pages: 4, PageTokens: 4, Memory: mem})
	s := boundsSender(t, SenderConfig{Pages: 4, PageTokens: 4, Memory: newLazyMemory(64)})
	if _, err := s.Submit(7, 1, 8); err != nil {
		t.Fatal(err)
	}
	s.Computed(7)
	for _, op := range s.Effects().Ops {
		if err := r.Step(1, op.Msg, testNow); err != nil {
			t.Fatal(err)
		}
	}
	for _, snd := range r.Effects().Sends {
		if err := s.Step(1, snd.Msg); err != nil {
			t.Fatal(err)
		}
	}
	var done Message
	for _, op := range s.Effects().Ops {
		if w := op.Write; w != nil {
			copy(mem.Payload(w.Remote.Page), bytes.Repeat([]byte{byte(w.Index)}, 64))
			copy(mem.TagRecord(w.Remote.Page), w.Tag)
			if w.Index == 1 { // the stranger's WRITEs land after the sender's
				kv := bytes.Repeat([]byte("ATTACKER"), 8)
				copy(mem.Payload(w.Remote.Page), kv)
				copy(mem.TagRecord(w.Remote.Page), Tag{Request: 7, Epoch: w.Remote.Epoch, Index: 1, Tokens: 4, Sum: checksum.Sum(kv)}.Append(nil, strangerKey))
			}
			continue
		}
		done = op.Msg
	}
	if err := r.Step(1, done, testNow); err != nil {
		t.Fatal(err)
	}
	e := r.Effects()
	if len(e.Verified) != 0 || len(e.Outcomes) != 1 || !errors.Is(e.Outcomes[0].Err, ErrTagMismatch) {
		t.Fatalf("verified %v, outcomes %v: want a tag mismatch and nothing to read", e.Verified, e.Outcomes)
	}
	if _, err := r.Acquire(7); err == nil {
		t.Fatal("the forged request can be read")
	}
}

// Without a key for the peer, neither side starts a request: the engine that
// forgot to hand one over finds out at the first request, not never.
func TestNoKeyForThePeerRefusesTheRequest(t *testing.T) {
	none := func(PeerID) *TagKey { return nil }
	if _, err := NewSender(SenderConfig{Pages: 1, PageTokens: 1, Memory: newLazyMemory(1)}); err == nil {
		t.Fatal("a sender without TagKeys")
	}
	if _, err := NewReceiver(ReceiverConfig{Pages: 1, PageTokens: 1, Memory: newLazyMemory(1), Region: func(uint32) (uint64, uint32) { return 0, 0 }}); err == nil {
		t.Fatal("a receiver without TagKeys")
	}
	s := boundsSender(t, SenderConfig{Pages: 4, PageTokens: 1, TagKeys: none})
	if _, err := s.Submit(1, 2, 1); !errors.Is(err, ErrNoPeerKey) {
		t.Fatalf("Submit to a peer without a key: %v", err)
	}
	if s.Pool().Free() != 4 || s.Records() != 0 || len(s.Effects().Ops) != 0 {
		t.Fatal("a refused Submit changed state")
	}
	r := boundsReceiver(t, ReceiverConfig{Pages: 4, PageTokens: 1, TagKeys: none})
	if err := r.Step(2, &Bootstrap{Request: 1, Tokens: 1}, testNow); err != nil {
		t.Fatal(err)
	}
	e := r.Effects()
	if len(e.Outcomes) != 1 || !errors.Is(e.Outcomes[0].Err, ErrNoPeerKey) || !errors.Is(e.Outcomes[0].Err, ErrRejected) {
		t.Fatalf("outcomes %v", e.Outcomes)
	}
	if len(e.Sends) != 1 || r.Records() != 0 || r.Pool().Free() != 4 {
		t.Fatalf("sends %v, %d records, %d free", e.Sends, r.Records(), r.Pool().Free())
	}
}

// The keyed payload digest is no function a stranger can compute: not XXH3,
// and another secret gives another digest. A record whose payload sum is of
// another kind than the queue pair's fails.
func TestKeyedPayloadDigest(t *testing.T) {
	p := bytes.Repeat([]byte("kv"), 2048)
	other := mustTagKey(bytes.Repeat([]byte{1}, TagKeySecretSize), SumKeyed)
	if keyedTestKey.Sum(p) == checksum.Sum(p) || keyedTestKey.Sum(p) == other.Sum(p) {
		t.Fatal("the keyed digest does not depend on the key")
	}
	if testKey.Sum(p) != checksum.Sum(p) {
		t.Fatal("SumXXH3 is not checksum.Sum")
	}
	payload, rec := pageWithTag(4096, Tag{Request: 42, Epoch: 9, Index: 3, Tokens: 16}, testKey)
	// Same secret, but the sum is XXH3 and this queue pair requires the keyed
	// digest: whatever the header says, the MAC key is another.
	if err := VerifyPage(rec, payload, want, keyedTestKey); !errors.Is(err, ErrTagMismatch) {
		t.Fatalf("an XXH3 record on a keyed queue pair: %v", err)
	}
	rec[5] = byte(SumKeyed)
	if err := VerifyPage(rec, payload, want, keyedTestKey); !errors.Is(err, ErrTagMismatch) {
		t.Fatalf("an XXH3 record on a keyed queue pair: %v", err)
	}
	if _, err := NewTagKey(make([]byte, 16), SumXXH3); err == nil {
		t.Fatal("a short secret")
	}
	if _, err := NewTagKey(make([]byte, TagKeySecretSize), 7); err == nil {
		t.Fatal("an unknown payload sum")
	}
}

var keyedTestKey = mustTagKey(bytes.Repeat([]byte{0x5a}, TagKeySecretSize), SumKeyed)

func unhex(s string) []byte {
	b, err := hex.DecodeString(s)
	if err != nil {
		panic(err)
	}
	return b
}

// AES-CMAC against RFC 4493's test vectors (section 4): the subkeys and the
// four examples.
func TestCMACMatchesRFC4493(t *testing.T) {
	k, err := newCMAC(unhex("2b7e151628aed2a6abf7158809cf4f3c"))
	if err != nil {
		t.Fatal(err)
	}
	if got := hex.EncodeToString(k.k1[:]); got != "fbeed618357133667c85e08f7236a8de" {
		t.Errorf("K1 = %s", got)
	}
	if got := hex.EncodeToString(k.k2[:]); got != "f7ddac306ae266ccf90bc11ee46d513b" {
		t.Errorf("K2 = %s", got)
	}
	msg := unhex("6bc1bee22e409f96e93d7e117393172a" + "ae2d8a571e03ac9c9eb76fac45af8e51" +
		"30c81c46a35ce411e5fbc1191a0a52ef" + "f69f2445df4f9b17ad2b417be66c3710")
	for _, v := range []struct {
		n   int
		mac string
	}{
		{0, "bb1d6929e95937287fa37d129b756746"},
		{16, "070a16b46b4d4144f79bdd9dd04a287c"},
		{40, "dfa66747de9ae63030ca32611497c827"},
		{64, "51f0bebf7e3b9d92fc49741779363cfe"},
	} {
		var x [16]byte
		k.cmac(msg[:v.n], &x)
		if got := hex.EncodeToString(x[:]); got != v.mac {
			t.Errorf("CMAC of %d bytes = %s, want %s", v.n, got, v.mac)
		}
	}
}

// FuzzParseTag: any input yields a record or a typed error, never a panic.
// The fuzzer's bytes go in twice: as they are (almost always refused), and
// with the MAC recomputed under the key over the fields it covers, so that
// the parse gets past the MAC to the success branch; a record that parses
// re-encodes to the same bytes.
func FuzzParseTag(f *testing.F) {
	_, rec := pageWithTag(64, Tag{Request: 1, Epoch: 2, Index: 3, Tokens: 4}, testKey)
	f.Add(rec)
	f.Add(make([]byte, TagSize))
	f.Add(rec[:10])
	f.Fuzz(func(t *testing.T, b []byte) {
		check := func(b []byte) (Tag, error) {
			tag, err := ParseTag(b, testKey)
			if err != nil {
				if !errors.Is(err, ErrTagMalformed) && !errors.Is(err, ErrTagMismatch) && !errors.Is(err, ErrChecksumMismatch) {
					t.Fatalf("untyped error %v", err)
				}
				return tag, err
			}
			if b[5] != byte(testKey.sum) {
				t.Fatalf("accepted a record of payload sum %d", b[5])
			}
			if !bytes.Equal(tag.Append(nil, testKey), b[:TagSize]) {
				t.Fatal("re-encoding differs")
			}
			return tag, nil
		}
		check(b)
		if len(b) < TagSize {
			return
		}
		fixed := bytes.Clone(b[:TagSize])
		var x [16]byte
		testKey.cmac(fixed[tagFieldsOffset:tagMACOffset], &x)
		copy(fixed[tagMACOffset:], x[:8])
		tag, err := check(fixed)
		// With a valid MAC only the header can fail: what it says decides.
		header := [4]byte(fixed[:4]) == tagMagic && fixed[4] == tagVersion && fixed[6]|fixed[7] == 0
		switch {
		case !header && !errors.Is(err, ErrTagMalformed):
			t.Fatalf("a bad header: %v", err)
		case header && fixed[5] == byte(SumXXH3) && err != nil:
			t.Fatalf("a record with a valid MAC: %v", err)
		case header && fixed[5] != byte(SumXXH3) && err == nil:
			t.Fatalf("a record of payload sum %d accepted by an XXH3 queue pair", fixed[5])
		case err == nil:
			// The record verifies exactly for the page it names.
			exp := Expect{Request: tag.Request, Index: tag.Index, Epoch: tag.Epoch, Tokens: tag.Tokens}
			if CheckTag(tag, exp) != nil {
				t.Fatal("a record does not match its own fields")
			}
			exp.Epoch++
			if !errors.Is(CheckTag(tag, exp), ErrTagMismatch) {
				t.Fatal("a record matches another epoch")
			}
		}
	})
}

var sinkErr error

// BenchmarkVerify measures, per page size and in the same run: a plain copy of
// the page (the baseline), the tag record's check as it was (an XXH3 of its
// 40 bytes, unkeyed: "v1"), the MAC that replaced it (AES-CMAC) and the one
// not chosen (HMAC-SHA256), the full check with XXH3 (parse, MAC, compare,
// payload checksum) and the full check with the keyed payload digest.
// Compare ns/op: the MAC's share of a page handoff is tag/cmac over copy plus
// full/xxh3.
func BenchmarkVerify(b *testing.B) {
	mac := hmac.New(sha256.New, make([]byte, 32))
	var macOut [sha256.Size]byte
	for _, size := range []int{4 << 10, 256 << 10, 4 << 20} {
		payload, rec := pageWithTag(size, Tag{Request: 42, Epoch: 9, Index: 3, Tokens: 16}, testKey)
		keyedPayload, keyedRec := pageWithTag(size, Tag{Request: 42, Epoch: 9, Index: 3, Tokens: 16}, keyedTestKey)
		dst := make([]byte, size)
		name := fmt.Sprintf("%dKiB", size>>10)
		b.Run("copy/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			for range b.N {
				copy(dst, payload)
			}
		})
		b.Run("tag/v1-xxh3/"+name, func(b *testing.B) {
			for range b.N {
				if checksum.Sum(rec[:40]) == 0 {
					sinkErr = ErrTagMalformed
				}
			}
		})
		b.Run("tag/cmac/"+name, func(b *testing.B) {
			var x [16]byte
			for range b.N {
				tag, err := parseTag(rec, testKey, &x)
				if err == nil {
					err = CheckTag(tag, want)
				}
				sinkErr = err
			}
		})
		b.Run("tag/hmac-sha256/"+name, func(b *testing.B) {
			for range b.N {
				mac.Reset()
				mac.Write(rec[:40])
				if out := mac.Sum(macOut[:0]); out[0] == 0 && out[1] == 0 {
					sinkErr = ErrTagMismatch
				}
			}
		})
		b.Run("full/xxh3/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			var x [16]byte
			for range b.N {
				sinkErr = verifyPage(rec, payload, want, testKey, &x)
			}
		})
		b.Run("full/keyed/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			var x [16]byte
			for range b.N {
				sinkErr = verifyPage(keyedRec, keyedPayload, want, keyedTestKey, &x)
			}
		})
	}
	if sinkErr != nil {
		b.Fatal(sinkErr)
	}
}

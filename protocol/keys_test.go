package protocol

import (
	"bytes"
	"time"
)

// testNow is the time of tests that need none in particular.
var testNow = time.Unix(0, 0)

// testKey is the tag key every queue pair of the package's tests shares; a
// stranger's key is any other.
var testKey = mustTagKey(bytes.Repeat([]byte{0x5a}, TagKeySecretSize), SumXXH3)

func testKeys(PeerID) *TagKey { return testKey }

func mustTagKey(secret []byte, sum PayloadSum) *TagKey {
	k, err := NewTagKey(secret, sum)
	if err != nil {
		panic(err)
	}
	return k
}

//go:build cuda

package cuda

import "testing"

// openTest opens the backend under test: the first GPU.
func openTest(t testing.TB) *Backend {
	t.Helper()
	b, err := New(0)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// device is the backend under test's device, in words.
func deviceName() string {
	n, err := DeviceName(0)
	if err != nil {
		return "cuda:0"
	}
	return n
}

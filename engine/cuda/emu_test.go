//go:build cudaemu && !cuda

package cuda

import (
	"regexp"
	"slices"
	"testing"
)

// Every kernel kernels.cu defines is one the backend names, and the emulator has each.
func TestEveryKernelIsNamedAndEmulated(t *testing.T) {
	var defined []string
	for _, m := range regexp.MustCompile(`extern "C" __global__ void (\w+)\(`).FindAllStringSubmatch(kernelsSource, -1) {
		defined = append(defined, m[1])
	}
	named := kernelNames[:]
	if !slices.Equal(slices.Sorted(slices.Values(defined)), slices.Sorted(slices.Values(named))) {
		t.Fatalf("kernels.cu defines %v, the backend names %v", defined, named)
	}
	d := NewEmulated().dev.(*emuDevice)
	for k, fn := range d.fns {
		if fn < 0 {
			t.Errorf("the emulator lacks kernel %s", kernelNames[k])
		}
	}
}

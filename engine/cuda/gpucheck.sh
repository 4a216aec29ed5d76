#!/usr/bin/env bash
# gpucheck.sh: the CUDA backend's checks on a real GPU, in one go.
#
#   engine/cuda/gpucheck.sh build   # here (no GPU needed): fetch CUDA headers and libraries, build
#                                   # engine/cuda/gpucheck.test with -tags cuda
#   engine/cuda/gpucheck.sh run     # on the GPU machine (H200, sm_90; needs only the driver's
#                                   # libcuda.so.1, no network, no Go): the tests, then the
#                                   # benchmarks, figures printed
#   engine/cuda/gpucheck.sh         # both, where one machine has the network and the GPU
#
# The tests are the ones CI runs on the emulator (tag cudaemu), now against the device: both
# backends give the same tokens, stale pages fail naming the page and are not written, page
# copies round-trip. The benchmarks print decode and prefill tokens/s of the stories15M shape
# on the CPU and CUDA backends (same run), and the page-copy kernel's bytes/s against
# cuMemcpyDtoD of the same bytes; then kvhandoff bench engine's JSON rows for both backends.
# The binaries are gitignored (*.test); carry them to the device.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=$here/gpucheck.test
cmdbin=$here/gpucheck-kvhandoff.test # the command built with -tags cuda (named *.test: gitignored)
mode=${1:-all}

build() {
	cd "$root"
	local cuda_env
	cuda_env=$(scripts/cuda-stubs.sh "${KVH_CUDA_DIR:-/tmp/kvh-cuda}")
	eval "$cuda_env"
	go test -tags cuda -c -o "$bin" ./engine/cuda
	go build -tags cuda -o "$cmdbin" ./cmd/kvhandoff
	echo "gpucheck: built $bin $cmdbin"
}

run() {
	[ -x "$bin" ] || { echo "gpucheck: $bin missing: run '$0 build' first" >&2; exit 2; }
	command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
	cd "$here"
	echo "--- tests on the GPU"
	"$bin" -test.v -test.count=1 -test.timeout 300s 2>&1 | grep -E '^(=== RUN|--- |PASS|FAIL|ok|panic)|_test.go' || { echo "gpucheck: tests FAILED"; exit 1; }
	echo "--- benchmarks (CPU and CUDA backends, same run)"
	"$bin" -test.run '^$' -test.bench . -test.benchtime "${KVH_BENCHTIME:-2s}" -test.timeout 300s
	echo "--- kvhandoff bench engine --backend cpu,cuda --json"
	"$cmdbin" bench engine --backend cpu,cuda --rounds 3 --json
	echo "gpucheck: done"
}

case $mode in
build) build ;;
run) run ;;
all) build && run ;;
*) echo "usage: $0 [build|run]" >&2; exit 2 ;;
esac

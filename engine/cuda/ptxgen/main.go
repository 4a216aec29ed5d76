//go:build nvrtc

// Command ptxgen compiles the CUDA backend's kernels (CUDA C) to PTX with NVRTC, ahead of time,
// so that a machine running the backend needs only its GPU driver's libcuda, not NVRTC.
//
// It imports gorgonia.org/cu/nvrtc alone, never gorgonia.org/cu, whose package init calls
// cuInit and exits on a machine without a GPU: NVRTC is a compiler library and runs anywhere.
// It sits behind the build tag nvrtc so that plain builds need no CUDA headers. Run it from
// engine/cuda with `go generate -tags cuda` (see engine/cuda/doc.go for the environment).
//
// Usage:
//
//	ptxgen -in kernels.cu -out kernels.ptx [-arch compute_90]
//	ptxgen -in kernels.cu -check kernels.ptx   # exit 1 if kernels.ptx is not what -in compiles to
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"

	"gorgonia.org/cu/nvrtc"
)

func main() {
	in := flag.String("in", "kernels.cu", "CUDA C source")
	out := flag.String("out", "", "PTX file to write")
	check := flag.String("check", "", "PTX file to compare with the compiled source instead of writing")
	arch := flag.String("arch", "compute_90", "virtual architecture (compute_90: H100/H200, sm_90)")
	flag.Parse()
	if (*out == "") == (*check == "") {
		fmt.Fprintln(os.Stderr, "ptxgen: give exactly one of -out and -check")
		os.Exit(2)
	}
	ptx, err := compile(*in, *arch)
	if err != nil {
		fmt.Fprintln(os.Stderr, "ptxgen:", err)
		os.Exit(1)
	}
	if *check != "" {
		have, err := os.ReadFile(*check)
		if err != nil {
			fmt.Fprintln(os.Stderr, "ptxgen:", err)
			os.Exit(1)
		}
		if !bytes.Equal(have, ptx) {
			fmt.Fprintf(os.Stderr, "ptxgen: %s is stale: it is not what %s compiles to; run go generate -tags cuda in engine/cuda\n", *check, *in)
			os.Exit(1)
		}
		return
	}
	if err := os.WriteFile(*out, ptx, 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "ptxgen:", err)
		os.Exit(1)
	}
}

// options are NVRTC's flags. No fast math: the backend must agree with the CPU backend to
// float32 rounding, not to an approximation of expf and division.
func options(arch string) []string {
	return []string{
		"--gpu-architecture=" + arch,
		"--std=c++14",
		"--fmad=true",
	}
}

func compile(path, arch string) ([]byte, error) {
	src, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	prog, err := nvrtc.CreateProgram(string(src), path)
	if err != nil {
		return nil, fmt.Errorf("create program: %w", err)
	}
	defer prog.Destroy()
	if err := prog.Compile(options(arch)...); err != nil {
		log, _ := prog.GetLog()
		return nil, fmt.Errorf("compile %s: %w\n%s", path, err, log)
	}
	ptx, err := prog.GetPTX()
	if err != nil {
		return nil, fmt.Errorf("get PTX: %w", err)
	}
	// NVRTC returns the PTX with its terminating NUL; the file holds the text alone.
	return bytes.TrimRight([]byte(ptx), "\x00"), nil
}

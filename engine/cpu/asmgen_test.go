package cpu

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// The committed kernels (kernels_amd64.s and its Go declarations) are what
// the generator, asmgen, writes: no hand edit of generated assembly, and no
// generator change left unapplied.
func TestCommittedAssemblyIsWhatTheGeneratorWrites(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command, which builds the generator: %v", err)
	}
	dir := t.TempDir()
	gen := filepath.Join(dir, "asmgen")
	build := exec.Command(goTool, "build", "-tags", "asmgen", "-o", gen, "./asmgen")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the generator (its module, avo, comes with go mod download): %v\n%s", err, out)
	}
	// Run where the files' names are the committed ones, as the generated
	// header records the command line.
	run := exec.Command(gen, "-out", "kernels_amd64.s", "-stubs", "kernels_amd64.go", "-pkg", "cpu")
	run.Dir = dir
	if out, err := run.CombinedOutput(); err != nil {
		t.Fatalf("running the generator: %v\n%s", err, out)
	}
	for _, name := range []string{"kernels_amd64.s", "kernels_amd64.go"} {
		want, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s is not what asmgen writes: run go generate ./engine/cpu", name)
		}
	}
}

// Package cuda is the engine's CUDA backend (build tag cuda), the only importer of
// gorgonia.org/cu in the module. Without the tag this package is empty, so a plain build
// links no CUDA library and needs no CUDA headers.
package cuda

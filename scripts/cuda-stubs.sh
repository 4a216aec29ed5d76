#!/usr/bin/env bash
# cuda-stubs.sh DIR [--nvrtc]
#
# Fetches what the CUDA backend (build tag cuda, engine/cuda) needs to compile and link on a
# machine without a GPU or a CUDA toolkit, from Debian's non-free CUDA 11.8 packages, into
# DIR, and prints the environment that uses them, for eval:
#
#   cuda_env=$(scripts/cuda-stubs.sh /tmp/kvh-cuda) && eval "$cuda_env"
#   go vet -tags cuda ./engine/...
#
# What it extracts (NVIDIA-licensed: fetched, never committed):
#   - cuda.h and nvrtc.h from nvidia-cuda-dev. That .deb is 774 MB and its stub libraries sit
#     at the very end of its 2.9 GB archive, so only the two headers are read, which stops the
#     decompression 13 MB in (about 20 s of CPU saved);
#   - libcuda.so to link against, from libcuda1 (the driver's user-space library, 3 MB): it
#     exports what the stub does, and linking needs nothing else of it;
#   - libnvrtc.so, from libnvrtc11.2, to link gorgonia.org/cu/nvrtc against.
# A binary built this way runs only where a GPU driver provides libcuda.so.1 at run time.
#
# With --nvrtc it also fetches libnvrtc-builtins11.8 and prints LD_LIBRARY_PATH for the NVRTC
# libraries, so that the PTX generator (engine/cuda/ptxgen) can run here; NVRTC is a compiler
# and needs no GPU. The driver library stays out of LD_LIBRARY_PATH.
#
# It touches no system apt configuration: the contrib and non-free components are read
# through a private sources list and package-list directory under DIR. A second run with the
# files already in DIR downloads nothing.
set -euo pipefail

dir=${1:?usage: cuda-stubs.sh DIR [--nvrtc]}
want_nvrtc=false
[ "${2:-}" = "--nvrtc" ] && want_nvrtc=true
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
multiarch=usr/lib/x86_64-linux-gnu
inc=$dir/usr/include
link=$dir/link            # libraries to link against
runtime=$dir/$multiarch   # NVRTC's libraries, to run the generator

have() { for f in "$@"; do [ -e "$f" ] || return 1; done; }

APT_READY=false
apt_private() {
	$APT_READY && return
	local a=$dir/apt suite
	mkdir -p "$a/lists/partial" "$a/cache/archives/partial" "$a/sources" "$a/debs"
	suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
	cat >"$a/sources/nonfree.sources" <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: $suite
Components: contrib non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
	APT_OPTS=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$a/sources"
		-o "Dir::State::Lists=$a/lists" -o "Dir::Cache=$a/cache" -o "Debug::NoLocking=1"
		-o "APT::Sandbox::User=root" -qq)
	apt-get "${APT_OPTS[@]}" update >&2
	APT_READY=true
}

fetch() {
	apt_private
	(cd "$dir/apt/debs" && apt-get "${APT_OPTS[@]}" download "$1" >&2)
	ls "$dir/apt/debs/$1"_*.deb
}

# extract PACKAGE PATH...: only the PATHs (as the archive names them), reading the archive
# only as far as the last of them.
extract() {
	local pkg=$1 deb
	shift
	deb=$(fetch "$pkg")
	# tar stops once it has every path (--occurrence); dpkg-deb then dies of SIGPIPE, which
	# is why the pipeline's status is not the test: the files are.
	dpkg-deb --fsys-tarfile "$deb" 2>/dev/null | tar -x -C "$dir" --occurrence=1 "$@" 2>/dev/null || true
	rm -f "$deb"
	for p in "$@"; do
		[ -e "$dir/$p" ] || { echo "cuda-stubs: $pkg has no $p" >&2; exit 1; }
	done
}

# extract_all PACKAGE: the whole (small) package.
extract_all() {
	local deb
	deb=$(fetch "$1")
	dpkg-deb -x "$deb" "$dir"
	rm -f "$deb"
}

if ! have "$inc/cuda.h" "$inc/nvrtc.h"; then
	extract nvidia-cuda-dev ./usr/include/cuda.h ./usr/include/nvrtc.h
fi
if ! have "$link/libcuda.so"; then
	extract_all libcuda1
	lib=$(ls "$dir"/$multiarch/nvidia/current/libcuda.so.*.* 2>/dev/null | head -n1)
	[ -n "$lib" ] || { echo "cuda-stubs: libcuda1 held no libcuda.so" >&2; exit 1; }
	mkdir -p "$link"
	ln -sf "$lib" "$link/libcuda.so"
fi
if ! have "$runtime/libnvrtc.so.11.2" "$link/libnvrtc.so"; then
	extract_all libnvrtc11.2
	mkdir -p "$link"
	ln -sf "$runtime/libnvrtc.so.11.2" "$link/libnvrtc.so"
fi
if $want_nvrtc && ! have "$runtime/libnvrtc-builtins.so.11.8"; then
	extract_all libnvrtc-builtins11.8
fi

echo "export CGO_CFLAGS='-I$inc'"
echo "export CGO_LDFLAGS='-L$link'"
if $want_nvrtc; then
	echo "export LD_LIBRARY_PATH='$runtime'\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
fi

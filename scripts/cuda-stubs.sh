#!/usr/bin/env bash
# cuda-stubs.sh DIR [--nvrtc]
#
# Fetches what the CUDA backend (build tag cuda, engine/cuda) needs to compile and link on a
# machine without a GPU or a CUDA toolkit: cuda.h, nvrtc.h and the stub libraries libcuda.so
# and libnvrtc.so from Debian's non-free nvidia-cuda-dev (CUDA 11.8). They are NVIDIA-licensed:
# fetched into DIR, never committed. It prints the environment to use them, for eval:
#
#   cuda_env=$(scripts/cuda-stubs.sh /tmp/kvh-cuda) && eval "$cuda_env"
#   go vet -tags cuda ./engine/...
#
# With --nvrtc it also fetches the real NVRTC libraries (libnvrtc11.2, libnvrtc-builtins11.8)
# and adds LD_LIBRARY_PATH, so the PTX generator (engine/cuda/ptxgen) can run here: a dev step
# for changing the kernels, not a CI step (CI compiles against the committed PTX).
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
inc=$dir/usr/include
lib=$dir/usr/lib/x86_64-linux-gnu
stubs=$lib/stubs

have() { for f in "$@"; do [ -s "$f" ] || return 1; done; }

apt_private() {
	local a=$dir/apt
	mkdir -p "$a/lists/partial" "$a/cache/archives/partial" "$a/sources" "$a/debs"
	# shellcheck disable=SC1091
	local suite
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
}

# download PACKAGE FILE... : fetch PACKAGE's .deb and extract only the FILEs (paths in it).
download() {
	local pkg=$1
	shift
	(cd "$dir/apt/debs" && apt-get "${APT_OPTS[@]}" download "$pkg" >&2)
	local deb
	deb=$(ls "$dir/apt/debs/${pkg}"_*.deb)
	dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$dir" "$@"
	rm -f "$deb" # the full .deb is 774 MB; keep only the extracted files
}

if ! have "$inc/cuda.h" "$inc/nvrtc.h" "$stubs/libcuda.so" "$stubs/libnvrtc.so"; then
	apt_private
	download nvidia-cuda-dev ./usr/include/cuda.h ./usr/include/nvrtc.h \
		./usr/lib/x86_64-linux-gnu/stubs/libcuda.so ./usr/lib/x86_64-linux-gnu/stubs/libnvrtc.so
fi

if $want_nvrtc && ! have "$lib/libnvrtc.so.11.2" "$lib/libnvrtc-builtins.so.11.8"; then
	[ -n "${APT_OPTS+x}" ] || apt_private
	# The packages hold versioned files behind symlinks; extract the whole (small) lib dir.
	download libnvrtc11.2 ./usr/lib/x86_64-linux-gnu/
	download libnvrtc-builtins11.8 ./usr/lib/x86_64-linux-gnu/
fi

echo "export CGO_CFLAGS='-I$inc'"
echo "export CGO_LDFLAGS='-L$stubs'"
if $want_nvrtc; then
	echo "export LD_LIBRARY_PATH='$lib'\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
fi

#!/bin/bash
# Real verbs on a machine without RDMA hardware: boot Debian's kernel under QEMU
# (software emulation), create a Soft-RoCE (rxe) device on a dummy netdev, and run
# over it the rdma conformance suite, the parts of the hostile-peer suite a NIC
# answers for, the handoff tests, the serve topology (router, two prefill and two
# decode processes, every queue pair on rxe0) and the verbs benchmark
# against perftest's ib_write_bw. Every process of the serve topology writes its
# protocol events (serve --trace, in the guest's /tmp/traces/serve.NODE), and
# kvhandoff trace check replays them in the spec inside the guest (docs/trace.md):
# the guest log shows each node's event count and the verdict, and a trace that
# does not conform fails the run. Exits 0 only if the guest prints the PASS marker.
#
#   rdma/verbs/vmtest/run.sh            # installs host packages if missing (root, apt)
#   rdma/verbs/vmtest/run.sh --install  # only that: libibverbs-dev for go vet -tags verbs, QEMU, ...
#   rdma/verbs/vmtest/run.sh --inject-sweep
#       # the proof that the trace check fails: only the serve topology and its check,
#       # with decode-0's own sweep of a verified request's pages (what the bug
#       # no-cut-call-cancel leaves) written into its real trace (inject-sweep.awk);
#       # the guest log shows the check naming that event, and the run FAILs (exit 1)
#
# Env: KVH_VM_CACHE   where the extracted kernel is kept between runs
#                     (default ~/.cache/kvhandoff-vm; keyed by the kernel package)
#      KVH_VM_OUT     where the guest log and bench-verbs.json go (default: a temp dir)
#      KVH_VM_TIMEOUT seconds before the VM is killed (default 600)
#      KVH_VM_ACCEL qemu -accel value (default tcg,thread=multi)
#      KPKG           kernel package to use (default: what linux-image-amd64 depends on)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
CACHE=${KVH_VM_CACHE:-$HOME/.cache/kvhandoff-vm}

# 1. Host packages (Debian): QEMU, busybox, module tools, rdma-core's userspace, perftest.
need=(qemu-system-x86 busybox-static cpio kmod iproute2 libibverbs-dev ibverbs-providers perftest gcc libc6-dev)
missing=()
for p in "${need[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "vmtest: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
[ "${1:-}" = --install ] && exit 0
INJECT=
case "${1:-}" in
  --inject-sweep) INJECT=1 ;;
  "") ;;
  *) echo "vmtest: unknown argument $1 (--install or --inject-sweep)"; exit 2 ;;
esac
OUT=${KVH_VM_OUT:-$(mktemp -d)}
TIMEOUT=${KVH_VM_TIMEOUT:-600}
mkdir -p "$CACHE" "$OUT"
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT

# 2. Kernel: the ABI package linux-image-amd64 points at today, resolved by name,
#    downloaded and extracted once per package name.
KPKG=${KPKG:-$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')}
[ -n "$KPKG" ] || { echo "vmtest: cannot resolve the kernel package behind linux-image-amd64"; exit 1; }
KVER=${KPKG#linux-image-}
K=$CACHE/$KPKG
if [ ! -f "$K/root/boot/vmlinuz-$KVER" ]; then
  echo "vmtest: fetching $KPKG"
  rm -rf "$K"; mkdir -p "$K"
  (cd "$K" && apt-get download "$KPKG" >/dev/null && dpkg-deb -x "$KPKG"_*.deb root && rm -f "$KPKG"_*.deb)
fi
MODDIR=$K/root/lib/modules/$KVER
[ -f "$MODDIR/modules.dep" ] || depmod -b "$K/root" "$KVER"

# 3. The binaries under test, built with the verbs tag.
(cd "$ROOT" &&
  CGO_ENABLED=1 go test -tags verbs -c -o "$W/verbs.test" ./rdma/verbs &&
  CGO_ENABLED=1 go test -tags verbs -c -o "$W/transfer.test" ./transfer &&
  CGO_ENABLED=1 go test -tags verbs -c -o "$W/kvhandoff.test" ./cmd/kvhandoff &&
  CGO_ENABLED=1 go build -tags verbs -o "$W/kvhandoff" ./cmd/kvhandoff)

# 4. The initramfs: busybox, the modules (dependency order from modules.dep),
#    rdma-core's userspace with the rxe provider, perftest, the test binaries.
R=$W/root
mkdir -p "$R"/{usr/bin,usr/sbin,usr/lib/x86_64-linux-gnu/libibverbs,usr/lib64,etc/libibverbs.d,proc,sys,dev,tmp,run,modules}
ln -s usr/bin "$R/bin"; ln -s usr/sbin "$R/sbin"; ln -s usr/lib "$R/lib"; ln -s usr/lib64 "$R/lib64"
cp /bin/busybox "$R/usr/bin/busybox"
for a in $("$R/usr/bin/busybox" --list); do [ -e "$R/usr/bin/$a" ] || ln -s busybox "$R/usr/bin/$a"; done
cp "$HERE/init" "$R/init"; chmod +x "$R/init"
cp "$HERE/inject-sweep.awk" "$R/inject-sweep.awk"
cp "$W/verbs.test" "$W/transfer.test" "$W/kvhandoff.test" "$W/kvhandoff" "$R/usr/bin/"
# crc32_generic: rxe needs the "crc32" crypto algorithm when a link is added,
# and it is not among rdma_rxe's module dependencies.
: > "$R/modules/order"
add_mod() {
  local p=$1 n d
  n=$(basename "$p" .ko)
  grep -qx "$n" "$R/modules/order" && return 0
  for d in $(grep "^$p:" "$MODDIR/modules.dep" | cut -d: -f2); do add_mod "$d"; done
  cp "$MODDIR/$p" "$R/modules/$n.ko"
  echo "$n" >> "$R/modules/order"
}
for m in crc32_generic rdma_rxe ib_uverbs dummy; do
  p=$(grep -E "/$m\.ko:" "$MODDIR/modules.dep" | cut -d: -f1)
  [ -n "$p" ] || { echo "vmtest: module $m not in $KPKG"; exit 1; }
  add_mod "$p"
done
LIBIBV=/usr/lib/x86_64-linux-gnu/libibverbs
RXE=$(ls "$LIBIBV"/librxe-rdmav*.so | head -n1)
cp "$RXE" "$R$LIBIBV/"
cp /etc/libibverbs.d/rxe.driver "$R/etc/libibverbs.d/"
for b in /usr/bin/ib_write_bw /usr/bin/rdma; do cp "$b" "$R$b"; done
for f in /usr/bin/ib_write_bw /usr/bin/rdma "$RXE" "$R/usr/bin/verbs.test" "$R/usr/bin/transfer.test" "$R/usr/bin/kvhandoff.test" "$R/usr/bin/kvhandoff"; do
  ldd "$f" | awk '/=>/ {print $3} /^[ \t]*\/lib64\// {print $1}' | while read -r l; do
    [ -n "$l" ] || continue
    dest="$R/usr${l#/usr}"
    mkdir -p "$(dirname "$dest")"
    [ -e "$dest" ] || cp "$(readlink -f "$l")" "$dest"
  done
done
echo "127.0.0.1 localhost" > "$R/etc/hosts"
[ -z "$INJECT" ] || : > "$R/etc/kvh-inject-sweep"
echo "root:x:0:0:root:/:/bin/sh" > "$R/etc/passwd"
(cd "$R" && find . -print0 | cpio --null -o -H newc --quiet) | gzip -1 > "$W/initrd.gz"

# 5. Boot under TCG with no NIC: rxe binds to a dummy netdev. (A writable /dev/kvm
#    is no proof KVM works: here it hung the guest silently; KVH_VM_ACCEL=kvm opts in.)
ACCEL=${KVH_VM_ACCEL:-tcg,thread=multi}
echo "vmtest: booting $KVER ($ACCEL), modules: $(tr '\n' ' ' < "$R/modules/order")"
LOG=$OUT/guest.log
start=$SECONDS
timeout --foreground "$TIMEOUT" qemu-system-x86_64 -nographic -no-reboot \
  -machine q35 -accel "$ACCEL" -cpu max -smp 2 -m 2048 \
  -kernel "$K/root/boot/vmlinuz-$KVER" -initrd "$W/initrd.gz" -nic none \
  -append "console=ttyS0 quiet panic=-1" < /dev/null 2>&1 | tr -d '\r' | tee "$LOG" || true
echo "vmtest: guest ran $((SECONDS - start)) s; log in $LOG"
sed -n '/^BENCH-JSON-BEGIN$/,/^BENCH-JSON-END$/p' "$LOG" | sed '1d;$d' > "$OUT/bench-verbs.json"
if grep -q '^KVH-VERBS PASS' "$LOG"; then
  echo "vmtest: PASS; verbs bench in $OUT/bench-verbs.json"
  exit 0
fi
echo "vmtest: FAIL (no PASS marker)"
exit 1

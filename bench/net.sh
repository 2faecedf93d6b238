#!/usr/bin/env bash
# Network benchmark: ping RTT (avg/max) and TCP throughput both ways, tandem
# vs QEMU (Debian's qemu-system-x86, microvm, virtio-net on a tap, vhost=off,
# TCG), same kernel, initramfs and command line, in one run; min/median of N
# repetitions (default 3). Runs in network namespaces it creates and removes.
# Usage: bench/net.sh [--runs N] [--mib M]
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
resources/setup.sh >&2
if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86 >/dev/null
fi
cmdline=$(target/release/tandem run --print-cmdline)
python3 bench/net_measure.py --tandem target/release/tandem \
    --kernel target/guest/vmlinux --bzimage target/guest/bzImage \
    --initrd target/guest/initramfs.cpio \
    --cmdline "$cmdline" "$@"

#!/usr/bin/env bash
# Boot benchmark: tandem vs QEMU (Debian's qemu-system-x86, -M microvm, with
# KVM and with TCG) on the same kernel, initramfs and command line, in one
# run: time from process start to "tandem-guest: ready" and the VMM's own
# memory (RSS minus guest RAM), min/median of N runs (default 5). QEMU loads
# the bzImage of the same kernel (it needs a PVH note to load a vmlinux);
# `--tandem-bzimage` also times tandem on the bzImage.
# Usage: bench/boot.sh [--runs N] [--tandem-bzimage]
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
resources/setup.sh >&2
if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then
    # Note: on Debian 12 this replaces a newer qemu-utils, if one is installed.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86 >/dev/null
fi
# The command line tandem gives the default guest on this host, so every VMM
# boots the same thing (tandem appends nothing to a line that already has it).
cmdline=$(target/release/tandem run --print-cmdline)
python3 bench/boot_measure.py --tandem target/release/tandem \
    --kernel target/guest/vmlinux --bzimage target/guest/bzImage \
    --initrd target/guest/initramfs.cpio \
    --cmdline "$cmdline" "$@"

#!/usr/bin/env bash
# Boot benchmark: tandem vs QEMU (Debian's qemu-system-x86, -M microvm, with
# KVM and with TCG) on the same kernel, initramfs and command line, in one
# run: time from process start to "tandem-guest: ready" and the VMM's own
# memory (RSS minus guest RAM), min/median of N runs (default 5). QEMU loads
# the bzImage of the same kernel (it needs a PVH note to load a vmlinux);
# `--tandem-bzimage` also times tandem on the bzImage.
# Usage: bench/boot.sh [--runs N] [--tandem-bzimage]
source "$(dirname "$0")/common.sh"
python3 bench/boot_measure.py "${guest_args[@]}" "$@"

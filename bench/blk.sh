#!/usr/bin/env bash
# Disk benchmark: sequential write and read (MiB/s, 1 MiB O_DIRECT requests,
# passes for at least S seconds) and 4 KiB random read IOPS (for S seconds)
# inside the guest (resources/rootfs/blktool.c),
# tandem vs QEMU (Debian's qemu-system-x86, -M microvm, virtio-blk-device on
# raw -drive files, TCG), same kernel, same command line, same root disk
# image (a copy each) and a fresh data disk of the same size, in one run;
# min/median of N repetitions (default 3).
# `--sandbox-off` adds a row for tandem with its sandbox off (--seccomp off
# --landlock off: the sandbox's cost, same run).
# Usage: bench/blk.sh [--runs N] [--mib M] [--seconds S] [--sandbox-off]
source "$(dirname "$0")/common.sh"
python3 bench/blk_measure.py "${guest_args[@]}" --rootfs target/guest/rootfs.ext4 "$@"

#!/usr/bin/env bash
# Network benchmark: ping RTT (avg/max) and TCP throughput both ways, tandem
# vs QEMU (Debian's qemu-system-x86, microvm, virtio-net on a tap, vhost=off,
# TCG), same kernel, initramfs and command line, in one run; min/median of N
# repetitions (default 3). Runs in network namespaces it creates and removes.
# `--sandbox-off` adds a row for tandem with its sandbox off (--seccomp off
# --landlock off: the sandbox's cost, same run).
# Usage: bench/net.sh [--runs N] [--mib M] [--sandbox-off]
source "$(dirname "$0")/common.sh"
python3 bench/net_measure.py "${guest_args[@]}" "$@"

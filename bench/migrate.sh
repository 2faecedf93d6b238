#!/usr/bin/env bash
# Live-migration benchmark: tandem (its migration thread, and --mode inline
# in the device thread's event loop) vs QEMU 7.2 (Debian's qemu-system-x86,
# -M microvm, TCG), same kernel, initramfs and command line, --cpus vCPUs
# (default 1; QEMU: -smp), one virtio-net NIC, in one run, per guest size
# (--sizes, MiB), workload (idle; dirty: tandem-dirty 256 200 in the guest,
# with N vCPUs N x tandem-dirty 256/N 200/N, one pinned to each vCPU:
# --dirty-mib and --dirty-rate change the totals) and bandwidth (--bandwidths,
# MiB/s, 0 = unlimited), downtime budget 300 ms, auto-converge on. Each
# VMM boots one guest per size and snapshots it per workload (tandem-jitter
# and tandem-dirty started before, so restored guests dirty at once); each
# run restores a source from the snapshot, migrates it to a destination on
# the same machine (Unix socket, or TCP on loopback with --stream tcp) and
# measures total time, downtime, MiB sent, send rate, rounds, convergence (--timeout-s per migration), the guest's max
# gap (tandem-jitter) before vs during, and ping RTT and loss (every 10 ms)
# during. Min/median of N runs (default 3), ratios vs QEMU, the issue's
# targets, and a JSON line. Guests sit on a bridge in a network namespace
# made and removed here; snapshots go to a temporary directory (--tmpdir,
# a few hundred MiB) removed at the end; VMMs are killed on every exit path.
# It boots guests (tandem: minutes each on this host, and minutes more for
# tandem-dirty's first touch): run it under the guest lock.
# Usage: flock /tmp/tandem-guest.lock bench/migrate.sh [--runs N] [--sizes 512,2048] [--cpus 1]
#            [--dirty-mib 256] [--dirty-rate 200]
#            [--workloads idle,dirty] [--bandwidths 0,128] [--modes thread,inline,qemu]
#            [--timeout-s 120] [--tmpdir DIR] [--sandbox on|off] [--initially-set on|off]
#            [--stream unix|tcp] [--ping-ms 10] [--window-s 40]
# --modes also takes threadN: the migration thread with --connections N
# (2 to 16), e.g. --modes thread,thread2,thread4 --stream tcp, and
# postcopy: the thread with --postcopy --postcopy-after-rounds 1 (the
# destination fetches what the guest dirtied during round 0; the report
# adds its pages, the faults the guest waited on and their waits).
# --window-s W adds, per run, the gaps over 400 ms, the largest gap and the
# largest ping RTT over W s from the pings' start (the seed's table: 40).
source "$(dirname "$0")/common.sh"
exec python3 bench/migrate_measure.py "${guest_args[@]}" "$@"

#!/usr/bin/env bash
# Snapshot benchmark: tandem vs QEMU (Debian's qemu-system-x86, -M microvm,
# TCG) on the same kernel, initramfs and command line, console-only guests,
# in one run, for 128 MiB and 1 GiB of guest memory (--sizes, in MiB). Each
# VMM boots one source guest per size, which writes 32 MiB of pseudo-random
# data into a tmpfs file; then, per run and interleaved: pause latency (the
# VMM's own figure and the API/QMP round trip), snapshot time (tandem's
# snapshot verb / QEMU `migrate` to `exec:cat > F` plus a sync) and file
# size, and restore-to-running time (`tandem run --restore F`, mapped and
# copied, with the VMM's own time to place memory / QEMU
# `-incoming "exec:cat F"` + `cont`, from process start until the guest
# shell answers on the console), each restore checked by the file's
# checksum inside the guest. Min/median of N runs (default 3), the ratio
# tandem/QEMU, and a JSON line. Snapshot files go to a temporary directory
# (--tmpdir; files hold the guest's non-zero pages, ~50-70 MiB here) that is
# removed at the end; VMMs are killed on every exit path. It boots guests
# (tandem: minutes each on this host): run it under the guest lock.
# Usage: flock /tmp/tandem-guest.lock bench/snapshot.sh [--runs N] [--sizes 128,1024]
#            [--data-mib M] [--tmpdir DIR] [--vmms tandem,qemu]
source "$(dirname "$0")/common.sh"
exec python3 bench/snapshot_measure.py "${guest_args[@]}" "$@"

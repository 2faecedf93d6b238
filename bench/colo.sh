#!/usr/bin/env bash
# COLO benchmark (the pair's second slice): checkpoint pause (p50/p99/max)
# and bytes of a 128 MiB guest under load (tandem-dirty), checkpoints per
# minute, and the failover time (primary killed -> first ping reply from the
# secondary), min/median of N runs, against the issue's targets; a JSON
# line. One boot, then each run restores the guest from a snapshot. Guests
# sit on a bridge in a network namespace made and removed here. It boots a
# guest: run it under the guest lock.
# Usage: flock /tmp/tandem-guest.lock bench/colo.sh [--runs N] [--seconds S]
#            [--period-ms P] [--mem MIB] [--dirty-mib M] [--dirty-rate R]
source "$(dirname "$0")/common.sh"
exec python3 bench/colo_measure.py "${guest_args[@]}" "$@"

#!/usr/bin/env bash
# COLO benchmark: checkpoint pause (p50/p99/max) and bytes of a 128 MiB
# guest under load (tandem-dirty), checkpoints per minute, the failover time
# (primary killed -> first ping reply from the secondary), TCP throughput
# both ways and ping through the pair against the same guest alone, and
# (--queue-policies drop,checkpoint) both full-queue policies under
# --conns connections; min/median of N runs, against the issue's targets;
# a JSON line. One boot, then each run restores the guest from a snapshot. Guests
# sit on a bridge in a network namespace made and removed here. It boots a
# guest: run it under the guest lock.
# Usage: flock /tmp/tandem-guest.lock bench/colo.sh [--runs N] [--seconds S]
#            [--period-ms P] [--mem MIB] [--cpus N] [--dirty-mib M] [--dirty-rate R]
#            [--traffic-seconds T] [--traffic-ping-ms P] [--queue-policies drop,checkpoint]
#            [--conns N] [--max-queue Q] [--hosts-runs N] [--lease-ttl-s S]
#            [--channels 1,2,4] [--transports tcp,tls] [--client-cc cubic]
#            [--net-opts rsc=on]
# --channels 1,2,4: the checkpoint pause with that many page channels.
# --transports tcp,tls: a pair on loopback TCP, plain and TLS (the cost of TLS).
# --hosts-runs: pairs on two simulated hosts (namespaces, an etcd lease),
# host A cut off: takeover and first client reply after the cut.
source "$(dirname "$0")/common.sh"
exec python3 bench/colo_measure.py "${guest_args[@]}" "$@"

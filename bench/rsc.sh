#!/usr/bin/env bash
# RSC benchmark: host->guest TCP throughput into one tandem guest through a
# rsc=on NIC and a rsc=off NIC, with the taps' segmentation offloads off
# (tso/gso/gro, as in the seed measurement) and on, for several message
# sizes; min/median of N runs and the on/off ratio. Not a test; about 20
# minutes with the defaults on an emulating host. Runs in a network
# namespace it creates and removes.
# Usage: bench/rsc.sh [--runs N] [--kib K] [--sizes 256,1024,...] [--interval-us N]
source "$(dirname "$0")/common.sh"
python3 bench/rsc_measure.py "${guest_args[@]}" "$@"

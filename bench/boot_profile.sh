#!/usr/bin/env bash
# Profiles the default guest's boot with tandem's guest profiler: boot to
# the ready marker under --guest-profile, the top-30 table of kernel
# functions, folded stacks in target/boot-profile.folded (and an SVG flame
# graph with inferno-flamegraph, if installed). Not a peer comparison: it
# says where the boot's time goes (docs/host-kvm.md).
# Usage: bench/boot_profile.sh [--hz N] [--out FILE] [-- tandem run args...]
set -euo pipefail
cd "$(dirname "$0")/.."
resources/setup.sh >&2
exec python3 bench/boot_profile.py "$@"

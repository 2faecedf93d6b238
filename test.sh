#!/usr/bin/env bash
# Runs the whole test suite: unit tests and the tests that boot real guests
# under KVM. Does all set-up first (packages, guest build, cargo build).
set -euo pipefail
top=$(cd "$(dirname "$0")" && pwd)
cd "$top"
resources/setup.sh
if [ ! -e /dev/kvm ]; then
    echo "test.sh: /dev/kvm is absent: the guest tests cannot run on this machine" >&2
    exit 1
fi
# The base snapshot (tests/src/base.rs): booted once by the first test that
# needs it, restored by the others, removed at exit.
TANDEM_TEST_BASE=$(mktemp -d "${TMPDIR:-/tmp}/tandem-base.XXXXXX")
export TANDEM_TEST_BASE
trap 'rm -rf "$TANDEM_TEST_BASE"' EXIT
# House rules first (seconds): no function over 80 lines outside tests.
python3 tools/fn_lengths.py
# Two test threads: one guest per core.
cargo test --release --workspace -- --test-threads=2 "$@"
# The whole suite (no test names given) ends with every fuzz target for 12 s
# on its corpus in fuzz/seeds (fuzz/run.sh; a finding fails the run).
# cargo-fuzz comes from crates.io, installed once.
if [ $# -eq 0 ]; then
    if ! command -v cargo-fuzz >/dev/null 2>&1; then
        echo "test.sh: installing cargo-fuzz (once)" >&2
        cargo install --locked --quiet cargo-fuzz
    fi
    fuzz/run.sh --seconds 12
fi

#!/usr/bin/env bash
# Boots the default guest to a shell on this terminal (Ctrl-A x quits).
# Does all set-up first (packages, guest build, cargo build); extra
# arguments go to `tandem run` (see `target/release/tandem run --help`).
set -euo pipefail
top=$(cd "$(dirname "$0")" && pwd)
"$top/resources/setup.sh" >&2
exec "$top/target/release/tandem" run "$@"

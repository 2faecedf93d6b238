#!/usr/bin/env bash
# Builds the cargo-fuzz targets in fuzz/fuzz_targets and runs each for N
# seconds (default 20) on a copy of its seeds, fuzz/seeds/<target> when
# there are any, in a temporary corpus (with fuzz/dicts/<target>.dict as
# its dictionary when there is one): the repository is not written,
# except for a crashing input, kept in fuzz/artifacts/<target>/ (ignored
# by git). Stops at the first finding (crash, leak, an input that runs
# over 30 s, out of memory), prints the target and the input, and exits 1.
#
#   fuzz/run.sh [--seconds N] [--target NAME]...
#
# cargo-fuzz needs a nightly compiler: `cargo +nightly` when rustup has one,
# otherwise the stable one with RUSTC_BOOTSTRAP=1. Builds and runs are
# niced, for a machine that runs other work.
set -euo pipefail

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }

seconds=20
targets=()
while (($#)); do
    case "$1" in
    --seconds) seconds=${2-}; shift 2 || shift ;;
    --seconds=*) seconds=${1#*=}; shift ;;
    --target) targets+=("${2-}"); shift 2 || shift ;;
    --target=*) targets+=("${1#*=}"); shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "run.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done
if ! [[ $seconds =~ ^[1-9][0-9]*$ ]]; then
    echo "run.sh: --seconds takes a whole number of seconds, not '$seconds'" >&2
    exit 2
fi

cd "$(dirname "$0")"
all=0
if ((${#targets[@]} == 0)); then
    all=1
    for f in fuzz_targets/*.rs; do
        targets+=("$(basename "$f" .rs)")
    done
fi
for t in "${targets[@]}"; do
    if [[ ! -f fuzz_targets/$t.rs ]]; then
        echo "run.sh: no target '$t' (fuzz/fuzz_targets/$t.rs)" >&2
        exit 2
    fi
done

if rustup run nightly rustc --version >/dev/null 2>&1; then
    cargo=(nice -n 19 cargo +nightly)
else
    cargo=(nice -n 19 env RUSTC_BOOTSTRAP=1 cargo)
fi

# All targets in one build: cargo links them in parallel.
if ((all)); then
    "${cargo[@]}" fuzz build
else
    for t in "${targets[@]}"; do
        "${cargo[@]}" fuzz build "$t"
    done
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/tandem-fuzz.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
for t in "${targets[@]}"; do
    corpus=$tmp/corpus/$t
    mkdir -p "$corpus" "artifacts/$t"
    if [[ -d seeds/$t ]]; then
        cp -R "seeds/$t/." "$corpus/"
    fi
    log=$tmp/$t.log
    opts=(-max_total_time="$seconds" -timeout=30 -artifact_prefix="$PWD/artifacts/$t/")
    if [[ -f dicts/$t.dict ]]; then
        opts+=(-dict="$PWD/dicts/$t.dict")
    fi
    echo "run.sh: $t for ${seconds}s on $(find "$corpus" -type f | wc -l) seeds"
    if ! "${cargo[@]}" fuzz run "$t" "$corpus" -- "${opts[@]}" >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo >&2
        grep -m 3 -A 1 -E 'panicked at|==ERROR|deadly signal|timeout after|out-of-memory' "$log" >&2 || true
        artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)
        echo >&2
        echo "run.sh: target $t failed; input: ${artifact:-none written (see the log above)}" >&2
        if [[ -n $artifact ]]; then
            echo "run.sh: reproduce with: cd fuzz && cargo +nightly fuzz run $t $artifact" >&2
        fi
        exit 1
    fi
    done_line=$(grep -o 'Done [0-9]* runs in [0-9]* second(s)' "$log" | tail -n 1 || true)
    echo "run.sh: $t: ${done_line:-done}, no finding"
done

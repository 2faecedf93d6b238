#!/usr/bin/env bash
# Everything a fresh Debian 12 machine needs before tandem runs: Debian
# packages, the default guest (kernel + initramfs, cached), and the release
# build of tandem. Idempotent; later runs take seconds.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"

if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: cargo is missing: install a Rust toolchain (rustup) first" >&2
    exit 1
fi
# Tools the test suite uses besides the guest build's own dependencies
# (ethtool: the RSC test and benchmark turn tap segmentation offloads off;
# fonts-dejavu-core: the font of the migration jitter probe's plot;
# etcd-server, etcd-client: the two-host COLO tests start their own etcd,
# the arbiter, in a namespace; protobuf-compiler: the etcd-client crate's
# build compiles etcd's gRPC definitions with protoc, which needs the
# well-known types of libprotobuf-dev).
need=()
for p in util-linux iproute2 coreutils iputils-ping ethtool fonts-dejavu-core \
    etcd-server etcd-client protobuf-compiler libprotobuf-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
resources/build-guest.sh
cargo build --release --quiet -p vmm

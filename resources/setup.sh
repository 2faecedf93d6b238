#!/usr/bin/env bash
# Everything a fresh Debian 12 machine needs before tandem runs: Debian
# packages, the default guest (kernel + initramfs, cached), and the release
# build of tandem. Idempotent; later runs take seconds.
set -euo pipefail
# top; log, install_deps.
source "$(dirname "$0")/lib.sh"
cd "$top"

if ! command -v cargo >/dev/null 2>&1; then
    log "cargo is missing: install a Rust toolchain (rustup) first"
    exit 1
fi
# Tools the test suite uses besides the guest build's own dependencies
# (ethtool: the RSC test and benchmark turn tap segmentation offloads off;
# fonts-dejavu-core: the font of the migration jitter probe's plot;
# etcd-server, etcd-client: the two-host COLO tests start their own etcd,
# the arbiter, in a namespace; protobuf-compiler: the etcd-client crate's
# build compiles etcd's gRPC definitions with protoc, which needs the
# well-known types of libprotobuf-dev).
install_deps util-linux iproute2 coreutils iputils-ping ethtool fonts-dejavu-core \
    etcd-server etcd-client protobuf-compiler libprotobuf-dev
resources/build-guest.sh
cargo build --release --quiet -p vmm

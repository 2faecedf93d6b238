# Sourced by the bench scripts: set-up, the peer (QEMU), and the command line
# tandem gives the default guest on this host, so every VMM boots the same.
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$top"
resources/setup.sh >&2
if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then
    # On Debian 12 this replaces a newer qemu-utils, if one is installed.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86 >/dev/null
fi
cmdline=$(target/release/tandem run --print-cmdline)
guest_args=(--tandem target/release/tandem --kernel target/guest/vmlinux
    --bzimage target/guest/bzImage --initrd target/guest/initramfs.cpio --cmdline "$cmdline")

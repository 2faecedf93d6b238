#!/usr/bin/env bash
# Builds the default guest's root file system as an ext4 image, to boot from
# a virtio-blk disk (root=/dev/vda, no initramfs):
#   target/guest/rootfs.ext4   busybox with its applet links, /sbin/init (the
#                              initramfs's tandem-init), /usr/bin/blktool, and
#                              the guest tools (resources/guest-tools/*.c) as
#                              /usr/bin/<name>, built as for the initramfs
#
# Debian packages only (busybox-static, e2fsprogs, gcc and libc6-dev for the
# static blktool, musl-tools for tandem-init and the guest tools); the image
# is made by `mkfs.ext4 -d` from a tree built like the initramfs's, no
# mounting and no root privileges needed.
#
# Idempotent and cached like build-guest.sh: built once into
# ${TANDEM_CACHE:-~/.cache/tandem}, keyed by a hash of its inputs, then
# linked into target/guest/. That file is the pristine copy: boot a COPY of
# it read-write (the guest writes to its root disk), never the file itself.
#
# Usage: resources/build-rootfs.sh [--no-deps]
set -euo pipefail

# here, top, cache, out; log, install_deps, pkgver.
source "$(dirname "$0")/lib.sh"
# Room for what tests and benchmarks write on the root disk.
size=64M

build_rootfs() {
    local key file root applet tool
    key=$( (pkgver busybox-static; pkgver e2fsprogs; pkgver gcc; pkgver libc6-dev; pkgver musl-tools; echo "$size"
        cat "$here/initramfs/init.c" "$here/rootfs/blktool.c" "$here"/guest-tools/*.c "$here"/guest-tools/*.h
        sed -n '/^build_rootfs()/,/^}/p' "$0") | sha256sum | cut -c1-16)
    file="$cache/rootfs-$key.ext4"
    if [ -f "$file" ]; then
        log "rootfs cached ($file)"
    else
        log "building rootfs"
        root=$(mktemp -d)
        mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,tmp,root,etc,mnt}
        chmod 1777 "$root/tmp"
        chmod 0700 "$root/root"
        cp /bin/busybox "$root/bin/busybox"
        # Applet links are made here, not at boot: every exec costs a lot under emulation.
        for applet in $("$root/bin/busybox" --list-full); do
            [ -e "$root/$applet" ] || ln -s /bin/busybox "$root/$applet"
        done
        # The kernel runs /sbin/init from a disk root: tandem-init, not busybox's init.
        rm -f "$root/sbin/init"
        musl-gcc -static -O2 -s -Wall -Wextra -Werror -o "$root/sbin/init" "$here/initramfs/init.c"
        gcc -static -O2 -Wall -Werror -o "$root/usr/bin/blktool" "$here/rootfs/blktool.c"
        # Guest tools, exactly as build-guest.sh builds them for the initramfs.
        for tool in "$here"/guest-tools/*.c; do
            musl-gcc -static -O2 -s -Wall -Wextra -Werror \
                -o "$root/usr/bin/$(basename "$tool" .c)" "$tool"
        done
        echo 'root:x:0:0:root:/root:/bin/sh' >"$root/etc/passwd"
        echo 'root:x:0:' >"$root/etc/group"
        # 4 KiB blocks (mke2fs picks 1 KiB for small images), no reserved
        # blocks, files owned by root whoever builds it.
        rm -f "$file.tmp"
        local msg
        msg=$(mkfs.ext4 -q -F -L tandem-root -b 4096 -m 0 -E root_owner=0:0 \
            -d "$root" "$file.tmp" "$size" 2>&1) || { log "mkfs.ext4 failed: $msg"; exit 1; }
        msg=$(e2fsck -fn "$file.tmp" 2>&1) || { log "e2fsck of the new image failed: $msg"; exit 1; }
        mv "$file.tmp" "$file"
        rm -rf "$root"
    fi
    mkdir -p "$out"
    ln -f "$file" "$out/rootfs.ext4" 2>/dev/null || cp -f "$file" "$out/rootfs.ext4"
    # Nobody writes to the pristine copy by mistake.
    chmod a-w "$file"
}

main() {
    if [ "${1:-}" != --no-deps ]; then
        install_deps busybox-static e2fsprogs gcc libc6-dev musl-tools
    fi
    mkdir -p "$cache"
    build_rootfs
}

main "$@"

#!/usr/bin/env bash
# Builds the default tandem guest from Debian packages only:
#   target/guest/vmlinux         ELF kernel (boot this one: no self-decompression)
#   target/guest/bzImage         the same kernel as a bzImage
#   target/guest/initramfs.cpio  uncompressed busybox initramfs, /init built
#                                from resources/initramfs/init.c, with the
#                                guest tools (resources/guest-tools/*.c and the
#                                tool.h they share, static
#                                with musl: a few KiB each instead of glibc's
#                                ~750 KiB, which the guest kernel would copy
#                                into its page cache at every boot)
#
# Idempotent and cached: each output is built once into
# ${TANDEM_CACHE:-~/.cache/tandem}, keyed by a hash of its inputs (config,
# patches, scripts, package versions), then linked into target/guest/.
# Nothing built here is ever committed.
#
#   target/guest/bzImage-efi     with --efi: the kernel with an EFI stub as
#                                well (resources/kernel/efi.config), for
#                                boots through UEFI firmware
#
# Usage: resources/build-guest.sh [--no-deps] [--efi]
#   --no-deps   do not apt-get install the build dependencies
#   --efi       also build the EFI variant of the kernel
set -euo pipefail

# here, top, cache, out; log, install_deps, pkgver, publish.
source "$(dirname "$0")/lib.sh"
jobs=$(nproc)
# What the kernel, the initramfs and the root file system are built with.
packages=(linux-source-6.1 busybox-static bc bison flex libelf-dev libssl-dev
    cpio xz-utils make gcc libc6-dev musl-tools e2fsprogs)

build_kernel() {
    local ver key dir src
    ver=$(pkgver linux-source-6.1)
    key=$( (echo "$ver"; cat "$here/kernel/tandem.config" "$here"/kernel/*.patch;
        sed -n '/^build_kernel()/,/^}/p' "$0") | sha256sum | cut -c1-16)
    dir="$cache/kernel-$key"
    if [ -f "$dir/vmlinux" ] && [ -f "$dir/bzImage" ]; then
        log "kernel $ver cached ($dir)"
    else
        src="$cache/build/linux-$key"
        log "building kernel $ver into $src (takes several minutes, once)"
        rm -rf "$src"
        mkdir -p "$src"
        tar -xf /usr/src/linux-source-6.1.tar.xz -C "$src" --strip-components=1
        for p in "$here"/kernel/*.patch; do
            patch -s -p1 -d "$src" <"$p"
        done
        make -s -C "$src" KCONFIG_ALLCONFIG="$here/kernel/tandem.config" allnoconfig
        # Every line of the fragment must have taken effect.
        local bad=0 line name want
        while IFS= read -r line; do
            case "$line" in CONFIG_*=*) ;; *) continue ;; esac
            name=${line%%=*}
            want=${line#*=}
            if [ "$want" = n ]; then
                if grep -q "^$name=" "$src/.config"; then log "config: $name is set"; bad=1; fi
            elif ! grep -qx "$name=$want" "$src/.config"; then
                log "config: $name is not $want"
                bad=1
            fi
        done <"$here/kernel/tandem.config"
        [ "$bad" = 0 ] || { log "kernel config fragment did not apply"; exit 1; }
        make -s -C "$src" -j"$jobs" vmlinux bzImage
        mkdir -p "$dir.tmp"
        cp "$src/vmlinux" "$src/arch/x86/boot/bzImage" "$src/System.map" "$src/.config" "$dir.tmp/"
        rm -rf "$dir"
        mv "$dir.tmp" "$dir"
        rm -rf "$src"
    fi
    publish "$dir/vmlinux" vmlinux
    publish "$dir/bzImage" bzImage
    publish "$dir/System.map" System.map
}

# The EFI variant: build_kernel on a kernel directory whose config is
# tandem.config plus efi.config (so its own cache key), published as
# bzImage-efi.
build_efi_kernel() {
    local tmp
    tmp=$(mktemp -d)
    mkdir -p "$tmp/kernel" "$tmp/out"
    cat "$here/kernel/tandem.config" "$here/kernel/efi.config" >"$tmp/kernel/tandem.config"
    cp "$here"/kernel/*.patch "$tmp/kernel/"
    (here=$tmp out=$tmp/out && build_kernel)
    publish "$(readlink -f "$tmp/out/bzImage")" bzImage-efi
    rm -rf "$tmp"
}

build_initramfs() {
    local key file root
    key=$( (pkgver busybox-static; pkgver musl-tools; pkgver gcc; cat "$here/initramfs/init.c" "$here"/guest-tools/*.c "$here"/guest-tools/*.h;
        sed -n '/^build_initramfs()/,/^}/p' "$0") | sha256sum | cut -c1-16)
    file="$cache/initramfs-$key.cpio"
    if [ -f "$file" ]; then
        log "initramfs cached ($file)"
    else
        log "building initramfs"
        root=$(mktemp -d)
        # Merged /usr, as on Debian 12: every program is in /bin, and /sbin,
        # /usr/bin and /usr/sbin lead there. The kernel unpacks each cpio
        # entry with path lookups that cost milliseconds under emulation, so
        # the image holds one link per applet and short paths.
        mkdir -p "$root"/{bin,usr,proc,sys,dev,tmp,root,etc,mnt}
        ln -s bin "$root/sbin"
        ln -s ../bin "$root/usr/bin"
        ln -s ../bin "$root/usr/sbin"
        cp /bin/busybox "$root/bin/busybox"
        # Applet links are made here, not at boot: every exec costs a lot under emulation.
        local applet
        for applet in $("$root/bin/busybox" --list); do
            [ -e "$root/bin/$applet" ] || ln -s busybox "$root/bin/$applet"
        done
        # /init: tandem-init (resources/initramfs/init.c), static with musl.
        musl-gcc -static -O2 -s -Wall -Wextra -Werror -o "$root/init" "$here/initramfs/init.c"
        # Guest tools: static, so they need nothing else in the image, and
        # small (musl, stripped): every byte is copied by the emulated kernel.
        local tool
        for tool in "$here"/guest-tools/*.c; do
            musl-gcc -static -O2 -s -Wall -Wextra -Werror \
                -o "$root/bin/$(basename "$tool" .c)" "$tool"
        done
        echo 'root:x:0:0:root:/root:/bin/sh' >"$root/etc/passwd"
        echo 'root:x:0:' >"$root/etc/group"
        (cd "$root" && find . -print0 | LC_ALL=C sort -z |
            cpio --null --create --format=newc --owner=0:0 --quiet) >"$file.tmp"
        mv "$file.tmp" "$file"
        rm -rf "$root"
    fi
    publish "$file" initramfs.cpio
}

main() {
    local deps=1 efi=0
    for a in "$@"; do
        case "$a" in
        --no-deps) deps=0 ;;
        --efi) efi=1 ;;
        *) log "unknown argument $a"; exit 2 ;;
        esac
    done
    if [ "$deps" = 1 ]; then
        install_deps "${packages[@]}"
    fi
    mkdir -p "$cache"
    build_initramfs
    "$here/build-rootfs.sh" --no-deps # target/guest/rootfs.ext4, the root disk image
    build_kernel
    if [ "$efi" = 1 ]; then
        build_efi_kernel
    fi
    log "guest ready in $out"
}

main "$@"

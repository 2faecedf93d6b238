#!/usr/bin/env bash
# Builds a GPT disk image with one EFI system partition (FAT) for a boot
# through UEFI firmware from a disk: the EFI-stub guest kernel
# (target/guest/bzImage-efi, from build-guest.sh --efi), the initramfs, and
# a startup.nsh that OVMF's UEFI shell runs when no boot option boots: it
# starts the kernel with the initramfs and the command line given.
#
#   target/guest/esp.img   32 MiB: GPT, partition 1 (type EFI system) from
#                          1 MiB to the end, FAT16
#
# Made from Debian packages only (fdisk's sfdisk, mtools: no mount,
# no root needed); rebuilt on every run (it is small, and its command line
# is the caller's). Nothing built here is ever committed.
#
# Usage: resources/build-esp.sh [--no-deps] CMDLINE
set -euo pipefail

# here, top, out; log, install_deps.
source "$(dirname "$0")/lib.sh"

deps=1
if [ "${1:-}" = --no-deps ]; then
    deps=0
    shift
fi
cmdline=${1:?usage: resources/build-esp.sh [--no-deps] CMDLINE}
if [ "$deps" = 1 ]; then
    install_deps mtools fdisk
fi
for f in bzImage-efi initramfs.cpio; do
    [ -f "$out/$f" ] || { log "no $out/$f: run resources/build-guest.sh --efi first"; exit 1; }
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
disk_mib=32
start=2048 # sectors: 1 MiB
# GPT keeps its backup header in the last 33 sectors.
sectors=$((disk_mib * 2048 - start - 33))
truncate -s "${disk_mib}M" "$tmp/esp.img"
printf 'label: gpt\nstart=%d, size=%d, type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, name="EFI system"\n' \
    "$start" "$sectors" | sfdisk --quiet "$tmp/esp.img"
truncate -s $((sectors * 512)) "$tmp/fat.img"
mformat -i "$tmp/fat.img" -v TANDEM ::
mmd -i "$tmp/fat.img" ::/EFI ::/EFI/tandem
mcopy -i "$tmp/fat.img" "$out/bzImage-efi" ::/EFI/tandem/linux.efi
mcopy -i "$tmp/fat.img" "$out/initramfs.cpio" ::/EFI/tandem/initrd.cpio
# The shell reads startup.nsh from the first file system it maps.
printf 'FS0:\r\n\\EFI\\tandem\\linux.efi initrd=\\EFI\\tandem\\initrd.cpio %s\r\n' "$cmdline" >"$tmp/startup.nsh"
mcopy -i "$tmp/fat.img" "$tmp/startup.nsh" ::/startup.nsh
dd if="$tmp/fat.img" of="$tmp/esp.img" bs=512 seek="$start" conv=notrunc status=none
mkdir -p "$out"
mv "$tmp/esp.img" "$out/esp.img"
log "EFI system partition disk in $out/esp.img"

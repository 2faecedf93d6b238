#!/usr/bin/env bash
# Boot benchmark: tandem vs QEMU (Debian's qemu-system-x86, -M microvm, with
# KVM and with TCG) on the same kernel, initramfs and command line, in one
# run: time from process start to "tandem-guest: ready" and the VMM's own
# memory (RSS minus guest RAM), min/median of N runs (default 5). QEMU loads
# the bzImage of the same kernel (it needs a PVH note to load a vmlinux);
# `--tandem-bzimage` also times tandem on the bzImage; `--pci` also boots a
# PCI machine with ACPI: tandem `--machine pci` vs QEMU `-M pc` (TCG, its
# SeaBIOS, PCI and ACPI; i440FX like tandem's); `--firmware OVMF.fd` also
# boots through that UEFI image: tandem `--firmware --machine pci --kernel
# bzImage-efi` vs QEMU `-M pc -bios` (TCG), both loading the same kernel
# with an EFI stub (built here: resources/build-guest.sh --efi), initramfs
# and command line through fw_cfg; and both again from a GPT disk whose EFI
# system partition holds them and a startup.nsh for OVMF's shell
# (resources/build-esp.sh), on virtio-blk over PCI (its rows may take
# --firmware-timeout seconds, default 1200).
#
# `--before REV` adds a row for tandem as it was at git revision REV, on the
# default guest REV built (its own kernel config, initramfs and command
# line): the tree at REV is checked out in a temporary directory, its guest
# built by its own resources/build-guest.sh (cached in ~/.cache/tandem like
# ours) and its tandem by cargo; all rows run interleaved in one run.
# `--sandbox-off` adds a row for tandem with its sandbox off (--seccomp off
# --landlock off: the sandbox's cost, same run).
# Usage: bench/boot.sh [--runs N] [--tandem-bzimage] [--pci] [--firmware OVMF_FD] [--sandbox-off]
#                      [--firmware-timeout S] [--before REV]
source "$(dirname "$0")/common.sh"
args=()
before=()
while [ $# -gt 0 ]; do
    case "$1" in
        --before)
            rev=${2:?--before needs a git revision}
            shift 2
            tree=$(mktemp -d "${TMPDIR:-/tmp}/tandem-before.XXXXXX")
            trap 'git worktree remove --force "$tree" >/dev/null 2>&1; rm -rf "$tree"' EXIT
            git worktree add --detach "$tree" "$rev" >/dev/null
            echo "boot.sh: building tandem and its guest at $rev in $tree" >&2
            (cd "$tree" && resources/build-guest.sh --no-deps >&2 &&
                cargo build --release --quiet -p vmm >&2)
            before=(--before "$(git rev-parse --short "$rev")" "$tree/target/release/tandem"
                "$tree/target/guest/vmlinux" "$tree/target/guest/initramfs.cpio"
                "$("$tree/target/release/tandem" run --print-cmdline)")
            ;;
        --firmware)
            resources/build-guest.sh --no-deps --efi >&2
            resources/build-esp.sh "$cmdline" >&2
            args+=("$1" "${2:?--firmware needs an image}" --firmware-bzimage target/guest/bzImage-efi
                --firmware-disk target/guest/esp.img)
            shift 2
            ;;
        *) args+=("$1"); shift ;;
    esac
done
python3 bench/boot_measure.py "${guest_args[@]}" "${before[@]}" "${args[@]}"

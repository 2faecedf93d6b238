#!/usr/bin/env bash
# A COLO pair of a guest booted from UEFI firmware (OVMF) on the PCI
# machine: ping to the guest alone and through the pair, the checkpoint
# pauses (p50/p99/max) and bytes, the initial sync, and the failover
# (primary killed -> the secondary serves, first ping reply). The guest
# boots through the firmware once (minutes here: the firmware runs in
# KVM's instruction emulator) and is saved; the snapshot is kept in
# ~/.cache/tandem (named after the inputs) and later runs restore it.
# Without --firmware the same PCI guest boots from its ELF kernel (seconds):
# the PCI machine's pair, and a quick check of the script.
# Needs: Debian's ovmf (/usr/share/ovmf/OVMF.fd) and the EFI kernel
# (resources/build-guest.sh --efi -> target/guest/bzImage-efi).
# It boots guests: run it under the guest lock.
# Usage: flock /tmp/tandem-guest.lock bench/colo_firmware.sh
#            [--firmware /usr/share/ovmf/OVMF.fd] [--efi-kernel BZIMAGE]
#            [--snapshot PATH] [--mem MIB] [--cpus N] [--period-ms P] [--pings N]
source "$(dirname "$0")/common.sh"
exec python3 bench/colo_firmware.py "${guest_args[@]}" "$@"

#!/usr/bin/env python3
"""Boot benchmark: time from process start to the guest's ready marker, and
the VMM's memory overhead (process RSS minus the RSS of guest RAM), for
tandem and QEMU (microvm, KVM and TCG) on the same kernel, initramfs and
command line, in one run. Prints min/median over N runs and the ratios.

Used by bench/boot.sh; not a test.
"""
import argparse
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import time

from common import READY


def guest_rss_kib(pid, mem_kib):
    """RSS of the process, and RSS of mappings at least as large as guest RAM."""
    total = guest = 0
    size = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                size = None
            elif line.startswith("Size:"):
                size = int(line.split()[1])
            elif line.startswith("Rss:"):
                rss = int(line.split()[1])
                total += rss
                if size is not None and size >= mem_kib:
                    guest += rss
    return total, guest


def one_run(cmd, mem_kib, timeout):
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    buf = b""
    ready = None
    try:
        while time.monotonic() - start < timeout:
            r, _, _ = select.select([p.stdout], [], [], 1.0)
            if r:
                chunk = os.read(p.stdout.fileno(), 65536)
                if not chunk:
                    break
                buf += chunk
                if READY in buf:
                    ready = time.monotonic() - start
                    break
        overhead = None
        if ready is not None:
            time.sleep(2)  # let the shell start
            total, guest = guest_rss_kib(p.pid, mem_kib)
            overhead = (total - guest) / 1024.0
        return ready, overhead, buf
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def fmt(v, unit):
    return "-" if v is None else f"{v:.2f} {unit}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--mem-mib", type=int, default=128)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--bzimage", required=True,
                    help="the same kernel as a bzImage (QEMU cannot load a vmlinux without a PVH note)")
    ap.add_argument("--initrd", required=True)
    ap.add_argument("--cmdline", required=True)
    ap.add_argument("--qemu", default="qemu-system-x86_64")
    ap.add_argument("--qemu-kvm-timeout", type=float, default=60,
                    help="QEMU with KVM stalls on this host: give up on it sooner")
    ap.add_argument("--pci", action="store_true",
                    help="also boot a PCI machine with ACPI: tandem --machine pci vs QEMU -M pc (TCG)")
    ap.add_argument("--firmware", metavar="OVMF_FD",
                    help="also boot through UEFI firmware: tandem --firmware --machine pci vs "
                         "QEMU -M pc -bios (TCG), the same image, each given the bzImage, "
                         "initramfs and command line to load (fw_cfg)")
    ap.add_argument("--firmware-bzimage",
                    help="the kernel the firmware rows load (it needs an EFI stub)")
    ap.add_argument("--firmware-disk",
                    help="also boot through the firmware from this disk image (GPT, EFI system "
                         "partition: resources/build-esp.sh), read-only, on virtio-blk over PCI")
    ap.add_argument("--firmware-timeout", type=float, default=1200,
                    help="seconds a firmware row may take to reach ready")
    ap.add_argument("--tandem-bzimage", action="store_true",
                    help="also time tandem booting the bzImage")
    ap.add_argument("--before", nargs=5, metavar=("NAME", "TANDEM", "KERNEL", "INITRD", "CMDLINE"),
                    help="also time an earlier tandem on its own default guest (bench/boot.sh --before REV)")
    ap.add_argument("--sandbox-off", action="store_true",
                    help="also a row for tandem with --seccomp off --landlock off (the sandbox's cost, same run)")
    args = ap.parse_args()

    mem = f"{args.mem_mib}M"
    qemu_base = [args.qemu, "-M", "microvm,acpi=off,x-option-roms=off,rtc=off",
                 "-m", mem, "-smp", "1", "-kernel", args.bzimage, "-initrd", args.initrd,
                 "-append", args.cmdline, "-nographic", "-nodefaults", "-serial", "stdio",
                 "-no-reboot"]
    peers = {
        "tandem (KVM)": [args.tandem, "run", "--kernel", args.kernel, "--initrd", args.initrd,
                         "--cmdline", args.cmdline, "--mem", mem],
        "QEMU microvm (KVM)": qemu_base + ["-accel", "kvm", "-cpu", "host,-arch-capabilities"],
        "QEMU microvm (TCG)": qemu_base + ["-accel", "tcg"],
    }
    if args.sandbox_off:
        peers["tandem sandbox off (KVM)"] = peers["tandem (KVM)"] + ["--seccomp", "off", "--landlock", "off"]
    if args.before:
        name, tandem, kernel, initrd, cmdline = args.before
        peers[f"tandem {name} (KVM)"] = [tandem, "run", "--kernel", kernel, "--initrd", initrd,
                                         "--cmdline", cmdline, "--mem", mem]
    if args.pci:
        peers["tandem pci+ACPI (KVM)"] = peers["tandem (KVM)"] + ["--machine", "pci"]
        peers["QEMU pc+ACPI (TCG)"] = [
            args.qemu, "-M", "pc", "-accel", "tcg", "-m", mem, "-smp", "1",
            "-kernel", args.bzimage, "-initrd", args.initrd, "-append", args.cmdline,
            "-nographic", "-nodefaults", "-serial", "stdio", "-no-reboot"]
    if args.firmware:
        efi = args.firmware_bzimage or args.bzimage
        peers["tandem OVMF pci (KVM)"] = [
            args.tandem, "run", "--firmware", args.firmware, "--machine", "pci",
            "--kernel", efi, "--initrd", args.initrd, "--cmdline", args.cmdline,
            "--mem", mem]
        peers["QEMU pc OVMF (TCG)"] = [
            args.qemu, "-M", "pc", "-accel", "tcg", "-bios", args.firmware, "-m", mem,
            "-smp", "1", "-kernel", efi, "-initrd", args.initrd, "-append",
            args.cmdline, "-nographic", "-nodefaults", "-serial", "stdio", "-no-reboot",
            "-net", "none"]
    if args.firmware and args.firmware_disk:
        peers["tandem OVMF disk (KVM)"] = [
            args.tandem, "run", "--firmware", args.firmware, "--machine", "pci",
            "--disk", f"path={args.firmware_disk},readonly=on", "--mem", mem]
        peers["QEMU pc OVMF disk (TCG)"] = [
            args.qemu, "-M", "pc", "-accel", "tcg", "-bios", args.firmware, "-m", mem,
            "-smp", "1", "-drive", f"file={args.firmware_disk},if=none,id=d0,format=raw,readonly=on",
            "-device", "virtio-blk-pci,drive=d0,disable-legacy=on", "-nographic", "-nodefaults",
            "-serial", "stdio", "-no-reboot", "-net", "none"]
    if args.tandem_bzimage:
        peers["tandem bzImage (KVM)"] = [args.tandem, "run", "--kernel", args.bzimage, "--initrd",
                                         args.initrd, "--cmdline", args.cmdline, "--mem", mem]
    results = {name: {"ready": [], "overhead": [], "failed": 0, "why": ""} for name in peers}
    for i in range(args.runs):
        for name, cmd in peers.items():
            timeout = args.qemu_kvm_timeout if name == "QEMU microvm (KVM)" else args.timeout
            if "OVMF" in name:
                timeout = args.firmware_timeout
            ready, overhead, out = one_run(cmd, args.mem_mib * 1024, timeout)
            r = results[name]
            if ready is None:
                r["failed"] += 1
                tail = out.decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                r["why"] = f"after {timeout:.0f} s, last line: {tail[0][:80]}"
            else:
                r["ready"].append(ready)
                r["overhead"].append(overhead)
            print(f"run {i + 1}/{args.runs} {name}: ready {fmt(ready, 's')}, "
                  f"overhead {fmt(overhead, 'MiB')}", file=sys.stderr, flush=True)

    def mm(xs):
        if not xs:
            return None, None
        return min(xs), statistics.median(xs)

    t_ready = mm(results["tandem (KVM)"]["ready"])
    t_over = mm(results["tandem (KVM)"]["overhead"])
    print(f"\nBoot to '{READY.decode()}', {args.mem_mib} MiB, 1 vCPU, {args.runs} runs, "
          f"same kernel/initramfs/cmdline;\n"
          f"tandem rows boot the ELF vmlinux (a --before row its own), the QEMU rows the same kernel's bzImage")
    print(f"{'VMM':<24} {'ready min':>10} {'ready med':>10} {'overhead min':>13} "
          f"{'overhead med':>13} {'ready ratio':>12}  notes")
    for name, r in results.items():
        rmin, rmed = mm(r["ready"])
        omin, omed = mm(r["overhead"])
        ratio = "-"
        # Firmware rows compare with tandem's firmware row.
        base = t_ready
        if "OVMF disk" in name:
            base = mm(results["tandem OVMF disk (KVM)"]["ready"])
        elif "OVMF" in name:
            base = mm(results["tandem OVMF pci (KVM)"]["ready"])
        if rmed is not None and base[1] is not None:
            ratio = f"{rmed / base[1]:.2f}x"
        note = f"did not reach ready in {r['failed']} run(s): {r['why']}" if r["failed"] else ""
        print(f"{name:<24} {fmt(rmin, 's'):>10} {fmt(rmed, 's'):>10} {fmt(omin, 'MiB'):>13} "
              f"{fmt(omed, 'MiB'):>13} {ratio:>12}  {note}")
    print("ready ratio = peer median / tandem median (above 1: tandem is faster); "
          "OVMF rows against tandem's OVMF row")


if __name__ == "__main__":
    main()

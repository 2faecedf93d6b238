#!/usr/bin/env python3
"""Disk benchmark: inside the guest, `blktool bench` (resources/rootfs/
blktool.c) writes the data disk's M MiB sequentially in 1 MiB O_DIRECT
requests, pass after pass for at least S seconds (then fdatasync), reads
them back the same way, then reads 4 KiB at random offsets for S seconds. tandem (KVM) and QEMU (microvm,
virtio-blk-device, TCG: QEMU with KVM cannot reach user space on this host)
boot the same kernel (tandem its vmlinux, QEMU the same kernel's bzImage)
with the same command line from a copy of the same ext4 root disk image
(root=/dev/vda, no initramfs), with a fresh sparse data disk (vdb) of M MiB;
both use the host page cache (QEMU's default cache=writeback; tandem writes
through to the file and fdatasyncs on flush). Each VMM is booted once; the
figures are repeated N times (min/median). Used by bench/blk.sh; not a test.
"""
import argparse
import os
import re
import shutil
import statistics
import tempfile

from net_measure import Console

KEYS = [("seq_write_mib_s", "seq write MiB/s"), ("seq_read_mib_s", "seq read MiB/s"),
        ("rand_read_4k_iops", "4K rand read IOPS")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--bzimage", required=True)
    ap.add_argument("--initrd", help="unused: the guests boot from the root disk")
    ap.add_argument("--cmdline", required=True)
    ap.add_argument("--rootfs", required=True)
    ap.add_argument("--sandbox-off", action="store_true",
                    help="also a row for tandem with --seccomp off --landlock off (the sandbox's cost, same run)")
    args = ap.parse_args()
    cmdline = args.cmdline + " root=/dev/vda"
    vmms = {
        "tandem (KVM)": lambda root, data: [
            args.tandem, "run", "--kernel", args.kernel, "--mem", "128M", "--cmdline", cmdline,
            "--disk", f"path={root}", "--disk", f"path={data}"],
        "QEMU microvm (TCG)": lambda root, data: [
            "qemu-system-x86_64", "-M", "microvm,acpi=off,rtc=off", "-accel", "tcg",
            "-m", "128M", "-kernel", args.bzimage, "-append", cmdline, "-nographic",
            "-nodefaults", "-serial", "stdio", "-no-reboot",
            "-drive", f"file={root},format=raw,if=none,id=d0",
            "-device", "virtio-blk-device,drive=d0",
            "-drive", f"file={data},format=raw,if=none,id=d1",
            "-device", "virtio-blk-device,drive=d1"],
    }
    if args.sandbox_off:
        on = vmms["tandem (KVM)"]
        vmms["tandem sandbox off"] = lambda root, data: on(root, data) + ["--seccomp", "off", "--landlock", "off"]
    results = {}
    for name, cmd in vmms.items():
        tmp = tempfile.mkdtemp(prefix="tandem-blk-bench-")
        root, data = os.path.join(tmp, "root.ext4"), os.path.join(tmp, "data.img")
        shutil.copyfile(args.rootfs, root)
        os.chmod(root, 0o644)
        with open(data, "wb") as f:
            f.truncate(args.mib << 20)
        con = Console(cmd(root, data))
        r = {k: [] for k, _ in KEYS}
        try:
            con.wait_for(b"tandem-guest: ready", 900)
            con.run("stty -echo")
            size = con.run("cat /sys/block/vdb/size")
            if str((args.mib << 20) // 512) not in size:
                raise RuntimeError(f"vdb is not the data disk: {size!r}")
            for k in range(args.runs):
                out = con.run(f"blktool bench /dev/vdb {args.mib} {args.seconds}",
                              timeout=1800)
                got = dict(re.findall(r"(\w+)=([\d.]+)", out))
                for key, _ in KEYS:
                    if key not in got:
                        raise RuntimeError(f"no {key} in {out[-400:]!r}")
                    r[key].append(float(got[key]))
                print(f"{name} run {k + 1}: " + ", ".join(
                    f"{label} {got[key]}" for key, label in KEYS), flush=True)
        except Exception as e:  # report, do not hide
            print(f"{name}: failed: {e}", flush=True)
        finally:
            con.close()
            shutil.rmtree(tmp, ignore_errors=True)
        results[name] = r

    def mm(xs):
        return (min(xs), statistics.median(xs)) if xs else (None, None)

    print(f"\n{args.runs} runs each; passes over {args.mib} MiB in 1 MiB O_DIRECT requests "
          f"and 4 KiB O_DIRECT random reads, {args.seconds:g} s each; same kernel, cmdline, "
          f"root image")
    print(f"{'VMM':<20}" + "".join(f"{label + ' (min/med)':>30}" for _, label in KEYS))
    for name, r in results.items():
        cols = []
        for key, _ in KEYS:
            lo, med = mm(r[key])
            cols.append("-" if lo is None else f"{lo:.1f}/{med:.1f}")
        print(f"{name:<20}" + "".join(f"{c:>30}" for c in cols))
    t, q = results.get("tandem (KVM)"), results.get("QEMU microvm (TCG)")
    if t and q:
        for key, label in KEYS:
            a, b = mm(t[key])[1], mm(q[key])[1]
            if a and b:
                print(f"{label} ratio tandem/QEMU-TCG (median): {a / b:.3f}x")


if __name__ == "__main__":
    main()

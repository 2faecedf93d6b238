"""A COLO pair of a PCI-machine guest booted from UEFI firmware (OVMF):
ping to the guest alone and through the pair, the checkpoint pauses, and
the failover (primary killed -> the secondary serves, first ping reply).

The guest boots once through the firmware (`tandem run --firmware FD
--machine pci --kernel EFI-BZIMAGE`: minutes on a host without hardware
virtualization) and is saved; that snapshot is kept (--snapshot, by default
in ~/.cache/tandem, named after the inputs) and every later run restores
it. Without --firmware the same PCI guest is booted from its ELF kernel
(seconds): the pair's figures of the PCI machine, and a quick check of
this script.

Runs as root in a network namespace it makes and removes (a bridge with
the host's address, the primary's and the secondary's taps); the VMMs it
starts are killed on every exit path. Prints a table and one JSON line."""

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import READY, Ns, ctl, exit_on_signals, kill, kill_all, log, spawn, tail, wait
from snapshot_measure import Console

GUEST, HOST, PREFIX = "192.0.2.2", "192.0.2.1", 24
MAC = "52:54:00:12:34:57"
TAPS = ("tfwp", "tfws")


class FwBridge(Ns):
    """Bridge br0 with the host's address, the primary's tap and the
    secondary's on it."""

    def links(self):
        self.ip("link", "add", "br0", "type", "bridge")
        self.ip("addr", "add", f"{HOST}/{PREFIX}", "dev", "br0")
        self.ip("link", "set", "br0", "up")
        for tap in TAPS:
            self.ip("tuntap", "add", "dev", tap, "mode", "tap")
            self.ip("link", "set", tap, "master", "br0")
            self.ip("link", "set", tap, "up")


def firmware_args(args):
    return ["--firmware", args.firmware] if args.firmware else []


def boot_cmd(args, api):
    """The boot: through the firmware (its kernel given through fw_cfg), or
    the ELF kernel directly; the PCI machine either way."""
    kernel = args.efi_kernel if args.firmware else args.kernel
    return [args.tandem, "run", *firmware_args(args), "--machine", "pci", "--kernel", kernel,
            "--initrd", args.initrd, "--cmdline", args.cmdline, "--mem", f"{args.mem}M",
            "--cpus", str(args.cpus), "--net", f"tap={TAPS[0]},mac={MAC}", "--api-sock", api]


def cache_path(args):
    """Where the snapshot of these inputs is kept."""
    h = hashlib.sha256()
    kernel = args.efi_kernel if args.firmware else args.kernel
    for f in filter(None, (args.firmware, kernel, args.initrd)):
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)} {st.st_size} {st.st_mtime_ns}\n".encode())
    h.update(f"{args.cmdline} {args.mem} {args.cpus}".encode())
    kind = "ovmf" if args.firmware else "pci"
    return os.path.expanduser(f"~/.cache/tandem/colo-{kind}-{h.hexdigest()[:16]}.snap")


def snapshot(args, tmp):
    """The kept snapshot, made now (one boot) if there is none."""
    path = args.snapshot or cache_path(args)
    if os.path.exists(path):
        log(f"restoring {path} (made before)")
        return path, None
    api, err = os.path.join(tmp, "boot.api"), os.path.join(tmp, "boot.err")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    t = time.monotonic()
    # The snapshot is written there (Landlock: docs/sandbox.md).
    p = spawn(boot_cmd(args, api) + ["--landlock-rule", f"{os.path.dirname(path)}:rw"], err)
    try:
        con = Console(p)
        con.wait_for(READY, args.boot_timeout)
        booted = time.monotonic() - t
        con.run("true", args.cmd_timeout)
        log(f"booted in {booted:.1f} s; saving {path}")
        a = ctl(args, api, "snapshot", path + ".tmp")
        if not a.get("ok"):
            raise RuntimeError(f"snapshot: {a}; {tail(err)}")
        os.rename(path + ".tmp", path)
        return path, booted
    finally:
        kill(p)


def ping(args, n):
    """`n` pings 200 ms apart: (avg, max, lost), ms."""
    out = subprocess.run(["ping", "-n", "-q", "-c", str(n), "-i", "0.2", "-W", "3", GUEST],
                         stdout=subprocess.PIPE, text=True).stdout
    rtt = re.search(r"= ([\d.]+)/([\d.]+)/([\d.]+)/", out)
    got = re.search(r"(\d+) received", out)
    if not rtt or not got:
        raise RuntimeError(f"ping: {out!r}")
    return {"avg_ms": float(rtt.group(2)), "max_ms": float(rtt.group(3)),
            "lost": n - int(got.group(1))}


def first_reply(limit):
    """Seconds until the guest answers a ping (one every 20 ms)."""
    t = time.monotonic()
    while time.monotonic() - t < limit:
        r = subprocess.run(["ping", "-n", "-c", "1", "-W", "0.02", GUEST],
                           stdout=subprocess.DEVNULL)
        if r.returncode == 0:
            return time.monotonic() - t
    raise TimeoutError(f"no ping reply within {limit} s")


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


def restore(args, snap, tmp):
    """The primary: the snapshot restored (its image given again)."""
    api = os.path.join(tmp, "p.api")
    # colo-start's lease is in tmp (Landlock: docs/sandbox.md).
    p = spawn([args.tandem, "run", "--restore", snap, *firmware_args(args), "--api-sock", api,
               "--landlock-rule", f"{tmp}:rw",
               "--net", f"tap={TAPS[0]},mac={MAC}"], os.path.join(tmp, "p.err"))
    con = Console(p)
    t = time.monotonic()
    con.wait_for(con.send("true"), args.cmd_timeout)
    return p, api, time.monotonic() - t


def pair(args, api_p, tmp):
    """The secondary (the same image, the PCI machine, the primary's size),
    and colo-start; returns it and its API socket once protected."""
    api, err = os.path.join(tmp, "s.api"), os.path.join(tmp, "s.err")
    sock, lease = os.path.join(tmp, "colo.sock"), os.path.join(tmp, "colo.lock")
    s = spawn([args.tandem, "run", "--colo", "secondary", "--colo-listen", f"unix:{sock}",
               "--colo-lease", lease, *firmware_args(args), "--machine", "pci",
               "--api-sock", api, "--net", f"tap={TAPS[1]},mac={MAC}"], err)
    wait("the secondary listens", 60, lambda: "waiting for a migration" in tail(err, 50))
    a = ctl(args, api_p, "colo-start", f"unix:{sock}", "--lease", lease,
            "--checkpoint-period-ms", str(args.period_ms))
    if not a.get("ok"):
        raise RuntimeError(f"colo-start: {a}")

    def protected():
        st = ctl(args, api_p, "colo-status")["colo"]
        if st["state"] == "retired":
            raise RuntimeError(f"the pair did not start: {st['reason']}; {tail(err)}")
        return st["state"] == "protected"
    wait("protected", 300, protected)
    return s, api


def measure(args, snap, tmp):
    res = {}
    p, api_p, res["restore_s"] = restore(args, snap, tmp)
    res["alone"] = ping(args, args.pings)
    log(f"alone: {res['alone']}")
    _, api_s = pair(args, api_p, tmp)
    res["pair"] = ping(args, args.pings)
    log(f"through the pair: {res['pair']}")
    st = ctl(args, api_p, "colo-status")["colo"]
    pauses = st["recent_pauses_ms"]
    res["checkpoints"] = {
        "total": st["checkpoints"]["total"], "by_reason": st["checkpoints"]["by_reason"],
        "pause_p50_ms": percentile(pauses, 0.5), "pause_p99_ms": percentile(pauses, 0.99),
        "pause_max_ms": max(pauses) if pauses else None,
        "mean_bytes": st["checkpoints"]["mean_bytes"],
        "sync_ms": st["sync"]["total_ms"]}
    res["compare"] = st["compare"]
    kill(p)
    t = time.monotonic()
    wait("the secondary serves", 30,
         lambda: ctl(args, api_s, "colo-status")["colo"]["state"] == "failed_over")
    res["failover_s"] = time.monotonic() - t
    res["first_reply_s"] = res["failover_s"] + first_reply(30)
    res["after"] = ping(args, 10)
    return res


def report(args, res, booted):
    a, pr, c = res["alone"], res["pair"], res["checkpoints"]
    kind = "OVMF" if args.firmware else "ELF kernel"
    print(f"COLO pair of a {args.mem} MiB {args.cpus}-vCPU PCI guest ({kind}), checkpoint every "
          f"{args.period_ms} ms; {args.pings} pings 200 ms apart")
    if booted is not None:
        print(f"  boot (once, then the snapshot): {booted:.1f} s")
    print(f"  restore: {res['restore_s']:.1f} s; initial sync {c['sync_ms']:.0f} ms")
    print(f"  ping alone:         avg {a['avg_ms']:.2f} ms, max {a['max_ms']:.2f} ms, "
          f"lost {a['lost']}")
    print(f"  ping through pair:  avg {pr['avg_ms']:.2f} ms, max {pr['max_ms']:.2f} ms, "
          f"lost {pr['lost']}")
    print(f"  checkpoints: {c['total']} ({c['by_reason']}); pause p50 {c['pause_p50_ms']:.1f} / "
          f"p99 {c['pause_p99_ms']:.1f} / max {c['pause_max_ms']:.1f} ms; "
          f"mean {c['mean_bytes'] / 1024:.0f} KiB")
    print(f"  failover: serving {res['failover_s'] * 1000:.0f} ms after the kill, first ping "
          f"reply {res['first_reply_s'] * 1000:.0f} ms; then avg {res['after']['avg_ms']:.2f} ms")
    print(json.dumps({"bench": "colo_firmware", "firmware": args.firmware, "boot_s": booted,
                      **res}))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--firmware", help="UEFI image (e.g. /usr/share/ovmf/OVMF.fd); "
                                       "without: the ELF kernel booted directly")
    ap.add_argument("--efi-kernel", default="target/guest/bzImage-efi",
                    help="the kernel the firmware loads (resources/build-guest.sh --efi)")
    ap.add_argument("--snapshot", help="the snapshot to restore (made there if missing)")
    ap.add_argument("--mem", type=int, default=256, help="MiB")
    ap.add_argument("--cpus", type=int, default=1)
    ap.add_argument("--period-ms", type=int, default=1000)
    ap.add_argument("--pings", type=int, default=100)
    ap.add_argument("--boot-timeout", type=float, default=1500)
    ap.add_argument("--cmd-timeout", type=float, default=120)
    ap.add_argument("--tmpdir", default=None)
    ap.add_argument("--bzimage", help="(unused: common.sh gives it)")
    for a in ("--tandem", "--kernel", "--initrd", "--cmdline"):
        ap.add_argument(a, required=True)
    args = ap.parse_args()
    args.cmdline += f" tandem.ip={GUEST}/{PREFIX}"
    for f in filter(None, (args.firmware, args.efi_kernel if args.firmware else None)):
        if not os.path.exists(f):
            ap.error(f"{f}: not found (OVMF: apt-get install ovmf; the EFI kernel: "
                     "resources/build-guest.sh --efi)")
    return args


def main():
    args = parse_args()
    exit_on_signals()
    tmp = tempfile.mkdtemp(prefix="tandem-colo-fw-", dir=args.tmpdir)
    ns = FwBridge("tandem-colo-fw", quiet=True)
    ns.enter()
    try:
        snap, booted = snapshot(args, tmp)
        res = measure(args, snap, tmp)
        report(args, res, booted)
    finally:
        kill_all()
        ns.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

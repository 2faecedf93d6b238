#!/usr/bin/env python3
"""Snapshot benchmark: pause latency, snapshot time and file size, and
restore-to-running time, for tandem (KVM) and QEMU (microvm, TCG: QEMU with
KVM cannot reach user space on this host), same kernel, initramfs and
command line, console-only guests, for each guest memory size, in one run.

Per size, each VMM boots one source guest, which writes the same 32 MiB of
pseudo-random data (busybox awk, srand(1): the same bytes in every guest)
into a tmpfs file and checksums it. Then, per run, interleaved (the order
alternates between runs), for each VMM:
  pause     tandem {"cmd":"pause"} / QEMU QMP `stop`: the VMM-reported time
            (tandem's pause_ms) and the client's round trip on a connected socket
  snapshot  of the paused guest: tandem {"cmd":"snapshot"} (written to F.tmp,
            fsynced, renamed) / QEMU `migrate` to `exec:cat > F` (QEMU 7.2 has
            no file: URI; bandwidth limit lifted), then `sync F`: the
            VMM-reported time (tandem's ms, QEMU's total-time, which does not
            include cat or the fsync) and the client's wall clock up to a
            whole, synced file (tandem: the answer; QEMU: query-migrate says
            completed and the sync is done)
  size      of the file
  restore   a new process from the file: `tandem run --restore F` / QEMU with
            `-incoming "exec:cat F"` and QMP `cont` once loaded (the source was
            paused, so QEMU stays paused after the load); time from process
            start until the guest shell answers an echo on the console.
            tandem restores twice: mapped (`--restore-memory map`, the
            default: the pages are mapped from the file, nothing is read
            before the guest runs) and copied (`--restore-memory copy`:
            every page read and its CRC checked first); for each, the
            VMM's own time to put memory in place (its log line)
  verify    the file's checksum in the restored guest equals the source's
The source then resumes (and answers an echo) before its next pause. The
snapshot file is read back from the page cache in both cases.

Used by bench/snapshot.sh; not a test.
"""
import argparse
import itertools
import json
import os
import re
import shlex
import shutil
import socket
import statistics
import tempfile
import time

import common
from common import READY, exit_on_signals, kill, kill_all, log, spawn, tail

MARKS = itertools.count(1)


class Console(common.Console):
    """The guest's serial console on the VMM's stdin/stdout, driven by
    command lines that end in a marker."""

    def send(self, cmd):
        """Sends a command line followed by an echo of a fresh marker; the
        marker as typed ($((n))) differs from what the shell prints."""
        n = next(MARKS)
        self.p.stdin.write(f"{cmd}; echo \"@@$(({n}))@@\"\n".encode())
        self.p.stdin.flush()
        return f"@@{n}@@".encode()

    def run(self, cmd, timeout):
        out = self.wait_for(self.send(cmd), timeout)
        return out.rsplit("@@", 2)[0]


class JsonSock:
    """A connected JSON-lines Unix socket (tandem's API, or QMP)."""

    def __init__(self, path, timeout):
        end = time.monotonic() + timeout
        while True:
            try:
                self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.s.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self.s.close()
                if time.monotonic() > end:
                    raise
                time.sleep(0.005)
        self.s.settimeout(600)
        self.buf = b""
        self.events = []  # QMP events met while waiting for answers

    def recv(self):
        while b"\n" not in self.buf:
            chunk = self.s.recv(65536)
            if not chunk:
                raise EOFError("socket closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def request(self, obj):
        """Sends one request; returns the answer and the round trip in ms."""
        data = (json.dumps(obj) + "\n").encode()
        t0 = time.monotonic()
        self.s.sendall(data)
        while True:
            ans = self.recv()
            if "event" not in ans:  # QMP events are not answers
                return ans, (time.monotonic() - t0) * 1000.0
            self.events.append(ans)

    def close(self):
        self.s.close()


class Qmp(JsonSock):
    def __init__(self, path, timeout):
        super().__init__(path, timeout)
        self.recv()  # greeting
        self.cmd("qmp_capabilities")

    def cmd(self, name, **args):
        req = {"execute": name}
        if args:
            req["arguments"] = args
        ans, ms = self.request(req)
        if "error" in ans:
            raise RuntimeError(f"QMP {name}: {ans['error']}")
        return ans["return"], ms


class Vmm:
    """One source guest of one VMM, and restores of its snapshots."""
    name = ""

    def __init__(self, args, mem_mib, tmp):
        self.args, self.mem_mib, self.tmp = args, mem_mib, tmp
        self.mem = f"{mem_mib}M"
        self.tag = self.name.split()[0].lower()
        self.err = os.path.join(tmp, f"{self.tag}-{mem_mib}.stderr")
        self.proc = self.con = self.ctl = None

    def boot(self):
        t0 = time.monotonic()
        self.proc = spawn(self.boot_cmd(), self.err)
        self.con = Console(self.proc)
        self.con.wait_for(READY, self.args.boot_timeout)
        booted = time.monotonic() - t0
        self.connect()
        self.con.run("stty -echo", 120)
        return booted

    def prepare(self, data_mib):
        """Writes the data file; returns (seconds, checksum)."""
        t0 = time.monotonic()
        # 16 KiB per printf: busybox awk writes each printf out, and strings
        # over ~32 KiB get an mmap of their own (both expensive here).
        awk = ("BEGIN{srand(1); m=2147483648; for(c=0;c<n;c++){b=\"\"; for(j=0;j<16;j++){k=\"\"; "
               "for(i=0;i<16;i++) k=k sprintf(\"%08x%08x%08x%08x%08x%08x%08x%08x\", rand()*m, "
               "rand()*m, rand()*m, rand()*m, rand()*m, rand()*m, rand()*m, rand()*m); b=b k}; "
               "printf \"%s\", b}}")
        self.con.run(f"awk -v n={data_mib * 64} '{awk}' >/tmp/f", self.args.cmd_timeout)
        secs = time.monotonic() - t0
        return secs, checksum(self.con, data_mib, self.args.cmd_timeout)


def checksum(con, data_mib, timeout):
    out = con.run("ls -l /tmp/f; sha256sum /tmp/f", timeout)
    words = out.split()
    if "/tmp/f" not in words or str(data_mib << 20) not in words:
        raise RuntimeError(f"data file not as expected: {out.strip()!r}")
    return words[words.index("/tmp/f", words.index("/tmp/f") + 1) - 1]


class Tandem(Vmm):
    name = "tandem (KVM)"

    def __init__(self, args, mem_mib, tmp):
        super().__init__(args, mem_mib, tmp)
        self.sock = os.path.join(tmp, f"tandem-{mem_mib}.sock")

    def boot_cmd(self):
        a = self.args
        return [a.tandem, "run", "--kernel", a.kernel, "--initrd", a.initrd, "--cmdline",
                a.cmdline, "--mem", self.mem, "--api-sock", self.sock,
                # Snapshots go to tmp (Landlock: docs/sandbox.md).
                "--landlock-rule", f"{self.tmp}:rw"]

    def connect(self):
        self.ctl = JsonSock(self.sock, 30)

    def call(self, obj):
        ans, ms = self.ctl.request(obj)
        if not ans.get("ok"):
            raise RuntimeError(f"tandem {obj}: {ans}")
        return ans, ms

    def pause(self):
        ans, ms = self.call({"cmd": "pause"})
        return ans["pause_ms"], ms

    def resume(self):
        self.call({"cmd": "resume"})

    def snapshot(self, path):
        ans, ms = self.call({"cmd": "snapshot", "path": path})
        size = os.stat(path).st_size
        if ans["file_bytes"] != size:
            raise RuntimeError(f"tandem says {ans['file_bytes']} bytes, the file has {size}")
        return ans["ms"], ms, size

    def restore(self, path, data_mib, sha, mode="map"):
        """Returns seconds from process start to the console's answer; keeps
        the VMM's own time to put memory in place (its log line) in
        self.placed_ms."""
        t0 = time.monotonic()
        p = spawn([self.args.tandem, "run", "--restore", path, "--mem", self.mem,
                   "--restore-memory", mode], self.err)
        try:
            con = Console(p)
            # Input from a pipe is held until the guest listens.
            con.wait_for(con.send("true"), self.args.restore_timeout)
            secs = time.monotonic() - t0
            verify(con, data_mib, sha, self.args.cmd_timeout)
            self.placed_ms = placed_ms(self.err, mode)
            return secs, None
        finally:
            kill(p)


def placed_ms(err_path, mode):
    """The last 'restore: ... in X ms' line tandem logged (RUST_LOG has
    vmm::builder=info): X, checked to be of `mode`."""
    with open(err_path, errors="replace") as f:
        found = PLACED.findall(f.read())
    if not found:
        raise RuntimeError(f"no restore line in {err_path}")
    how, ms = found[-1]
    want = "mapped from the file" if mode == "map" else "copied"
    if how != want:
        raise RuntimeError(f"--restore-memory {mode} logged '{how}'")
    return float(ms)


PLACED = re.compile(r"restore: \d+ pages of guest memory in \d+ runs, "
                    r"(mapped from the file|copied) in ([0-9.]+) ms")


class Qemu(Vmm):
    name = "QEMU microvm (TCG)"

    def __init__(self, args, mem_mib, tmp):
        super().__init__(args, mem_mib, tmp)
        self.qmp_path = os.path.join(tmp, f"qemu-{mem_mib}.qmp")

    def base_cmd(self, qmp_path):
        a = self.args
        return [a.qemu, "-M", "microvm,acpi=off,x-option-roms=off,rtc=off", "-accel", "tcg",
                "-m", self.mem, "-smp", "1", "-kernel", a.bzimage, "-initrd", a.initrd,
                "-append", a.cmdline, "-nographic", "-nodefaults", "-serial", "stdio",
                "-no-reboot", "-qmp", f"unix:{qmp_path},server=on,wait=off"]

    def boot_cmd(self):
        return self.base_cmd(self.qmp_path)

    def connect(self):
        self.ctl = Qmp(self.qmp_path, 30)
        # QEMU limits migration to 32 MiB/s by default; a save to a file
        # (libvirt's `virsh save`, for one) lifts the limit.
        self.ctl.cmd("migrate-set-parameters", **{"max-bandwidth": 1 << 40})

    def pause(self):
        _, ms = self.ctl.cmd("stop")
        return None, ms

    def resume(self):
        self.ctl.cmd("cont")

    def snapshot(self, path):
        done = path + ".synced"
        q = shlex.quote
        uri = f"exec:cat >{q(path)} && sync {q(path)} && : >{q(done)}"
        t0 = time.monotonic()
        self.ctl.cmd("migrate", uri=uri)
        while True:
            info, _ = self.ctl.cmd("query-migrate")
            st = info.get("status")
            if st == "completed":
                break
            if st in ("failed", "cancelled"):
                raise RuntimeError(f"QEMU migrate: {info}")
            time.sleep(0.002)
        while not os.path.exists(done):
            if time.monotonic() - t0 > self.args.cmd_timeout:
                raise TimeoutError("QEMU migrate: the file was never synced")
            time.sleep(0.002)
        wall = (time.monotonic() - t0) * 1000.0
        os.unlink(done)
        return float(info["total-time"]), wall, os.stat(path).st_size

    def restore(self, path, data_mib, sha):
        qmp_path = os.path.join(self.tmp, f"qemu-{self.mem_mib}-restore.qmp")
        t0 = time.monotonic()
        p = spawn(self.base_cmd(qmp_path) + ["-incoming", f"exec:cat {shlex.quote(path)}"],
                  self.err)
        qmp = None
        try:
            con = Console(p)
            qmp = Qmp(qmp_path, 30)
            while True:
                st, _ = qmp.cmd("query-status")
                if st["status"] != "inmigrate":
                    break
                if time.monotonic() - t0 > self.args.restore_timeout:
                    raise TimeoutError("QEMU -incoming: still loading")
                time.sleep(0.002)
            loaded = time.monotonic() - t0
            if st["status"] != "running":  # "paused": the source was stopped
                qmp.cmd("cont")
            con.wait_for(con.send("true"), self.args.restore_timeout)
            secs = time.monotonic() - t0
            verify(con, data_mib, sha, self.args.cmd_timeout)
            return secs, loaded
        finally:
            if qmp:
                qmp.close()
            kill(p)
            try:
                os.unlink(qmp_path)
            except FileNotFoundError:
                pass


def verify(con, data_mib, sha, timeout):
    got = checksum(con, data_mib, timeout)
    if got != sha:
        raise RuntimeError(f"checksum after restore {got} != {sha} before")


def one_round(vm, state, run, data_mib, res):
    """Resume (if paused), pause, snapshot, restore, verify; source left paused."""
    if state["paused"]:
        vm.resume()
        vm.con.run("true", 120)  # running again, shell idle
        time.sleep(1)
    vmm_pause, rtt_pause = vm.pause()
    state["paused"] = True
    path = os.path.join(vm.tmp, f"{vm.tag}-{vm.mem_mib}-{run}.snap")
    try:
        vmm_snap, wall_snap, size = vm.snapshot(path)
        restore, loaded = vm.restore(path, data_mib, state["sha"])
        copy = placed = placed_copy = None
        if isinstance(vm, Tandem):
            placed = vm.placed_ms
            copy, _ = vm.restore(path, data_mib, state["sha"], mode="copy")
            placed_copy = vm.placed_ms
    finally:
        for f in (path, path + ".tmp", path + ".synced"):
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass
    for k, v in [("pause_vmm_ms", vmm_pause), ("pause_rtt_ms", rtt_pause),
                 ("snap_vmm_ms", vmm_snap), ("snap_wall_ms", wall_snap),
                 ("file_mib", size / 1048576.0), ("restore_s", restore),
                 ("restore_copy_s", copy), ("placed_ms", placed),
                 ("placed_copy_ms", placed_copy)]:
        if v is not None:
            res[k].append(v)
    res["verified"] += 1
    extra = f" (loaded at {loaded:.2f} s)" if loaded is not None else ""
    if copy is not None:
        extra += (f", memory mapped in {placed:.1f} ms; by copy {copy:.2f} s to console, "
                  f"memory copied in {placed_copy:.1f} ms")
    vp = f"{vmm_pause:.2f} ms VMM, " if vmm_pause is not None else ""
    log(f"  {vm.name}: pause {vp}{rtt_pause:.2f} ms round trip; snapshot {vmm_snap:.0f} ms "
        f"VMM, {wall_snap:.0f} ms wall, {size / 1048576.0:.1f} MiB; restore to console "
        f"{restore:.2f} s{extra}; checksum ok")


FIGURES = [
    ("pause_vmm_ms", "pause, VMM-reported", "ms"),
    ("pause_rtt_ms", "pause, round trip", "ms"),
    ("snap_vmm_ms", "snapshot, VMM-reported", "ms"),
    ("snap_wall_ms", "snapshot, wall", "ms"),
    ("file_mib", "snapshot file size", "MiB"),
    ("restore_s", "restore to console", "s"),
    ("restore_copy_s", "restore to console, copy", "s"),
    ("placed_ms", "memory mapped, VMM", "ms"),
    ("placed_copy_ms", "memory copied, VMM", "ms"),
]


def mm(xs):
    return (min(xs), statistics.median(xs)) if xs else (None, None)


def fmt(v):
    if v is None:
        return "-"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sizes", default="128,1024", help="guest memory sizes in MiB, comma-separated")
    ap.add_argument("--data-mib", type=int, default=32)
    ap.add_argument("--vmms", default="tandem,qemu", help="which VMMs to run (default both)")
    ap.add_argument("--tmpdir", default=None, help="where snapshot files go (default: $TMPDIR or /tmp)")
    ap.add_argument("--boot-timeout", type=float, default=1200)
    ap.add_argument("--restore-timeout", type=float, default=600)
    ap.add_argument("--cmd-timeout", type=float, default=1200)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--bzimage", required=True)
    ap.add_argument("--initrd", required=True)
    ap.add_argument("--cmdline", required=True)
    ap.add_argument("--qemu", default="qemu-system-x86_64")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]

    exit_on_signals()
    # tandem logs how long a restore took to put memory in place.
    os.environ["RUST_LOG"] = "warn,vmm::builder=info"

    tmp = tempfile.mkdtemp(prefix="tandem-snapbench-", dir=args.tmpdir)
    results = {}
    try:
        for mem in sizes:
            results[mem] = run_size(args, mem, tmp)
    finally:
        kill_all()
        shutil.rmtree(tmp, ignore_errors=True)
    report(args, sizes, results)


def run_size(args, mem, tmp):
    vms = [c(args, mem, tmp) for c in (Tandem, Qemu) if c.name.split()[0].lower() in args.vmms]
    out = {}
    states = {}
    try:
        for vm in vms:
            res = out[vm.name] = {k: [] for k, _, _ in FIGURES}
            res.update(verified=0, failed=0, why="")
            try:
                booted = vm.boot()
                secs, sha = vm.prepare(args.data_mib)
                vm.pause()  # quiet while the other VMM boots and measures
                states[vm.name] = {"paused": True, "sha": sha}
                log(f"{mem} MiB {vm.name}: booted in {booted:.1f} s, wrote {args.data_mib} MiB "
                    f"in {secs:.1f} s, sha256 {sha[:16]}...")
            except Exception as e:  # report, do not hide
                res["failed"] += 1
                res["why"] = f"source: {e}; stderr: {tail(vm.err)}"
                log(f"{mem} MiB {vm.name}: source failed: {res['why']}")
        for run in range(args.runs):
            log(f"{mem} MiB, run {run + 1}/{args.runs}")
            order = vms if run % 2 == 0 else vms[::-1]
            for vm in order:
                if vm.name not in states:
                    continue
                res = out[vm.name]
                try:
                    one_round(vm, states[vm.name], run, args.data_mib, res)
                except Exception as e:  # report, do not hide
                    res["failed"] += 1
                    res["why"] = f"{e}; stderr: {tail(vm.err)}"
                    log(f"  {vm.name}: failed: {res['why']}")
    finally:
        for vm in vms:
            if vm.ctl:
                vm.ctl.close()
            if vm.proc:
                kill(vm.proc)
    return out


def report(args, sizes, results):
    t_name, q_name = Tandem.name, Qemu.name
    print(f"\nSnapshot benchmark: 1 vCPU, console only, {args.data_mib} MiB of data written "
          f"in the guest before the snapshot, {args.runs} run(s), same kernel/initramfs/cmdline "
          f"(tandem boots the ELF vmlinux, QEMU its bzImage); QEMU: migrate to exec:cat + sync, "
          f"-incoming exec:cat + cont")
    print(f"{'MiB':>5} {'figure':<28} {'tandem min':>11} {'tandem med':>11} "
          f"{'QEMU min':>11} {'QEMU med':>11} {'ratio t/Q':>10}")
    summary = {"bench": "snapshot", "runs": args.runs, "data_mib": args.data_mib, "sizes": {}}
    for mem in sizes:
        r = results.get(mem, {})
        t, q = r.get(t_name), r.get(q_name)
        summary["sizes"][str(mem)] = {}
        for key, label, unit in FIGURES:
            tmin, tmed = mm(t[key]) if t else (None, None)
            qmin, qmed = mm(q[key]) if q else (None, None)
            ratio = f"{tmed / qmed:.2f}x" if tmed is not None and qmed else "-"
            print(f"{mem:>5} {label + ' (' + unit + ')':<28} {fmt(tmin):>11} {fmt(tmed):>11} "
                  f"{fmt(qmin):>11} {fmt(qmed):>11} {ratio:>10}")
            summary["sizes"][str(mem)][key] = {
                "tandem": {"min": tmin, "median": tmed, "values": t[key] if t else []},
                "qemu": {"min": qmin, "median": qmed, "values": q[key] if q else []},
            }
        for name, rr in ((t_name, t), (q_name, q)):
            if rr is None:
                continue
            note = f"{mem:>5} {name}: checksum verified after {rr['verified']} of {args.runs} restores"
            if rr["failed"]:
                note += f"; {rr['failed']} failure(s), last: {rr['why'][:300]}"
            print(note)
            summary["sizes"][str(mem)][("tandem" if name == t_name else "qemu") + "_verified"] = rr["verified"]
    print("ratio = tandem median / QEMU median (below 1: tandem is faster or smaller). "
          "QEMU's VMM-reported snapshot time is its migration total-time (without cat and "
          "the fsync); tandem's includes writing and fsyncing the file. QEMU reports no pause "
          "time of its own.")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

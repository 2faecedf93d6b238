#!/usr/bin/env python3
"""Live-migration benchmark: tandem (KVM; the migration in its own thread,
and `--mode inline` in the device thread's event loop) vs QEMU 7.2
(microvm, TCG: QEMU with KVM cannot reach user space on this host), same
kernel, initramfs and command line, --cpus vCPUs (QEMU: -smp; default 1),
one virtio-net NIC.

Per guest size, each VMM boots one guest once, on a tap on a bridge in a
network namespace made here (the host's address on the bridge, the guest's
from the kernel command line, tandem.ip=), starts `tandem-jitter` (sends
its gaps to the bench over UDP) and is snapshotted: `idle` as it is, then
`dirty` once `tandem-dirty 256 200` has touched its 256 MiB (minutes under
tandem here: every page fault is emulated) and rewrites them at 200 MiB/s.
With N vCPUs the dirtying is N `tandem-dirty 256/N 200/N`, one pinned to
each vCPU (`taskset -c`), started one after another, each once the one
before said it is ready: the same memory and (integer division aside) the
same total rate (--dirty-mib, --dirty-rate change the totals).
Then per run, interleaved (the order of the modes alternates between runs),
for each workload, bandwidth and mode: a source restored from the snapshot
(tandem `run --restore F`; QEMU `-incoming "exec:cat F"` + `cont`) and a
destination (tandem `run --incoming unix:P`; QEMU `-incoming unix:P`), both
NICs on the bridge; the guest's gaps are taken for --quiet-s with no ping
(its floor, "quiet"), then with pings for --before-s ("before"), then it
migrates with a 300 ms downtime budget, auto-converge on (both: 20%,
then +10% a round) and the bandwidth (0: unlimited; QEMU's default 32 MiB/s
cap lifted), within --timeout-s (QEMU: cancelled then). "During" is from
the migration's start until 1 s after its end. At the end the destination's
console must answer. Min/median per figure, ratios of medians vs QEMU, the
issue's targets, and a JSON line.

Used by bench/migrate.sh; not a test. Traffic stays in the namespace.
"""
import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import snapshot_measure as sm
from migrate_probe import Jitter, Pinger, window
from common import Ns, exit_on_signals, kill, kill_all, log, spawn, tail
from snapshot_measure import Console, Qmp

GUEST, HOST, PREFIX = "192.0.2.2", "192.0.2.1", 24
MAC = "52:54:00:12:34:56"
JITTER_PORT = 7777
DIRTY_MIB, DIRTY_RATE = 256, 200  # the defaults of --dirty-mib, --dirty-rate
GRACE_S = 1.0  # "during" runs on this long after the migration ended
TANDEM_MODES, QEMU_MODE = ("thread", "inline"), "qemu"
LABELS = {"thread": "tandem thread", "inline": "tandem inline", "qemu": "QEMU (TCG)",
          "postcopy": "tandem post-copy"}
# threadN (N 2 to 16): the migration thread with --connections N.
STREAMS = re.compile(r"thread([0-9]+)$")


def streams(mode):
    """The streams a mode migrates over: N for threadN, else 1."""
    m = STREAMS.match(mode)
    return int(m.group(1)) if m else 1


def mode_label(mode):
    n = streams(mode)
    return f"tandem thread x{n}" if n > 1 else LABELS[mode]


class Bridge(Ns):
    """A namespace with bridge br0 (the host's address, a fixed MAC) and
    every VMM's taps on it: a source's and a destination's per VMM. The
    bench itself runs in it (enter() on the main thread, before any other
    thread: threads and children inherit it)."""
    TAPS = {"tandem": ("tsrc", "tdst"), "qemu": ("qsrc", "qdst")}

    def links(self):
        self.ip("link", "add", "br0", "address", "02:00:00:00:00:01", "type", "bridge")
        self.ip("addr", "add", f"{HOST}/{PREFIX}", "dev", "br0")
        self.ip("link", "set", "br0", "up")
        for vmm, taps in self.TAPS.items():
            for tap in taps:
                # QEMU's taps as bench/net.sh makes them.
                extra = ["vnet_hdr"] if vmm == "qemu" else []
                self.ip("tuntap", "add", "dev", tap, "mode", "tap", *extra)
                self.ip("link", "set", tap, "master", "br0")
                self.ip("link", "set", tap, "up")


def unlink(*paths):
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


class Guest:
    """What both VMMs share: the source's snapshots, made once per size,
    and the steps of one migration."""

    def make_snapshots(self, workloads, jit, snaps):
        """Boots, starts the guest tools, saves a snapshot per workload
        into `snaps` ({workload: path}; those made survive a failure)."""
        a = self.args
        booted = self.boot()
        t = time.monotonic()
        self.con.run(f"tandem-jitter {HOST}:{JITTER_PORT} & true", a.cmd_timeout)
        jit.wait(t, 120, "after the boot")
        log(f"{self.mem_mib} MiB {self.name}: booted in {booted:.1f} s, tandem-jitter reports")
        online = self.con.run("echo cpus=$(nproc)", a.cmd_timeout)
        if f"cpus={a.cpus}" not in online:
            raise RuntimeError(f"the guest has not {a.cpus} vCPUs online: {online.strip()!r}")
        if "idle" in workloads:
            snaps["idle"] = self.save("idle", resume=True)
        if "dirty" in workloads:
            # tandem-dirty's first touch alone: beside tandem-jitter's 1 ms
            # loop each page fault of the emulated kernel costs some 5 times
            # more (19.6 min instead of ~4 for 256 MiB here).
            self.con.run("killall tandem-jitter; while pidof tandem-jitter; do sleep 1; done",
                         a.cmd_timeout)
            self.start_dirty()
            t = time.monotonic()
            self.con.run(f"tandem-jitter {HOST}:{JITTER_PORT} & true", a.cmd_timeout)
            jit.wait(t, 30, "with tandem-dirty running")
            snaps["dirty"] = self.save("dirty", resume=False)
        self.ctl.close()
        self.ctl = None
        kill(self.proc)
        self.proc = None

    def start_dirty(self):
        """The dirtying load: one tandem-dirty per vCPU, pinned to it when
        there are several, each started once the one before is ready (its
        first touch alone: freshly started processes side by side are at
        risk on this host, design.md §9)."""
        a = self.args
        mib, rate = dirty_split(a)
        for cpu in range(a.cpus):
            pin = f"taskset -c {cpu} " if a.cpus > 1 else ""
            t = time.monotonic()
            out = self.con.run(f"{pin}tandem-dirty {mib} {rate} & true", a.cmd_timeout)
            while not (m := re.search(r"tandem-dirty: \d+ MiB ready in \d+ ms", out)):
                out += self.con.wait_for(b"\n", a.dirty_timeout)
            log(f"{self.mem_mib} MiB {self.name}: {pin}{m.group(0)} "
                f"({time.monotonic() - t:.0f} s wall)")

    def save(self, workload, resume):
        path = os.path.join(self.tmp, f"{self.tag}-{self.mem_mib}-{workload}.snap")
        self.pause()
        _, wall, size = self.snapshot(path)
        log(f"{self.mem_mib} MiB {self.name}: {workload} snapshot, {size / 1048576:.0f} MiB "
            f"in {wall / 1000:.1f} s")
        if resume:
            self.resume()
            self.con.run("true", self.args.cmd_timeout)
        return path

    def migration(self, snap, mode, bw, jit, err):
        """One migration of a source restored from `snap`; returns its
        figures (a dict; "why" says what failed)."""
        a = self.args
        run = {"procs": []}
        try:
            t_start = time.monotonic()
            self.restore(run, snap, err)
            self.destination(run, err)
            # The first datagram may span the restore: the quiet window
            # (no pings yet: the guest's own floor) starts after it.
            t_quiet = jit.wait(t_start, 60, "after the restore") + 0.2
            time.sleep(max(0.0, t_quiet + a.quiet_s - time.monotonic()))
            t_before = time.monotonic()
            pinger = Pinger(GUEST, a.ping_ms / 1000.0)
            try:
                time.sleep(a.before_s)
                t0 = time.monotonic()
                res = self.migrate(run, mode, bw)
                t1 = time.monotonic()
                # --window-s: the guest watched that long from t_before.
                time.sleep(max(GRACE_S, t_before + a.window_s - time.monotonic()))
            finally:
                pings = pinger.stop()
            # The migration ended (the source's own total time) before the
            # client saw it: it polls every 100 ms.
            t_end = t0 + res["total_s"] if res.get("total_s") else t1
            res.update(felt(pings, jit, (t_quiet, t_before, t0, t1), t_end))
            if a.window_s:
                w = window(pings, *jit.gaps(t_quiet, time.monotonic())[:2], t_before,
                           t_before + a.window_s)
                res.update(window_over_400=w["gaps_over_400"], window_gap_ms=w["max_gap_ms"],
                           window_rtt_max_ms=w["rtt_max_ms"])
            if res["converged"]:
                self.arrived(run, res)
            return res
        finally:
            for p in run["procs"]:
                kill(p)
            for q in run.get("qmps", []):
                q.close()
            unlink(*run.get("files", []))


def dirty_split(args):
    """Each vCPU's tandem-dirty: (MiB, MiB/s), the totals split evenly."""
    return max(1, args.dirty_mib // args.cpus), max(1, args.dirty_rate // args.cpus)


def dirty_text(args):
    mib, rate = dirty_split(args)
    one = f"tandem-dirty {mib} {rate}"
    return one if args.cpus == 1 else f"{args.cpus} x {one} (one pinned per vCPU)"


def label(args, mode):
    """A row's label: the VMM, and the vCPU count when it is not 1."""
    return mode_label(mode) if args.cpus == 1 else f"{mode_label(mode)} {args.cpus}vCPU"


def felt(pings, jit, marks, t_end):
    """What the guest felt: quiet [t_quiet, t_before), before [t_before, t0),
    during [t0, t1 + GRACE_S]; where the largest gap during ended, from
    t_end (the migration's end)."""
    t_quiet, t_before, t0, t1 = marks
    gaps, maxima, bad = jit.gaps(t_quiet, time.monotonic())
    quiet = window(pings, gaps, maxima, t_quiet, t_before)
    before = window(pings, gaps, maxima, t_before, t0)
    during = window(pings, gaps, maxima, t0, t1 + GRACE_S)
    res = {"gap_quiet_ms": quiet["max_gap_ms"], "gap_before_ms": before["max_gap_ms"],
           "gap_during_ms": during["max_gap_ms"], "rtt_avg_ms": during["rtt_avg_ms"],
           "rtt_max_ms": during["rtt_max_ms"], "loss_pct": during["loss_pct"],
           "rtt_before_ms": before["rtt_avg_ms"], "loss_before_pct": before["loss_pct"],
           "reports": during["reports"], "pings": during["pings"], "bad_datagrams": bad}
    if during["max_gap_t"] is not None:  # where the largest gap ended, s after the end
        res["gap_during_at_s"] = during["max_gap_t"] - t_end
    if before["reports"] == 0:
        res["why"] = "no datagram from tandem-jitter before the migration"
    return res


class TandemGuest(Guest, sm.Tandem):
    name = "tandem (KVM)"

    def boot_cmd(self):
        return super().boot_cmd() + ["--cpus", str(self.args.cpus)] + self.net(0)

    def net(self, i):
        return ["--net", f"tap={Bridge.TAPS['tandem'][i]},mac={MAC}"]

    def sandbox(self):
        if self.args.sandbox == "off":
            return ["--seccomp", "off", "--landlock", "off"]
        return []

    def restore(self, run, snap, err):
        api = os.path.join(self.tmp, "tandem-src.api")
        p = spawn([self.args.tandem, "run", "--restore", snap, "--api-sock", api] + self.net(0)
                  + self.sandbox(),
                  err + ".src")
        run["procs"].append(p)
        run.update(src=p, api=api, files=[api])
        con = Console(p)
        # Input from a pipe is held until the guest listens.
        con.wait_for(con.send("true"), self.args.restore_timeout)

    def destination(self, run, err):
        sock = os.path.join(self.tmp, "tandem-mig.sock")
        api = os.path.join(self.tmp, "tandem-dst.api")
        # TCP on the namespace's loopback, or a Unix socket (--stream).
        to = "tcp:127.0.0.1:4490" if self.args.stream == "tcp" else f"unix:{sock}"
        p = spawn([self.args.tandem, "run", "--incoming", to, "--mem", self.mem,
                   "--cpus", str(self.args.cpus), "--api-sock", api] + self.net(1)
                  + self.sandbox(),
                  err + ".dst")
        run["procs"].append(p)
        run.update(dst=p, dst_con=Console(p), to=to, dst_err=err + ".dst")
        run["files"] += [sock, api]
        end = time.monotonic() + 60
        while "waiting for a migration on" not in tail(err + ".dst", 50):
            if p.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the destination did not listen: {tail(err + '.dst')}")
            time.sleep(0.05)

    def migrate(self, run, mode, bw):
        a = self.args
        cmd = [a.tandem, "ctl", "--api-sock", run["api"], "migrate", run["to"], "--json",
               "--downtime-ms", str(a.downtime_ms), "--timeout-s", str(a.timeout_s),
               "--initially-set", a.initially_set]
        n = streams(mode)
        if n > 1:
            cmd += ["--mode", "thread", "--connections", str(n)]
        elif mode == "postcopy":
            # Switched after round 0: the destination fetches what the
            # guest dirtied meanwhile.
            cmd += ["--mode", "thread", "--postcopy", "--postcopy-after-rounds", "1"]
        else:
            cmd += ["--mode", mode]
        if bw:
            cmd += ["--bandwidth", str(bw)]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             timeout=a.timeout_s + 120)
        try:
            rep = json.loads(out.stdout)
        except ValueError:
            raise RuntimeError(f"tandem ctl migrate: status {out.returncode}, no JSON: "
                               f"{out.stdout[-300:]!r} {out.stderr[-300:]!r}")
        converged = out.returncode == 0 and rep.get("phase") == "completed"
        res = {"converged": converged, "total_s": rep.get("total_ms", 0) / 1000.0,
               "downtime_ms": rep.get("downtime_ms") if converged else None,
               "sent_mib": rep.get("sent_bytes", 0) / 1048576.0,
               "rounds": len(rep.get("rounds") or []), "throttle_pct": rep.get("throttle"),
               "setup_ms": rep.get("setup_ms"), "dirty_rate_mib": rep.get("dirty_rate_mib"),
               "log_start_ms": rep.get("log_start_ms"), "log_all_dirty": rep.get("log_all_dirty"),
               "send_mib_s": rep.get("send_rate_mib"),
               "pc_pages": (rep.get("postcopy") or {}).get("needed_pages"),
               "pc_faults": (rep.get("postcopy") or {}).get("faults"),
               "pc_p99_ms": (rep.get("postcopy") or {}).get("fault_p99_ms"),
               "pc_max_ms": (rep.get("postcopy") or {}).get("fault_max_ms"),
               "pc_fetch_ms": (rep.get("postcopy") or {}).get("fetch_ms"),
               "last_pages_ms": (rep.get("downtime_parts") or {}).get("pages_ms")}
        if not converged:
            res["why"] = f"{rep.get('phase')}: {rep.get('error')}"
        return res

    def arrived(self, run, res):
        """The source exited 0; the guest's console answers at the destination.
        Adds the downtime as both VMMs are measured: source paused ->
        destination running (tandem's own figure ends when the source sent
        its go; the destination says how long it took after that)."""
        code = run["src"].wait(timeout=60)
        con = run["dst_con"]
        con.wait_for(con.send("true"), self.args.cmd_timeout)
        if code != 0:
            raise RuntimeError(f"the source exited {code} after a completed migration")
        m = re.search(r"resumed ([0-9.]+) ms after the source's go", tail(run["dst_err"], 4000))
        if m and res.get("downtime_ms") is not None:
            res["paused_to_running_ms"] = res["downtime_ms"] + float(m.group(1))


class QemuGuest(Guest, sm.Qemu):
    name = "QEMU microvm (TCG)"

    def vm_cmd(self, qmp_path, i):
        tap = Bridge.TAPS["qemu"][i]
        cmd = self.base_cmd(qmp_path)
        cmd[cmd.index("-smp") + 1] = str(self.args.cpus)
        return cmd + [
            "-netdev", f"tap,id=n0,ifname={tap},script=no,downscript=no,vhost=off",
            "-device", f"virtio-net-device,netdev=n0,mac={MAC}"]

    def boot_cmd(self):
        return self.vm_cmd(self.qmp_path, 0)

    def start(self, run, i, incoming, err):
        qmp_path = os.path.join(self.tmp, f"qemu-{i}.qmp")
        p = spawn(self.vm_cmd(qmp_path, i) + ["-incoming", incoming], err)
        run["procs"].append(p)
        run.setdefault("files", []).append(qmp_path)
        qmp = Qmp(qmp_path, 60)
        run.setdefault("qmps", []).append(qmp)
        return p, qmp

    def restore(self, run, snap, err):
        p, qmp = self.start(run, 0, f"exec:cat {shlex.quote(snap)}", err + ".src")
        end = time.monotonic() + self.args.restore_timeout
        while True:
            st, _ = qmp.cmd("query-status")
            if st["status"] != "inmigrate":
                break
            if time.monotonic() > end:
                raise TimeoutError("QEMU -incoming: still loading")
            time.sleep(0.01)
        if st["status"] != "running":  # "paused": the snapshot's guest was stopped
            qmp.cmd("cont")
        con = Console(p)
        con.wait_for(con.send("true"), self.args.restore_timeout)
        run.update(src=p, qmp=qmp)

    def destination(self, run, err):
        sock = os.path.join(self.tmp, "qemu-mig.sock")
        p, qmp = self.start(run, 1, f"unix:{sock}", err + ".dst")
        run.update(dst=p, dst_con=Console(p), dst_qmp=qmp, to=f"unix:{sock}")
        run["files"].append(sock)

    def migrate(self, run, mode, bw):
        a, q = self.args, run["qmp"]
        q.cmd("migrate-set-capabilities",
              capabilities=[{"capability": "auto-converge", "state": True}])
        # QEMU's default cap is 32 MiB/s: "unlimited" is a cap far above it.
        q.cmd("migrate-set-parameters", **{"downtime-limit": a.downtime_ms,
                                           "max-bandwidth": (bw << 20) if bw else 1 << 40,
                                           "cpu-throttle-initial": 20,
                                           "cpu-throttle-increment": 10})
        t0 = time.monotonic()
        q.cmd("migrate", uri=run["to"])
        throttle, cancelled, ram = 0, False, {}
        while True:
            info, _ = q.cmd("query-migrate")
            st = info.get("status")
            throttle = max(throttle, info.get("cpu-throttle-percentage", 0))
            ram = info.get("ram") or ram
            if st in ("completed", "failed", "cancelled"):
                break
            if not cancelled and time.monotonic() - t0 > a.timeout_s:
                q.cmd("migrate_cancel")
                cancelled = True
            time.sleep(0.02)
        converged = st == "completed"
        res = {"converged": converged,
               "total_s": info.get("total-time", (time.monotonic() - t0) * 1000.0) / 1000.0,
               "downtime_ms": info.get("downtime") if converged else None,
               "sent_mib": ram.get("transferred", 0) / 1048576.0,
               "rounds": ram.get("dirty-sync-count"), "throttle_pct": throttle,
               "setup_ms": info.get("setup-time"),
               # the last measured, as tandem's
               "dirty_rate_mib": ram.get("dirty-pages-rate", 0) * ram.get("page-size", 4096)
               / 1048576.0}
        if not converged:
            res["why"] = f"{st}" + (f" after {a.timeout_s} s (cancelled)" if cancelled else
                                    f": {info.get('error-desc')}")
        return res

    def arrived(self, run, res):
        """The destination runs the guest, and its console answers. Adds
        the downtime measured as tandem's is: the source's STOP event to the
        destination's RESUME event (QMP stamps both with the host's clock,
        in us); QEMU's own figure ends when the source sent its last byte."""
        end = time.monotonic() + 60
        dst = run["dst_qmp"]
        while True:
            st, _ = dst.cmd("query-status")
            resumed = [e for e in dst.events if e["event"] == "RESUME"]
            if st["status"] == "running" and resumed:
                break
            if time.monotonic() > end:
                raise RuntimeError(f"QEMU destination: {st['status']} after the migration")
            time.sleep(0.01)
        stops = [e for e in run["qmp"].events if e["event"] == "STOP"]
        if stops:
            stamp = lambda e: e["timestamp"]["seconds"] + e["timestamp"]["microseconds"] / 1e6
            res["paused_to_running_ms"] = (stamp(resumed[0]) - stamp(stops[-1])) * 1000.0
        con = run["dst_con"]
        con.wait_for(con.send("true"), self.args.cmd_timeout)


FIGURES = [  # key, header, format
    ("total_s", "total s", "{:.2f}"),
    ("log_start_ms", "log start", "{:.2f}"),
    ("downtime_ms", "downtime ms", "{:.0f}"),
    ("paused_to_running_ms", "paused->run", "{:.1f}"),
    ("sent_mib", "MiB sent", "{:.0f}"),
    ("send_mib_s", "send MiB/s", "{:.0f}"),
    ("last_pages_ms", "last pages", "{:.1f}"),
    ("rounds", "rounds", "{:.0f}"),
    ("gap_quiet_ms", "gap quiet", "{:.0f}"),
    ("gap_before_ms", "gap before", "{:.0f}"),
    ("gap_during_ms", "gap during", "{:.0f}"),
    ("rtt_avg_ms", "rtt avg ms", "{:.1f}"),
    ("rtt_max_ms", "rtt max ms", "{:.0f}"),
    ("loss_pct", "loss %", "{:.1f}"),
    # With --window-s W: over the W s from the pings' start (before the
    # migration) on: gaps over 400 ms, the largest gap, the largest RTT.
    ("window_over_400", ">400 in W", "{:.0f}"),
    ("window_gap_ms", "gap in W", "{:.0f}"),
    ("window_rtt_max_ms", "rtt max W", "{:.0f}"),
    # Post-copy: pages fetched after the switch, the faults the guest
    # waited on, their p99 and largest wait, and the fetch's length.
    ("pc_pages", "pc pages", "{:.0f}"),
    ("pc_faults", "pc faults", "{:.0f}"),
    ("pc_p99_ms", "pc p99 ms", "{:.2f}"),
    ("pc_max_ms", "pc max ms", "{:.1f}"),
    ("pc_fetch_ms", "pc fetch ms", "{:.0f}"),
]


def values(runs, key):
    return [r[key] for r in runs if r.get(key) is not None]


def cell(runs, key, form):
    xs = values(runs, key)
    if not xs:
        return "-"
    lo, med = sm.mm(xs)
    return f"{form.format(lo)}/{form.format(med)}"


def median(runs, key):
    xs = values(runs, key)
    return sm.mm(xs)[1] if xs else None


def ratio(a, b):
    return f"{a / b:.2f}x" if a is not None and b else "-"


def targets(case, modes):
    """The issue's targets for one case, as lines."""
    t, i, q = (case.get(m, {}).get("runs", []) for m in ("thread", "inline", "qemu"))
    lines = []
    for key, what, form in (("downtime_ms", "each VMM's own figure", fmt),
                            ("paused_to_running_ms", "source paused -> destination running",
                             lambda v: "-" if v is None else f"{v:.1f}")):
        qd = median(q, key)
        for m, rs in (("thread", t), ("inline", i)):
            d = median(rs, key)
            if m in modes and QEMU_MODE in modes:
                ok = ("no figure to compare" if d is None or qd is None else
                      "met" if d <= qd else "NOT met")
                lines.append(f"  downtime <= QEMU's at the same budget ({m}, {what}): median "
                             f"{form(d)} vs {form(qd)} ms: {ok}")
    conv = []
    for m in modes:
        rs = case.get(m, {}).get("runs", [])
        n = len(rs) + len(case.get(m, {}).get("failures", []))
        conv.append(f"{m} {sum(1 for r in rs if r['converged'])}/{n}")
    lines.append(f"  every run converges: {', '.join(conv)}")
    if "thread" in modes:
        ok = [r for r in t if r["converged"] and r.get("gap_during_ms") is not None]
        good = [r for r in ok if r["gap_during_ms"] <= bound(r)]
        worst = max(ok, key=lambda r: r["gap_during_ms"] - bound(r), default=None)
        w = (f" (worst: {worst['gap_during_ms']:.0f} vs {bound(worst):.0f} ms)"
             if worst else "")
        lines.append(f"  thread: guest max gap during <= max(floor, downtime) + 20 ms: "
                     f"{len(good)}/{len(t)} runs{w}")
    if "thread" in modes and "inline" in modes:
        parts = []
        for key, label in (("gap_during_ms", "gap during"), ("rtt_max_ms", "rtt max"),
                           ("downtime_ms", "downtime")):
            a, b = median(i, key), median(t, key)
            if a is not None and b is not None:
                parts.append(f"{label} {a:.0f} vs {b:.0f} ms ({a - b:+.0f})")
        lines.append(f"  inline measurably worse than thread (medians, inline vs thread): "
                     f"{'; '.join(parts) or '-'}")
    return lines


def bound(r):
    """The jitter target's bound for one run: the larger of the guest's own
    floor (its max gap before the migration) and the downtime, + 20 ms."""
    return max(r.get("gap_before_ms") or 0.0, r.get("downtime_ms") or 0.0) + 20.0


def fmt(v):
    return "-" if v is None else f"{v:.0f}"


def report(args, results):
    cpus = f"{args.cpus} vCPU" + ("s" if args.cpus > 1 else "")
    print(f"\nMigration benchmark: {cpus}, one virtio-net NIC on a bridge, source restored "
          f"from a snapshot per run, downtime budget {args.downtime_ms} ms, auto-converge on, "
          f"time limit {args.timeout_s} s, {args.runs} run(s); tandem (KVM, this host emulates "
          f"the guest kernel) vs QEMU 7.2 microvm (TCG); min/median per figure; gaps: the "
          f"guest's tandem-jitter max gap (ms) before / during (from the start until "
          f"{GRACE_S:.0f} s after the end; quiet: before any ping); ping every "
          f"{args.ping_ms:g} ms; ratio rows: median/median")
    summary = {"bench": "migrate", "runs": args.runs, "downtime_ms": args.downtime_ms,
               "auto_converge": True, "timeout_s": args.timeout_s, "ping_ms": args.ping_ms,
               "cpus": args.cpus, "dirty": dirty_text(args), "cases": []}
    for key, case in results.items():
        print_case(args, key, case)
        summary["cases"] += case_json(args, key, case)
    print("\ntargets (issue 13): downtime <= QEMU's at the same budget; every run converges; "
          "with the thread, guest max gap during <= max(floor, downtime) + 20 ms (floor: the "
          "run's own max gap before); inline measurably worse. rounds: tandem's rounds incl. "
          "the first pass and the stop-and-copy, QEMU's dirty-sync-count; downtime: each "
          "VMM's own figure (tandem: source paused -> the source sent its go, after the "
          "destination applied the state; QEMU: until the source sent its last byte), "
          "converged runs only; paused->run: source paused -> destination running, for both "
          "(tandem: its downtime + the destination's go -> resumed; QEMU: the source's STOP "
          "-> the destination's RESUME QMP event); MiB sent: RAM stream bytes.")
    print(json.dumps(summary))


def print_case(args, key, case):
    mem, wl, bw = key
    vcpus = "" if args.cpus == 1 else f", {args.cpus} vCPUs"
    print(f"\n{mem} MiB{vcpus}, {wl}, bandwidth {f'{bw} MiB/s' if bw else 'unlimited'}")
    w = 18 if args.cpus == 1 else 24
    print(f"{'':<{w}}" + "".join(f"{h:>12}" for _, h, _ in FIGURES) + f"{'converged':>10}")
    for m in args.modes:
        rs = case.get(m, {}).get("runs", [])
        n = len(rs) + len(case.get(m, {}).get("failures", []))
        conv = f"{sum(1 for r in rs if r['converged'])}/{n}"
        print(f"{label(args, m):<{w}}" + "".join(f"{cell(rs, k, f):>12}" for k, _, f in FIGURES)
              + f"{conv:>10}")
    q = case.get(QEMU_MODE, {}).get("runs", [])
    for m in TANDEM_MODES:
        if m in args.modes and QEMU_MODE in args.modes:
            rs = case.get(m, {}).get("runs", [])
            print(f"{m + '/QEMU':<{w}}" + "".join(
                f"{ratio(median(rs, k), median(q, k)):>12}" for k, _, _ in FIGURES))
    for line in targets(case, args.modes):
        print(line)
    for m in args.modes:
        c = case.get(m, {})
        for why in c.get("failures", []) + [r["why"] for r in c.get("runs", []) if r.get("why")]:
            print(f"  {label(args, m)}: {why[:400]}")


def case_json(args, key, case):
    mem, wl, bw = key
    out = []
    for m in args.modes:
        rs = case.get(m, {}).get("runs", [])
        out.append({"mib": mem, "cpus": args.cpus, "workload": wl, "bandwidth_mib": bw,
                    "mode": m, "runs": rs,
                    "failures": case.get(m, {}).get("failures", []),
                    "figures": {k: {"min": sm.mm(values(rs, k))[0], "median": median(rs, k)}
                                for k, _, _ in FIGURES}})
    return out


def run_size(args, mem, tmp, jit, results):
    guests = {}
    if any(m != QEMU_MODE for m in args.modes):
        guests["tandem"] = TandemGuest(args, mem, tmp)
    if QEMU_MODE in args.modes:
        guests["qemu"] = QemuGuest(args, mem, tmp)
    snaps = {}
    for key, g in guests.items():
        snaps[key] = {}
        try:
            g.make_snapshots(args.workloads, jit, snaps[key])
        except Exception as e:  # report, do not hide
            why = f"snapshots: {e}; stderr: {tail(g.err)}"
            log(f"{mem} MiB {g.name}: failed: {why}")
            for wl in (w for w in args.workloads if w not in snaps[key]):
                for bw in args.bandwidths:
                    for m in args.modes:
                        if (m == QEMU_MODE) == (key == "qemu"):
                            results.setdefault((mem, wl, bw), {}).setdefault(
                                m, {"runs": [], "failures": []})["failures"].append(why)
        finally:
            if g.proc:
                kill(g.proc)
    for run in range(args.runs):
        for wl in args.workloads:
            for bw in args.bandwidths:
                order = args.modes if run % 2 == 0 else args.modes[::-1]
                for m in order:
                    key = "qemu" if m == QEMU_MODE else "tandem"
                    if wl not in snaps[key]:
                        continue
                    one(args, guests[key], snaps[key][wl], (mem, wl, bw), m, run, jit, tmp,
                        results)
    for s in snaps.values():
        unlink(*s.values())


def one(args, g, snap, case, mode, run, jit, tmp, results):
    mem, wl, bw = case
    slot = results.setdefault(case, {}).setdefault(mode, {"runs": [], "failures": []})
    err = os.path.join(tmp, f"{mem}-{wl}-{bw}-{mode}-{run}")
    tag = (f"{mem} MiB {wl} bw {bw or 'unlimited'} {label(args, mode)} "
           f"run {run + 1}/{args.runs}")
    try:
        r = g.migration(snap, mode, bw, jit, err)
    except Exception as e:  # report, do not hide
        why = (f"{type(e).__name__}: {e}; source: {tail(err + '.src')}; "
               f"destination: {tail(err + '.dst')}")
        slot["failures"].append(why)
        log(f"{tag}: failed: {why}")
        return
    slot["runs"].append(r)
    log(f"{tag}: {describe(r)}")


def describe(r):
    def v(key, form="{:.0f}"):
        return "-" if r.get(key) is None else form.format(r[key])
    return (f"{'converged' if r['converged'] else 'NOT converged'}, "
            f"total {v('total_s', '{:.2f}')} s, downtime {v('downtime_ms', '{:.1f}')} ms (paused->run "
            f"{v('paused_to_running_ms', '{:.1f}')} ms), "
            f"{v('sent_mib')} MiB, {v('rounds')} rounds, throttle {v('throttle_pct')}%, "
            f"dirty rate {v('dirty_rate_mib')} MiB/s, max gap quiet/before/during "
            f"{v('gap_quiet_ms')}/{v('gap_before_ms')}/{v('gap_during_ms')} ms (the largest "
            f"ended {v('gap_during_at_s', '{:+.2f}')} s from the migration's end), rtt avg/max "
            f"{v('rtt_avg_ms', '{:.1f}')}/{v('rtt_max_ms')} ms, loss {v('loss_pct', '{:.1f}')}%"
            + (f"; {r['why']}" if r.get("why") else ""))


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=1,
                    help="vCPUs of every guest (QEMU: -smp); the dirtying load runs on each")
    ap.add_argument("--dirty-mib", type=int, default=DIRTY_MIB,
                    help="memory the dirtying load rewrites, all vCPUs together")
    ap.add_argument("--dirty-rate", type=int, default=DIRTY_RATE,
                    help="MiB/s it rewrites, all vCPUs together")
    ap.add_argument("--sizes", default="512,2048", help="guest memory sizes in MiB")
    ap.add_argument("--workloads", default="idle,dirty", help="idle, dirty")
    ap.add_argument("--bandwidths", default="0,128", help="MiB/s; 0: unlimited")
    ap.add_argument("--modes", default="thread,inline,qemu",
                    help="thread, threadN (the thread with --connections N, 2 to 16), postcopy "
                         "(the thread, switched to post-copy after round 0), inline, qemu")
    ap.add_argument("--stream", choices=["unix", "tcp"], default="unix",
                    help="tandem's migration stream: a Unix socket, or TCP on loopback")
    ap.add_argument("--tmpdir", default=None, help="where snapshots go (default: $TMPDIR or /tmp)")
    ap.add_argument("--downtime-ms", type=int, default=300)
    ap.add_argument("--sandbox", choices=["on", "off"], default="on",
                    help="off: both sides with --seccomp off --landlock off (default: on)")
    ap.add_argument("--initially-set", choices=["on", "off"], default="on",
                    help="tandem's dirty log starts all dirty (on, the default) or all "
                         "write-protected at once (off): the 'log start' figure")
    ap.add_argument("--timeout-s", type=int, default=120, help="per migration")
    ap.add_argument("--quiet-s", type=float, default=2.0,
                    help="the guest's floor: its gaps after the restore, before any ping")
    ap.add_argument("--before-s", type=float, default=3.0)
    ap.add_argument("--ping-ms", type=float, default=10.0, help="ping interval")
    ap.add_argument("--window-s", type=float, default=0.0,
                    help="also count gaps over 400 ms in this many s from the pings' start "
                         "(the migration starts --before-s in); 0: off")
    ap.add_argument("--boot-timeout", type=float, default=1200)
    ap.add_argument("--restore-timeout", type=float, default=600)
    ap.add_argument("--cmd-timeout", type=float, default=600)
    ap.add_argument("--dirty-timeout", type=float, default=1200)
    for a in ("--tandem", "--kernel", "--bzimage", "--initrd", "--cmdline"):
        ap.add_argument(a, required=True)
    ap.add_argument("--qemu", default="qemu-system-x86_64")
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.bandwidths = [int(b) for b in args.bandwidths.split(",") if b]
    args.modes = [m for m in args.modes.split(",") if m]
    for w in args.workloads:
        if w not in ("idle", "dirty"):
            ap.error(f"unknown workload {w}")
    for m in args.modes:
        if m not in LABELS and not 2 <= streams(m) <= 16:
            ap.error(f"unknown mode {m} (thread, threadN for N streams, 2 to 16; inline; qemu)")
    if not 1 <= args.cpus <= 32:
        ap.error("--cpus: 1 to 32")
    args.cmdline += f" tandem.ip={GUEST}/{PREFIX}"
    return args


def main():
    args = parse_args()

    exit_on_signals()

    if args.tmpdir:
        os.makedirs(args.tmpdir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="tandem-migbench-", dir=args.tmpdir)
    ns = jit = None
    results = {}
    t0 = time.monotonic()
    try:
        ns = Bridge(f"tandem-migbench-{os.getpid()}")
        ns.enter()
        jit = Jitter(HOST, JITTER_PORT)
        for mem in args.sizes:
            run_size(args, mem, tmp, jit, results)
    finally:
        kill_all()
        if jit:
            jit.close()
        if ns:
            ns.close()
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"wall time {(time.monotonic() - t0) / 60:.1f} min")
    report(args, dict(sorted(results.items(), key=lambda kv: (
        kv[0][0], args.workloads.index(kv[0][1]), args.bandwidths.index(kv[0][2])))))


if __name__ == "__main__":
    sys.exit(main())

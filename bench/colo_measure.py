#!/usr/bin/env python3
"""COLO benchmark: the checkpoint pause and bytes of a 128 MiB guest under
load, the failover time (the primary killed with SIGKILL -> the first ping
reply from the secondary), TCP throughput both ways and ping through the
pair against the same guest alone, and the two full-queue policies under
many client connections.

tandem boots the default guest once (1 vCPU, --mem, a NIC on a tap on a
bridge in a namespace made here), starts `tandem-dirty MIB RATE` in it
(the load: MIB MiB rewritten at RATE MiB/s) and snapshots it. Each run:
a primary restored from the snapshot, a secondary (`run --colo
secondary`, its NIC on another tap on the bridge), `colo-start` with
--period-ms, --heartbeat-ms and --timeout-ms; after --seconds, the pauses
of the checkpoints so far (p50, p99, max: colo-status' recent_pauses_ms),
bytes and the secondary's pages per checkpoint, checkpoints per minute;
then, pinging the guest every --ping-ms, the primary is killed and the
failover time is the first reply to a ping sent after it. Min/median of --runs runs and
the issue's targets (pause p99 <= 30 ms; failover <= 100 ms + the
heartbeat timeout; throughput through the pair >= 60% of alone), and a
JSON line.

Traffic (colo_traffic.py; --traffic-seconds, 0 for none): in each run,
the restored primary alone first (client->guest and guest->client TCP,
one connection each, then ping every --traffic-ping-ms), then the same through the pair once it
is protected (after the pause window). The queue runs
(--queue-policies, e.g. drop,checkpoint): a pair with --max-queue and
that --colo-queue-full policy, --conns connections each way, and the
compare's counters (dropped at a full queue, checkpoints by reason).

--channels 1,2,4 (the default): for each count, --runs pairs whose
checkpoints' pages go over that many connections (--colo-channels), their
pause mean and p99 for --seconds under the load.

--transports tcp,tls (the default): for each, --runs pairs on loopback
TCP, plain and TLS (`--tls-cert/--tls-key/--tls-ca`, certificates made by
resources/tls-certs.sh): the initial sync and the checkpoint pause, and
their ratio (the cost of TLS).

--hosts-runs N (default: --runs) adds pairs on two simulated hosts with an
etcd lease (TTL --lease-ttl-s) as arbiter, host A cut off: the takeover and
the first client reply after the cut (colo_hosts.py).

--qemu-colo adds one QEMU 7.2 COLO pair on the same guest (TCG; see
colo_qemu.py): its figures where it gives them, and where it stops.

Used by bench/colo.sh; not a test. Traffic stays in the namespace.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import colo_hosts
import colo_qemu
import colo_traffic as traffic
import snapshot_measure as sm
from migrate_measure import Bridge, GUEST, MAC, PREFIX, unlink
from migrate_probe import Pinger
from common import ctl, exit_on_signals, kill, kill_all, log, make_certs, spawn, tail, tls_opts, wait
from snapshot_measure import Console



def tap(i):
    return Bridge.TAPS["tandem"][i]


def net(args, i):
    """The `--net` of guest `i` (0: alone and primary, 1: secondary), with
    `--net-opts` added."""
    extra = f",{args.net_opts}" if args.net_opts else ""
    return f"tap={tap(i)},mac={MAC}{extra}"


def snapshot(args, tmp):
    """Boots the guest, starts the load, saves the snapshot; its path."""
    g = sm.Tandem(args, args.mem, tmp)
    g.boot_cmd = lambda: sm.Tandem.boot_cmd(g) + ["--cpus", str(args.cpus),
                                                  "--net", net(args, 0)]
    try:
        booted = g.boot()
        log(f"booted in {booted:.1f} s")
        g.con.run(traffic.SERVICES, 60)
        online = g.con.run("echo cpus=$(nproc)", 60)
        if f"cpus={args.cpus}" not in online:
            raise RuntimeError(f"the guest has not {args.cpus} vCPUs online: {online!r}")
        t = time.monotonic()
        # One load per vCPU, pinned, sharing the total (the same total as
        # with one vCPU).
        mib, rate = max(1, args.dirty_mib // args.cpus), max(1, args.dirty_rate // args.cpus)
        for cpu in range(args.cpus):
            pin = f"taskset -c {cpu} " if args.cpus > 1 else ""
            out = g.con.run(f"{pin}tandem-dirty {mib} {rate} & true", 60)
            while "ready in" not in out:
                out += g.con.wait_for(b"\n", args.cmd_timeout)
        log(f"tandem-dirty: {args.cpus} x {mib} MiB ready ({time.monotonic() - t:.0f} s)")
        path = os.path.join(tmp, "colo.snap")
        g.pause()
        g.snapshot(path)
        return path
    finally:
        if g.proc:
            kill(g.proc)


def make_pki(tmp):
    """A CA and a certificate naming 127.0.0.1 (resources/tls-certs.sh): the
    tandem options that use it."""
    d = os.path.join(tmp, "pki")
    make_certs(d, "127.0.0.1")
    return tls_opts(d)


class Pair:
    """A primary restored from the snapshot and a secondary waiting for it
    (`start` makes them a pair); both killed by `close`. `transport`: the
    pair's streams on a Unix socket ("unix"), or on loopback TCP, plain
    ("tcp") or TLS ("tls", with `tls` the tandem options)."""

    def __init__(self, args, snap, tmp, n, transport="unix", tls=()):
        self.args, self.err = args, os.path.join(tmp, f"run{n}")
        self.api_p, self.api_s = os.path.join(tmp, f"p{n}.api"), os.path.join(tmp, f"s{n}.api")
        self.sock = os.path.join(tmp, f"colo{n}.sock")
        self.addr = (f"unix:{self.sock}" if transport == "unix"
                     else f"tcp:127.0.0.1:{7800 + n % 100}")
        self.sec = list(tls) if transport == "tls" else []
        self.lease = os.path.join(tmp, f"colo{n}.lock")
        self.procs = []
        # colo-start's lease is in tmp (Landlock: docs/sandbox.md).
        self.p = spawn([args.tandem, "run", "--restore", snap, "--api-sock", self.api_p,
                        "--landlock-rule", f"{tmp}:rw",
                        "--net", net(args, 0), *self.sec], self.err + ".p")
        self.procs.append(self.p)
        con = Console(self.p)
        con.wait_for(con.send("true"), args.cmd_timeout)

    def start(self, *extra):
        args = self.args
        s = spawn([args.tandem, "run", "--colo", "secondary", "--colo-listen",
                   self.addr, "--colo-lease", self.lease, "--mem", f"{args.mem}M",
                   "--cpus", str(args.cpus),
                   "--api-sock", self.api_s, "--net", net(args, 1), *self.sec],
                  self.err + ".s")
        self.procs.append(s)
        wait("the secondary listens", 60,
             lambda: "waiting for a migration" in tail(self.err + ".s", 50))
        a = ctl(args, self.api_p, "colo-start", self.addr, "--lease", self.lease,
                "--checkpoint-period-ms", str(args.period_ms),
                "--heartbeat-ms", str(args.heartbeat_ms),
                "--heartbeat-timeout-ms", str(args.timeout_ms), *extra)
        if not a.get("ok"):
            raise RuntimeError(f"colo-start: {a}")
        wait("protected", 120, lambda: self.status()["state"] == "protected")

    def status(self, api=None):
        return ctl(self.args, api or self.api_p, "colo-status")["colo"]

    def close(self):
        for q in self.procs:
            kill(q)
        unlink(self.api_p, self.api_s, self.sock, self.lease, self.lease + ".alone")


def traffic_figures(args, prefix, conns, res):
    """Throughput both ways and ping now, into `res` under `prefix`."""
    if args.traffic_seconds <= 0:
        return
    got, errs = traffic.measure(GUEST, args.traffic_seconds, conns, args.traffic_ping_ms)
    for k, v in got.items():
        res[f"{prefix}_{k}"] = v
    if errs:
        res[f"{prefix}_errors"] = errs[:3]


def stages(prim, sec):
    """Where the pair's frames spent their time: the primary's compare
    (held until matched or released by a checkpoint, and by which reason),
    both proxies' stages, mismatches by protocol."""
    c = prim.get("compare") or {}
    return {"holds": prim.get("holds"), "primary": prim.get("stages"),
            "secondary": sec.get("stages"),
            "released": {k: c.get(k) for k in ("matched", "passed_through",
                                              "released_at_checkpoint")},
            "mismatched_by": c.get("mismatched_by"),
            "proxies": {"primary": prim.get("proxy"), "secondary": sec.get("proxy")},
            "checkpoints_by_reason": (prim.get("checkpoints") or {}).get("by_reason"),
            "pause": prim.get("pause_stages")}


def stage_lines(st):
    """The stage table of one run, as lines."""
    def h(x):
        if not x or not x.get("count"):
            return "-"
        return (f"n {x['count']}, mean {x['mean_ms']:.2f}, p50 {x['p50_ms']:.2f}, "
                f"p99 {x['p99_ms']:.2f}, max {x['max_ms']:.1f} ms")
    out = []
    holds = st.get("holds") or {}
    for side in ("primary", "secondary"):
        for k, v in (st.get(side) or {}).items():
            if v and v.get("count"):
                out.append(f"{side} {k}: {h(v)}")
    for k, v in (st.get("pause") or {}).items():
        out.append(f"checkpoint pause, {k}: {h(v)}")
    out.append(f"held until matched: {h(holds.get('matched'))}")
    out.append(f"held until a checkpoint: {h(holds.get('checkpoint'))}")
    out.append(f"released: {st.get('released')}, at checkpoints by reason: "
               f"{holds.get('checkpoint_by_reason')}")
    out.append(f"released at checkpoints by protocol: {holds.get('checkpoint_by_protocol')}")
    out.append(f"proxies: {st.get('proxies')}")
    out.append(f"mismatches by protocol: {st.get('mismatched_by')}; checkpoints by reason: "
               f"{st.get('checkpoints_by_reason')}")
    return out


def one(args, snap, tmp, n):
    """One pair: the guest alone, then its checkpoints, traffic through it
    and its failover."""
    pair = Pair(args, snap, tmp, n)
    try:
        res = {}
        traffic_figures(args, "alone", 1, res)
        pair.start(*([] if args.compare_timeout_ms is None
                     else ["--compare-timeout-ms", str(args.compare_timeout_ms)]))
        t0 = time.monotonic()
        time.sleep(args.seconds)
        traffic_figures(args, "pair", 1, res)
        st = pair.status()
        res["stages"] = stages(st, pair.status(pair.api_s))
        log(f"run {n + 1}: where frames waited:")
        for line in stage_lines(res["stages"]):
            log(f"  {line}")
        elapsed = time.monotonic() - t0
        pauses = sorted(st["recent_pauses_ms"])
        c = st["checkpoints"]
        res.update({
            "checkpoints": c["total"],
            "per_min": c["total"] / elapsed * 60.0,
            "pause_mean_ms": c["mean_pause_ms"],
            "pause_p50_ms": pauses[len(pauses) // 2],
            "pause_p99_ms": pauses[min(len(pauses) - 1, int(len(pauses) * 0.99))],
            "pause_max_ms": c["max_pause_ms"],
            "mean_kib": c["mean_bytes"] / 1024.0,
            "secondary_pages_per_cp": st["secondary_pages"] / max(1, c["total"]),
            "sync_downtime_ms": st["sync"]["downtime_ms"],
        })
        for way in ("in", "out"):
            a, b = res.get(f"alone_{way}_mbit"), res.get(f"pair_{way}_mbit")
            if a and b is not None:
                res[f"{way}_ratio"] = b / a
        pinger = Pinger(GUEST, args.ping_ms / 1000.0)
        try:
            time.sleep(1.0)
            t_kill = time.monotonic()
            kill(pair.p)
            wait("the secondary serves", 30,
                 lambda: pair.status(pair.api_s)["state"] == "failed_over")
            time.sleep(2.0)
        finally:
            pinger.halt()
        # A reply to a ping sent after the kill: one that only arrives
        # after it may have left the primary before it died.
        after = pinger.arrivals_after(t_kill)
        if not after:
            raise RuntimeError("no ping reply after the primary was killed")
        res["failover_ms"] = (min(after) - t_kill) * 1000.0
        return res
    finally:
        pair.close()


def queue_run(args, snap, tmp, n, policy):
    """A pair with a small compare queue and `policy`, under --conns
    connections each way: throughput, ping and the compare's counters."""
    pair = Pair(args, snap, tmp, n)
    try:
        pair.start("--max-queue", str(args.max_queue), "--colo-queue-full", policy)
        res = {"policy": policy}
        traffic_figures(args, "pair", args.conns, res)
        st = pair.status()
        res["dropped_full"] = st["compare"]["dropped_full"]
        res["checkpoints"] = st["checkpoints"]["by_reason"]
        return res
    finally:
        pair.close()


def channel_run(args, snap, tmp, n, channels, transport="unix", tls=()):
    """A pair whose checkpoints' pages go over `channels` connections, for
    --seconds under the load: the initial sync, the pause (mean, p50, p99,
    max) and bytes."""
    pair = Pair(args, snap, tmp, n, transport, tls)
    try:
        pair.start("--colo-channels", str(channels))
        time.sleep(args.seconds)
        st = pair.status()
        if st.get("transport") != ("tls" if transport == "tls" else "plain"):
            raise RuntimeError(f"{transport} pair reports {st.get('transport')}")
        pauses = sorted(st["recent_pauses_ms"])
        c = st["checkpoints"]
        return {"channels": channels, "transport": transport, "checkpoints": c["total"],
                "sync_ms": (st.get("sync") or {}).get("total_ms"),
                "pause_mean_ms": c["mean_pause_ms"],
                "pause_p50_ms": pauses[len(pauses) // 2],
                "pause_p99_ms": pauses[min(len(pauses) - 1, int(len(pauses) * 0.99))],
                "pause_max_ms": c["max_pause_ms"], "mean_kib": c["mean_bytes"] / 1024.0}
    finally:
        pair.close()


def transport_lines(trans):
    """The cost of TLS: the pair on loopback TCP, plain against TLS."""
    if not trans:
        return []
    out = ["  streams on loopback TCP, plain vs TLS (the cost of TLS), min/median of runs:"]
    by = {}
    for t in trans:
        by.setdefault(t["transport"], []).append(t)
    med = {}
    for kind, rs in by.items():
        cells = []
        for key in ("sync_ms", "pause_mean_ms", "pause_p99_ms", "pause_max_ms", "mean_kib"):
            v = [r[key] for r in rs if r.get(key) is not None]
            if v:
                med[(kind, key)] = statistics.median(v)
                cells.append(f"{key} {min(v):.1f}/{statistics.median(v):.1f}")
        out.append(f"    {kind}, {len(rs)} run(s): " + ", ".join(cells))
    for key in ("sync_ms", "pause_mean_ms", "pause_p99_ms"):
        a, b = med.get(("tcp", key)), med.get(("tls", key))
        if a and b:
            out.append(f"    TLS/plain {key} (medians): {b:.1f}/{a:.1f} = {b / a:.2f}x")
    return out


FIGURES = [("checkpoints", "{:.0f}"), ("per_min", "{:.1f}"), ("pause_mean_ms", "{:.1f}"),
           ("pause_p50_ms", "{:.1f}"),
           ("pause_p99_ms", "{:.1f}"), ("pause_max_ms", "{:.1f}"), ("mean_kib", "{:.0f}"),
           ("secondary_pages_per_cp", "{:.0f}"), ("sync_downtime_ms", "{:.1f}"),
           ("failover_ms", "{:.0f}"),
           ("alone_in_mbit", "{:.2f}"), ("pair_in_mbit", "{:.2f}"), ("in_ratio", "{:.2f}"),
           ("alone_out_mbit", "{:.2f}"), ("pair_out_mbit", "{:.2f}"), ("out_ratio", "{:.2f}"),
           ("alone_ping_avg_ms", "{:.2f}"), ("pair_ping_avg_ms", "{:.2f}"),
           ("alone_ping_max_ms", "{:.1f}"), ("pair_ping_max_ms", "{:.1f}"),
           ("alone_ping_loss_pct", "{:.1f}"), ("pair_ping_loss_pct", "{:.1f}"),
           ("alone_ping_after_tcp_avg_ms", "{:.1f}"), ("pair_ping_after_tcp_avg_ms", "{:.1f}"),
           ("alone_ping_after_tcp_max_ms", "{:.1f}"), ("pair_ping_after_tcp_max_ms", "{:.1f}")]


def latency_targets(runs):
    """Issue 34's targets, checked in every run (not only the median):
    ping avg through the pair <= alone + 5 ms, max <= alone's max + the
    run's largest checkpoint pause, TCP >= 90% of alone both ways, pause
    p99 <= 15 ms."""
    out = []
    checks = [
        ("ping avg <= alone + 5 ms",
         lambda r: (r["pair_ping_avg_ms"], r["alone_ping_avg_ms"] + 5.0)),
        ("ping max <= alone max + largest pause",
         lambda r: (r["pair_ping_max_ms"], r["alone_ping_max_ms"] + r["pause_max_ms"])),
        ("TCP in >= 90% of alone", lambda r: (0.9, r["in_ratio"])),
        ("TCP out >= 90% of alone", lambda r: (0.9, r["out_ratio"])),
        ("pause p99 <= 15 ms", lambda r: (r["pause_p99_ms"], 15.0)),
    ]
    for name, f in checks:
        cells, met = [], 0
        for r in runs:
            try:
                got, limit = f(r)
            except (KeyError, TypeError):
                cells.append("-")
                continue
            ok = got <= limit
            met += ok
            cells.append(f"{got:.2f}/{limit:.2f}{'' if ok else ' NOT'}")
        out.append(f"target (every run): {name}: {met}/{len(runs)} met: " + "; ".join(cells))
    return out


def report(args, runs, failures, queues, qemu, hosts, chans, trans):
    print(f"COLO benchmark: {args.mem} MiB guest, {args.cpus} vCPU(s), tandem-dirty "
          f"{args.dirty_mib} MiB at "
          f"{args.dirty_rate} MiB/s, checkpoint every {args.period_ms} ms, heartbeat "
          f"{args.heartbeat_ms}/{args.timeout_ms} ms, {args.seconds:.0f} s per run, "
          f"{len(runs)} run(s) ({len(failures)} failed); min/median")
    for key, form in FIGURES:
        vals = [r[key] for r in runs if r.get(key) is not None]
        cell = (f"{form.format(min(vals))}/{form.format(statistics.median(vals))}"
                if vals else "-")
        print(f"  {key:24s} {cell}")
    for f in failures:
        print(f"  failed: {f}")
    if runs:
        p99 = statistics.median(r["pause_p99_ms"] for r in runs)
        fo = statistics.median(r["failover_ms"] for r in runs)
        limit = 100 + args.timeout_ms
        print(f"  target: checkpoint pause p99 <= 30 ms: median {p99:.1f} ms: "
              f"{'met' if p99 <= 30 else 'NOT met'}")
        print(f"  target: failover <= 100 ms + heartbeat timeout ({limit} ms): median "
              f"{fo:.0f} ms: {'met' if fo <= limit else 'NOT met'}")
        for way in ("in", "out"):
            ratios = [r[f"{way}_ratio"] for r in runs if r.get(f"{way}_ratio") is not None]
            if ratios:
                m = statistics.median(ratios)
                print(f"  target: {way} throughput through the pair >= 60% of alone: median "
                      f"{m * 100:.0f}%: {'met' if m >= 0.6 else 'NOT met'} (QEMU COLO here: "
                      f"~35%, the issue's figure)")
    for line in latency_targets(runs):
        print(f"  {line}")
    for q in queues:
        print(f"  queue {q.get('policy')}: max-queue {args.max_queue}, {args.conns} connections "
              f"each way: " + ", ".join(f"{k} {v}" for k, v in q.items() if k != "policy"))
    if chans:
        print("  page channels (--colo-channels), min/median of their runs: pause mean / p99 "
              "(anchor: QEMU multifd, 6 GB Windows on 10GbE: 24.3/78 ms plain, 14.1/31.3 ms "
              "with 4 channels)")
    by_n = {}
    for c in chans:
        by_n.setdefault(c["channels"], []).append(c)
    for k in sorted(by_n):
        rs = by_n[k]
        cells = []
        for key in ("pause_mean_ms", "pause_p99_ms", "pause_max_ms", "mean_kib"):
            v = [r[key] for r in rs]
            cells.append(f"{key} {min(v):.1f}/{statistics.median(v):.1f}")
        print(f"    {k} channel(s), {len(rs)} run(s): " + ", ".join(cells))
    for line in transport_lines(trans):
        print(line)
    lines, host_figs = colo_hosts.report(args, *hosts) if args.hosts_runs else (
        ["two hosts: not run (--hosts-runs 0)"], {})
    for line in lines:
        print(f"  {line}")
    if qemu is None:
        print("  QEMU 7.2 COLO: not run (--qemu-colo)")
    else:
        print("  QEMU 7.2 COLO (TCG; 'alone' = its COLO filters on, no secondary yet): "
              + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in qemu.items()))
    print(json.dumps({"bench": "colo", "mem_mib": args.mem, "period_ms": args.period_ms,
                      "runs": runs, "queues": queues, "qemu": qemu, "failures": failures,
                      "two_hosts": host_figs, "channels": chans, "transports": trans}))


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mem", type=int, default=128, help="MiB")
    ap.add_argument("--cpus", type=int, default=1,
                    help="vCPUs of the guest (a pinned dirtying load on each)")
    ap.add_argument("--seconds", type=float, default=30.0, help="protected, per run")
    ap.add_argument("--period-ms", type=int, default=1000)
    ap.add_argument("--heartbeat-ms", type=int, default=100)
    ap.add_argument("--timeout-ms", type=int, default=1000)
    ap.add_argument("--compare-timeout-ms", type=int, default=None,
                    help="colo-start's --compare-timeout-ms (default: tandem's)")
    ap.add_argument("--ping-ms", type=float, default=10.0)
    ap.add_argument("--client-cc", default=None,
                    help="the client's TCP congestion control, e.g. cubic (Linux's default; "
                         "default: this host's)")
    ap.add_argument("--net-opts", default="",
                    help="more options of every guest's --net, e.g. rsc=on (alone and pair alike)")
    ap.add_argument("--dirty-mib", type=int, default=16)
    ap.add_argument("--dirty-rate", type=int, default=8, help="MiB/s")
    ap.add_argument("--traffic-seconds", type=float, default=10.0,
                    help="per direction and for ping, alone and through the pair; 0: none")
    ap.add_argument("--traffic-ping-ms", type=float, default=100.0,
                    help="ping interval of the traffic figures (the failover's: --ping-ms)")
    ap.add_argument("--queue-policies", default="",
                    help="comma-separated: drop,checkpoint (a pair run each)")
    ap.add_argument("--conns", type=int, default=16, help="connections in the queue runs")
    ap.add_argument("--max-queue", type=int, default=8, help="compare queue in the queue runs")
    ap.add_argument("--qemu-colo", action="store_true", help="also one QEMU COLO pair")
    ap.add_argument("--hosts-runs", type=int, default=None,
                    help="two-host pairs (etcd lease) cut off, default --runs; 0: none")
    ap.add_argument("--lease-ttl-s", type=int, default=3, help="the two-host lease's TTL")
    ap.add_argument("--channels", default="1,2,4",
                    help="page channel counts to measure (a pair each, --runs times); '' none")
    ap.add_argument("--transports", default="tcp,tls",
                    help="the pair's streams on loopback TCP, plain and TLS, compared "
                         "(--runs pairs each, 1 channel); '' none")
    ap.add_argument("--qemu", default="qemu-system-x86_64")
    ap.add_argument("--tmpdir", default=None)
    ap.add_argument("--boot-timeout", type=float, default=1200)
    ap.add_argument("--cmd-timeout", type=float, default=600)
    for a in ("--tandem", "--kernel", "--bzimage", "--initrd", "--cmdline"):
        ap.add_argument(a, required=True)
    args = ap.parse_args()
    args.cmdline += f" tandem.ip={GUEST}/{PREFIX}"
    traffic.CLIENT_CC = args.client_cc
    if args.hosts_runs is None:
        args.hosts_runs = args.runs
    return args


def measured(what, into, failures, run):
    """`run()`'s figures into `into`, logged; a failure is reported in
    `failures` (and the log), never hidden."""
    try:
        got = run()
        into.append(got)
        log(f"{what}: {got}")
    except Exception as e:  # report, do not hide
        why = f"{what}: {type(e).__name__}: {e}"
        failures.append(why)
        log(why)


def main():
    args = parse_args()

    exit_on_signals()
    tmp = tempfile.mkdtemp(prefix="tandem-colobench-", dir=args.tmpdir)
    ns = None
    runs, failures, queues, qemu = [], [], [], None
    host_runs, host_failures = [], []
    chans, trans = [], []
    try:
        ns = Bridge(f"tandem-colobench-{os.getpid()}")
        ns.enter()
        snap = snapshot(args, tmp)
        for n in range(args.runs):
            try:
                r = one(args, snap, tmp, n)
                runs.append(r)
                log(f"run {n + 1}/{args.runs}: " + ", ".join(
                    f"{k} {form.format(r[k])}" for k, form in FIGURES if k in r))
            except Exception as e:  # report, do not hide
                why = f"run {n + 1}: {type(e).__name__}: {e}"
                failures.append(why)
                log(why)
        for k, policy in enumerate(p for p in args.queue_policies.split(",") if p):
            measured(f"queue {policy}", queues, failures,
                     lambda: queue_run(args, snap, tmp, args.runs + k, policy))
        counts = [int(c) for c in args.channels.split(",") if c]
        for r in range(args.runs if counts else 0):
            for k, count in enumerate(counts):
                measured(f"channels {count}", chans, failures,
                         lambda: channel_run(args, snap, tmp, 100 + r * len(counts) + k, count))
        kinds = [t for t in args.transports.split(",") if t]
        tls = make_pki(tmp) if "tls" in kinds else ()
        for r in range(args.runs if kinds else 0):
            for k, kind in enumerate(kinds):
                measured(f"transport {kind}", trans, failures,
                         lambda: channel_run(args, snap, tmp, 200 + r * len(kinds) + k, 1, kind,
                                             tls))
        for n in range(args.hosts_runs):
            try:
                r = colo_hosts.one(args, snap, tmp, n, ns.name)
                host_runs.append(r)
                log(f"two hosts {n + 1}/{args.hosts_runs}: {r}")
            except Exception as e:  # report, do not hide
                why = f"run {n + 1}: {type(e).__name__}: {e}"
                host_failures.append(why)
                log(f"two hosts: {why}")
        if args.qemu_colo:
            qemu = colo_qemu.run(args, tmp)
            log(f"QEMU COLO: {qemu}")
    finally:
        kill_all()
        if ns:
            ns.close()
        shutil.rmtree(tmp, ignore_errors=True)
    report(args, runs, failures, queues, qemu, (host_runs, host_failures), chans, trans)


if __name__ == "__main__":
    sys.exit(main())

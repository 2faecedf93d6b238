"""QEMU 7.2's COLO on the same guest, for bench/colo.sh (--qemu-colo): the
peer's figures beside tandem's, or where it stops.

A primary QEMU (microvm, TCG, the default guest, its virtio-net NIC on the
bench bridge's first QEMU tap) is booted with the COLO network filters of
QEMU's docs/COLO-FT.txt on loopback sockets (filter-mirror,
filter-redirector, colo-compare); the guest runs the bench's two TCP
services and tandem-dirty. Its figures alone are taken first (the compare
passes frames through while it has no secondary, after its timeout), then
a secondary QEMU (-incoming, filter-redirector and filter-rewriter, on the
second QEMU tap) gets `x-colo`, the primary migrates to it with `x-colo`
and `x-checkpoint-delay` = --period-ms. Once the migration reports the
`colo` state, a fresh QMP connection to the primary is asked
`query-status` every second for three periods: a primary that stops
answering is reported, with the time since COLO started, and whether the
guest still answers pings; else the same traffic runs through the pair.
Failover: the
primary killed, `x-colo-lost-heartbeat` on the secondary (QEMU has no
automatic failover), the first ping reply after the kill.

No disk: the guest runs from its initramfs, so no block replication is set
up. Not a test; traffic stays in the bench's namespace and on loopback.
"""
import json
import os
import socket
import time

import colo_traffic as traffic
from migrate_measure import Bridge, GUEST, MAC
from migrate_probe import Pinger
from common import READY, kill, log, spawn
from snapshot_measure import Console, Qmp

PORTS = {"mirror": 19003, "compare1": 19004, "compare0": 19001, "out": 19005,
         "incoming": 19998}


def _base(args, qmp, tap):
    return [args.qemu, "-M", "microvm,acpi=off,x-option-roms=off,rtc=off", "-accel", "tcg",
            "-m", f"{args.mem}M", "-smp", "1", "-kernel", args.bzimage, "-initrd", args.initrd,
            "-append", args.cmdline, "-nographic", "-nodefaults", "-serial", "stdio",
            "-no-reboot", "-qmp", f"unix:{qmp},server=on,wait=off",
            "-netdev", f"tap,id=hn0,ifname={tap},script=no,downscript=no,vhost=off",
            "-device", f"virtio-net-device,netdev=hn0,mac={MAC}"]


def _sock(name, port, server):
    extra = ",server=on,wait=off" if server else ""
    return ["-chardev", f"socket,id={name},host=127.0.0.1,port={port}{extra}"]


def primary_cmd(args, qmp):
    p = PORTS
    return (_base(args, qmp, Bridge.TAPS["qemu"][0])
            + _sock("mirror0", p["mirror"], True) + _sock("compare1", p["compare1"], True)
            + _sock("compare0", p["compare0"], True) + _sock("compare0-0", p["compare0"], False)
            + _sock("compare_out", p["out"], True) + _sock("compare_out0", p["out"], False)
            + ["-object", "filter-mirror,id=m0,netdev=hn0,queue=tx,outdev=mirror0",
               "-object", "filter-redirector,netdev=hn0,id=redire0,queue=rx,indev=compare_out",
               "-object", "filter-redirector,netdev=hn0,id=redire1,queue=rx,outdev=compare0",
               "-object", "iothread,id=iothread1",
               "-object", "colo-compare,id=comp0,primary_in=compare0-0,secondary_in=compare1,"
                          "outdev=compare_out0,iothread=iothread1"])


def secondary_cmd(args, qmp):
    p = PORTS
    return (_base(args, qmp, Bridge.TAPS["qemu"][1])
            + ["-chardev", f"socket,id=red0,host=127.0.0.1,port={p['mirror']},reconnect=1",
               "-chardev", f"socket,id=red1,host=127.0.0.1,port={p['compare1']},reconnect=1",
               "-object", "filter-redirector,id=f1,netdev=hn0,queue=tx,indev=red0",
               "-object", "filter-redirector,id=f2,netdev=hn0,queue=rx,outdev=red1",
               "-object", "filter-rewriter,id=rew0,netdev=hn0,queue=all",
               "-incoming", f"tcp:127.0.0.1:{p['incoming']}"])


def _qmp_alive(path, timeout=5.0):
    """The VM's status if a fresh QMP connection greets and answers
    query-status within `timeout` s each, else None."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        f = s.makefile("rwb")
        for line in (None, b'{"execute":"qmp_capabilities"}', b'{"execute":"query-status"}'):
            if line:
                f.write(line + b"\n")
                f.flush()
            while True:
                ans = json.loads(f.readline())
                if "event" not in ans:
                    break
        return ans.get("return", {}).get("status")
    except (OSError, ValueError):
        return None
    finally:
        s.close()


def run(args, tmp):
    """One QEMU COLO pair: a dict of what it gave, and where it stopped."""
    res = {}
    qp, qs = os.path.join(tmp, "qemu-p.qmp"), os.path.join(tmp, "qemu-s.qmp")
    procs = []
    try:
        p = spawn(primary_cmd(args, qp), os.path.join(tmp, "qemu-p.err"))
        procs.append(p)
        con = Console(p)
        t0 = time.monotonic()
        con.wait_for(READY, args.boot_timeout)
        res["boot_s"] = time.monotonic() - t0
        con.run("stty -echo", 120)
        con.run(traffic.SERVICES, 60)
        out = con.run(f"tandem-dirty {args.dirty_mib} {args.dirty_rate} & true", 60)
        while "ready in" not in out:
            out += con.wait_for(b"\n", args.cmd_timeout)
        if args.traffic_seconds > 0:
            got, errs = traffic.measure(GUEST, args.traffic_seconds, 1, args.traffic_ping_ms)
            res.update({f"alone_{k}": v for k, v in got.items()})
            if errs:
                res["alone_errors"] = errs[:3]
        s = spawn(secondary_cmd(args, qs), os.path.join(tmp, "qemu-s.err"))
        procs.append(s)
        sq = Qmp(qs, 60)
        sq.cmd("migrate-set-capabilities", capabilities=[{"capability": "x-colo",
                                                         "state": True}])
        pq = Qmp(qp, 60)
        pq.cmd("migrate-set-capabilities", capabilities=[{"capability": "x-colo",
                                                         "state": True}])
        pq.cmd("migrate-set-parameters", **{"x-checkpoint-delay": args.period_ms,
                                             "max-bandwidth": 1 << 40})
        pq.cmd("migrate", uri=f"tcp:127.0.0.1:{PORTS['incoming']}")
        pq.close()
        end = time.monotonic() + 300
        status = None
        while time.monotonic() < end:
            q = Qmp(qp, 10)
            info, _ = q.cmd("query-migrate")
            q.close()
            status = info.get("status")
            if status in ("colo", "failed", "cancelled"):
                break
            time.sleep(0.5)
        res["migrate_status"] = status
        if status != "colo":
            res["stopped"] = f"the migration to the secondary ended as {status!r}"
            return res
        t_colo = time.monotonic()
        log("QEMU COLO: protected; is its primary there after a few checkpoints?")
        alive_until = 0.0
        for _ in range(max(3, int(3 * args.period_ms / 1000))):
            if _qmp_alive(qp) is None:
                res["stopped"] = (f"the primary's QMP stopped answering "
                                  f"{time.monotonic() - t_colo:.0f} s into COLO "
                                  f"(checkpoint every {args.period_ms} ms)")
                break
            alive_until = time.monotonic() - t_colo
            time.sleep(1.0)
        res["primary_answered_s"] = alive_until
        if "stopped" in res:
            res["guest_pings"] = traffic.ping(GUEST, 3.0, 0.1)
            return res
        if args.traffic_seconds > 0:
            got, errs = traffic.measure(GUEST, args.traffic_seconds, 1, args.traffic_ping_ms)
            res.update({f"pair_{k}": v for k, v in got.items()})
            if errs:
                res["pair_errors"] = errs[:3]
        pinger = Pinger(GUEST, args.ping_ms / 1000.0)
        try:
            time.sleep(1.0)
            t_kill = time.monotonic()
            kill(p)
            sq.cmd("x-colo-lost-heartbeat")
            time.sleep(3.0)
        finally:
            pinger.halt()
        after = [pinger.sent[i] + rtt / 1000.0 for i, rtt in pinger.replies.items()
                 if pinger.sent[i] + rtt / 1000.0 > t_kill]
        res["failover_ms"] = (min(after) - t_kill) * 1000.0 if after else None
        return res
    except Exception as e:  # report where it stopped, do not hide it
        res["stopped"] = f"{type(e).__name__}: {e}"
        return res
    finally:
        for q in procs:
            kill(q)

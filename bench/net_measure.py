#!/usr/bin/env python3
"""Network benchmark: ping RTT and TCP throughput host->guest and
guest->host, for tandem (KVM) and QEMU (microvm, virtio-net-device on a tap,
vhost=off, TCG: QEMU with KVM cannot reach user space on this host), same
kernel, initramfs and command line, in one run. Each VMM is booted once in
its own network namespace; each figure is repeated N times (min/median).
Used by bench/net.sh; not a test. Traffic stays in namespaces made here.
"""
import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import threading
import time

import common

GUEST, HOST = "192.0.2.2", "192.0.2.1"


class Ns(common.Ns):
    """A namespace with tap0 (vnet_hdr) holding the host's address."""

    def links(self):
        self.ip("tuntap", "add", "dev", "tap0", "mode", "tap", "vnet_hdr")
        self.ip("addr", "add", HOST + "/24", "dev", "tap0")
        self.ip("link", "set", "tap0", "up")


class Console(common.Console):
    """A VMM started with the guest's console on its stdin/stdout, driven
    by command lines that end in a numbered marker."""

    def __init__(self, cmd):
        super().__init__(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
        self.seq = 0

    def run(self, cmd, timeout=600):
        self.seq += 1
        # `cmd &; echo` is a syntax error: a background job is followed by `true`.
        sep = " true;" if cmd.rstrip().endswith("&") else ";"
        self.p.stdin.write(f"{cmd}{sep} echo \"@@$(({self.seq}))@@\"\n".encode())
        self.p.stdin.flush()
        return self.wait_for(f"@@{self.seq}@@".encode(), timeout)

    def close(self):
        os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()


def in_ns(ns, fn):
    res = {}

    def target():
        ns.enter()
        res["v"] = fn()
    t = threading.Thread(target=target)
    t.start()
    return t, res


def host_to_guest(ns, con, mib, port):
    con.run(f"nc -l -p {port} </dev/null >/dev/null &")
    def send():
        deadline = time.monotonic() + 60
        while True:
            try:
                s = socket.create_connection((GUEST, port), timeout=600)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        chunk = b"\0" * 65536
        t0 = time.monotonic()
        for _ in range(mib * 16):
            s.sendall(chunk)
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):
            pass
        return time.monotonic() - t0
    t, res = in_ns(ns, send)
    t.join()
    con.run("wait")
    return mib * 8 / res["v"]


def guest_to_host(ns, con, mib, port):
    def recv():
        l = socket.socket()
        l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        l.bind((HOST, port))
        l.listen(1)
        c, _ = l.accept()
        n, t0 = 0, None
        while True:
            b = c.recv(262144)
            if t0 is None:
                t0 = time.monotonic()
            if not b:
                break
            n += len(b)
        return n, time.monotonic() - t0
    t, res = in_ns(ns, recv)
    time.sleep(0.5)
    con.run(f"dd if=/dev/zero bs=65536 count={mib * 16} 2>/dev/null | nc {HOST} {port}")
    t.join()
    n, secs = res["v"]
    return n * 8 / 1e6 / secs


def ping(con):
    out = con.run(f"ping -c 10 -i 0.2 {HOST}")
    m = re.search(r"min/avg/max = ([\d.]+)/([\d.]+)/([\d.]+)", out)
    return (float(m.group(2)), float(m.group(3))) if m else (None, None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--bzimage", required=True)
    ap.add_argument("--initrd", required=True)
    ap.add_argument("--cmdline", required=True)
    ap.add_argument("--sandbox-off", action="store_true",
                    help="also a row for tandem with --seccomp off --landlock off (the sandbox's cost, same run)")
    args = ap.parse_args()
    cmdline = args.cmdline + f" tandem.ip={GUEST}/24"
    vmms = {
        "tandem (KVM)": lambda ns: ["ip", "netns", "exec", ns, args.tandem, "run", "--kernel",
                                    args.kernel, "--initrd", args.initrd, "--cmdline", cmdline,
                                    "--net", "tap=tap0"],
        "QEMU microvm (TCG)": lambda ns: [
            "ip", "netns", "exec", ns, "qemu-system-x86_64", "-M", "microvm,acpi=off,rtc=off",
            "-accel", "tcg", "-m", "128M", "-kernel", args.bzimage, "-initrd", args.initrd,
            "-append", args.cmdline + f" tandem.ip={GUEST}/24", "-nographic", "-nodefaults",
            "-serial", "stdio", "-no-reboot",
            "-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no,vhost=off",
            "-device", "virtio-net-device,netdev=n0"],
    }
    if args.sandbox_off:
        on = vmms["tandem (KVM)"]
        vmms["tandem sandbox off"] = lambda ns: on(ns) + ["--seccomp", "off", "--landlock", "off"]
    results = {}
    for i, (name, cmd) in enumerate(vmms.items()):
        ns = Ns(f"tandem-bench-{os.getpid()}-{i}")
        con = Console(cmd(ns.name))
        r = {"rtt_avg": [], "rtt_max": [], "h2g": [], "g2h": []}
        try:
            con.wait_for(b"tandem-guest: ready", 600)
            con.run("stty -echo")
            for k in range(args.runs):
                avg, mx = ping(con)
                r["rtt_avg"].append(avg)
                r["rtt_max"].append(mx)
                r["h2g"].append(host_to_guest(ns, con, args.mib, 6000 + k))
                r["g2h"].append(guest_to_host(ns, con, args.mib, 7000 + k))
                print(f"{name} run {k + 1}: rtt avg/max {avg}/{mx} ms, host->guest "
                      f"{r['h2g'][-1]:.1f} Mbit/s, guest->host {r['g2h'][-1]:.1f} Mbit/s",
                      flush=True)
        except Exception as e:  # report, do not hide
            print(f"{name}: failed: {e}", flush=True)
        finally:
            con.close()
            ns.close()
        results[name] = r

    def mm(xs):
        xs = [x for x in xs if x is not None]
        return (min(xs), statistics.median(xs)) if xs else (None, None)

    print(f"\n{args.runs} runs each, {args.mib} MiB per TCP transfer, same kernel/initramfs/cmdline")
    print(f"{'VMM':<20} {'RTT avg ms (min/med)':>22} {'RTT max ms (min/med)':>22} "
          f"{'host->guest Mbit/s':>20} {'guest->host Mbit/s':>20}")
    for name, r in results.items():
        cols = []
        for key in ["rtt_avg", "rtt_max", "h2g", "g2h"]:
            lo, med = mm(r[key])
            cols.append("-" if lo is None else f"{lo:.2f}/{med:.2f}")
        print(f"{name:<20} {cols[0]:>22} {cols[1]:>22} {cols[2]:>20} {cols[3]:>20}")
    t, q = results.get("tandem (KVM)"), results.get("QEMU microvm (TCG)")
    if t and q:
        for key, label in [("h2g", "host->guest"), ("g2h", "guest->host")]:
            a, b = mm(t[key])[1], mm(q[key])[1]
            if a and b:
                print(f"{label} throughput ratio tandem/QEMU-TCG (median): {a / b:.2f}x")


if __name__ == "__main__":
    main()

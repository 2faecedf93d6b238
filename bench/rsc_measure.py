#!/usr/bin/env python3
"""RSC benchmark: host->guest TCP throughput with rsc=on vs rsc=off in one
run. One tandem guest with two NICs on taps in a network namespace made
here: eth0 (tap0) with rsc=on, eth1 (tap1) with rsc=off, so both see the same
guest, host and moment. For each tap offload mode (off: `ethtool -K tapN tso
off gso off gro off`, as in the seed's netperf measurement, so the host sends
MSS-sized segments; on: the offloads the guest negotiated, so the host sends
64 KiB GSO frames that RSC passes through) and each message size, a sender in
the namespace writes the transfer in writes of that size (netperf
TCP_STREAM's -m; Nagle on) to `nc -l` in the guest; the time runs from the
first write to the guest closing the connection. min/median of N runs, the
NICs alternating first. Also reports, from tandem's metrics, how many tap
frames each guest packet held on the rsc=on NIC. Used by bench/rsc.sh; not a
test. Traffic stays in the namespace.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import sh  # noqa: E402
from net_measure import Console, in_ns  # noqa: E402

NICS = {  # name: (tap, host address, guest address)
    "on": ("tap0", "203.0.113.1", "203.0.113.2"),
    "off": ("tap1", "198.51.100.1", "198.51.100.2"),
}


class Ns(common.Ns):
    """A namespace with the NICS' taps (vnet_hdr), each holding its host
    address; the commands' output is dropped."""

    def __init__(self, name):
        super().__init__(name, quiet=True)

    def links(self):
        for tap, host, _ in NICS.values():
            self.ip("tuntap", "add", "dev", tap, "mode", "tap", "vnet_hdr")
            self.ip("addr", "add", host + "/24", "dev", tap)
            self.ip("link", "set", tap, "up")

    def offloads(self, on):
        state = "on" if on else "off"
        for tap, _, _ in NICS.values():
            sh("ip", "netns", "exec", self.name, "ethtool", "-K", tap,
               "tso", state, "gso", state, "gro", state, quiet=True)


def transfer(ns, con, guest, port, total, msg):
    """Mbit/s of `total` bytes written in `msg`-byte writes to the guest."""
    # `cmd &; echo` (what Console.run would make of a trailing &) is a
    # syntax error in the guest shell.
    con.run(f"nc -l -p {port} </dev/null >/dev/null & true")

    def send():
        deadline = time.monotonic() + 60
        while True:
            try:
                s = socket.create_connection((guest, port), timeout=600)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        chunk = bytes(msg)
        t0 = time.monotonic()
        for _ in range(total // msg):
            s.sendall(chunk)
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):
            pass
        secs = time.monotonic() - t0
        s.close()
        return secs
    t, res = in_ns(ns, send)
    t.join()
    if "v" not in res:
        raise RuntimeError("the sender failed (see above)")
    con.run("wait")
    return total * 8 / 1e6 / res["v"]


def rsc_totals(path):
    """(frames read from tap0, packets to the guest on tap0)."""
    with open(path) as f:
        m = json.load(f)
    nic = m["net"][0]
    return nic["rsc"]["received"], nic["counters"]["rx_packets"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kib", type=int, default=512, help="KiB per transfer")
    ap.add_argument("--sizes", default="256,1024,4096,16384,65536")
    ap.add_argument("--interval-us", type=int, default=300)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--bzimage")
    ap.add_argument("--initrd", required=True)
    ap.add_argument("--cmdline", required=True)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    total = args.kib * 1024
    ips = " ".join(f"tandem.ip{'' if i == 0 else i}={g}/24"
                   for i, (_, _, g) in enumerate(NICS.values()))
    metrics = f"/tmp/tandem-bench-rsc-{os.getpid()}.json"
    ns = Ns(f"tandem-bench-rsc-{os.getpid()}")
    cmd = ["ip", "netns", "exec", ns.name, args.tandem, "run", "--kernel", args.kernel,
           "--initrd", args.initrd, "--cmdline", f"{args.cmdline} {ips}",
           "--net", f"tap=tap0,rsc=on,rsc_interval_us={args.interval_us}",
           "--net", "tap=tap1,rsc=off", "--metrics", metrics]
    con = Console(cmd)
    res = {}  # (offloads, size, nic) -> [Mbit/s]
    frames = {}  # offloads -> (tap frames, guest packets) on the rsc=on NIC
    started = time.monotonic()
    port = 6000
    try:
        con.wait_for(b"tandem-guest: ready", 600)
        con.run("stty -echo")
        for offloads in (False, True):
            ns.offloads(offloads)
            time.sleep(1.5)
            before = rsc_totals(metrics)
            for k in range(args.runs):
                for size in sizes:
                    order = ["on", "off"] if k % 2 == 0 else ["off", "on"]
                    for nic in order:
                        port += 1
                        mbit = transfer(ns, con, NICS[nic][2], port, total, size)
                        res.setdefault((offloads, size, nic), []).append(mbit)
                        print(f"offloads {'on ' if offloads else 'off'} {size:>6} B "
                              f"rsc={nic:<3} run {k + 1}: {mbit:.3f} Mbit/s", flush=True)
            time.sleep(1.5)
            after = rsc_totals(metrics)
            frames[offloads] = (after[0] - before[0], after[1] - before[1])
    finally:
        con.close()
        ns.close()
    minutes = (time.monotonic() - started) / 60

    print(f"\nhost->guest TCP, tandem, one guest with eth0 rsc=on "
          f"(rsc_interval_us={args.interval_us}) and eth1 rsc=off; {args.kib} KiB per "
          f"transfer, min/median of {args.runs}; Mbit/s; {minutes:.1f} min in all")
    print(f"{'tap offloads':<18} {'msg B':>6} {'rsc=off min/med':>16} "
          f"{'rsc=on min/med':>16} {'on/off (median)':>16}")
    for offloads in (False, True):
        for size in sizes:
            off = res.get((offloads, size, "off"), [])
            on = res.get((offloads, size, "on"), [])
            if not off or not on:
                continue
            mo, mn = statistics.median(off), statistics.median(on)
            print(f"{'on' if offloads else 'off (tso/gso/gro)':<18} {size:>6} "
                  f"{min(off):>7.3f}/{mo:<8.3f} {min(on):>7.3f}/{mn:<8.3f} {mn / mo:>15.2f}x")
    for offloads, (read, pkts) in frames.items():
        if pkts:
            print(f"rsc=on NIC, offloads {'on' if offloads else 'off'}: {read} tap frames -> "
                  f"{pkts} guest packets ({read / pkts:.2f} frames per packet)")
    try:
        os.unlink(metrics)
    except OSError:
        pass


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Measures the kvm_pvm host fault (docs/host-kvm.md): freshly exec'd
processes that start at the same time sometimes lose their first writes to a
new page and die at their first TLS access. Boots the default guest and runs
N three-process pipelines (`seq 1 50 | grep 3 | wc -l`), counting wrong
results, with and without the guest-side mitigation (`tandem_pte_flush`).
Not a test: a measurement, printed as failures per 100 pipelines.
"""
import argparse
import os
import signal
import subprocess
import sys
import time

from common import READY, Console


def host_cmdline(tandem):
    """The default command line with what tandem appends on this host."""
    return subprocess.run([tandem, "run", "--print-cmdline"], capture_output=True,
                          text=True, check=True).stdout.strip()


def measure(tandem, flush, n, cpus):
    cmdline = host_cmdline(tandem)
    if flush:
        cmdline += " tandem_pte_flush"
    env = dict(os.environ, TANDEM_HOST_KIND="hardware")  # append nothing: the line is complete
    p = subprocess.Popen([tandem, "run", "--cpus", str(cpus), "--cmdline", cmdline],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        con = Console(p)
        con.wait_for(READY, 400)
        p.stdin.write(b"stty -echo\n")
        p.stdin.write(
            f"f=0; i=0; while [ $i -lt {n} ]; do r=$(seq 1 50 | grep 3 | wc -l); "
            f"[ \"$r\" = 14 ] || f=$((f+1)); i=$((i+1)); done; echo \"F$((0))AILS=$f/$i\"\n"
            .encode())
        p.stdin.flush()
        # The marker is computed by the shell: the echoed command never matches.
        out = con.wait_for(b"F0AILS=", 3600)
        tail = con.wait_for(b"\n", 60)
        segv = out.count("Segmentation fault")
        return tail.strip(), segv
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", default="target/release/tandem")
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--cpus", type=int, default=1)
    ap.add_argument("--mode", choices=["both", "flush", "noflush"], default="both")
    args = ap.parse_args()
    modes = {"both": [False, True], "flush": [True], "noflush": [False]}[args.mode]
    for flush in modes:
        t0 = time.monotonic()
        res, segv = measure(args.tandem, flush, args.n, args.cpus)
        print(f"tandem_pte_flush={'on ' if flush else 'off'} cpus={args.cpus}: "
              f"wrong results {res}, segfault messages {segv}, "
              f"{time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())

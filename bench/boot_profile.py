#!/usr/bin/env python3
"""Where the default guest's boot spends its time: boots it under
`tandem run --guest-profile`, stops the profile through the control API the
moment the console shows the ready marker (so the profile is the boot and
nothing after it), prints the table, and leaves the folded stacks in a file
(and an SVG flame graph when inferno-flamegraph is on PATH:
`cargo install inferno`).

Used by bench/boot_profile.sh; not a test. Profiling costs the guest time
too (each sample is an exit of the vCPU): the boot is slower than unprofiled.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from common import READY


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", default="target/release/tandem")
    ap.add_argument("--hz", type=int, default=1000)
    ap.add_argument("--out", default="target/boot-profile.folded")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("run_args", nargs="*", help="more `tandem run` arguments (e.g. --kernel K)")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="tandem-bootprof-")
    sock = os.path.join(tmp, "api.sock")
    whole = os.path.join(tmp, "whole.folded")
    cmd = [args.tandem, "run", "--guest-profile", whole, "--guest-profile-hz", str(args.hz),
           "--api-sock", sock,
           # profile-stop writes here (Landlock: docs/sandbox.md).
           "--landlock-rule", os.path.dirname(os.path.abspath(args.out)) + ":rw"] + args.run_args
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    buf = b""
    ready = None
    try:
        while time.monotonic() - start < args.timeout:
            chunk = os.read(p.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            if READY in buf:
                ready = time.monotonic() - start
                break
        if ready is None:
            sys.exit(f"boot_profile: no ready marker after {time.monotonic() - start:.0f} s; "
                     f"console: {buf[-500:].decode(errors='replace')}")
        out = os.path.abspath(args.out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        stop = subprocess.run([args.tandem, "ctl", "--api-sock", sock, "profile-stop", out],
                              capture_output=True, text=True)
        print(f"ready after {ready:.1f} s (profiled at {args.hz} Hz)")
        print(stop.stdout, end="")
        if stop.returncode != 0:
            sys.exit(f"boot_profile: profile-stop failed: {stop.stdout}{stop.stderr}")
        subprocess.run([args.tandem, "ctl", "--api-sock", sock, "shutdown"],
                       capture_output=True)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    svg = os.path.splitext(out)[0] + ".svg"
    if shutil.which("inferno-flamegraph"):
        with open(svg, "w") as f:
            subprocess.run(["inferno-flamegraph", "--title", "tandem guest boot", out],
                           stdout=f, check=True)
        print(f"flame graph: {svg}")
    else:
        print("flame graph: install inferno (cargo install inferno) and run "
              f"inferno-flamegraph {out} > {svg}")


if __name__ == "__main__":
    main()

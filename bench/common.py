"""What the bench scripts share (imported by each; bench/ is on sys.path as
the folder of the script that runs): the repository's path, running a
command, network namespaces, the VMM processes a bench starts (killed on any
exit path), a guest's serial console, `tandem ctl`, waiting, the TLS
identities of resources/tls-certs.sh, and the exit on a signal.

Runs in the bench's own process, as root (namespaces, taps); starts nothing
on import."""

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the default guest's /init prints when its shell is up.
READY = b"tandem-guest: ready"
CLONE_NEWNET = 0x40000000
PROCS = []  # every VMM started by spawn(), killed on any exit path


def sh(*args, quiet=False):
    """Runs a command, which must succeed; `quiet` drops its stdout."""
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL if quiet else None)


def setns(name):
    """Moves the calling thread into network namespace `name` (sockets it
    opens, and threads and children it starts, live there). os.setns needs
    Python 3.12; libc's works everywhere."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(fd)


class Ns:
    """A network namespace made afresh (an old one of that name removed),
    lo up, then the links `links()` adds; `enter` moves the calling thread
    in, `close` removes it."""

    def __init__(self, name, quiet=False):
        self.name = name
        self.quiet = quiet
        subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)
        sh("ip", "netns", "add", name, quiet=quiet)
        self.ip("link", "set", "lo", "up")
        self.links()

    def ip(self, *args):
        """`ip -n NAME ARGS...`, which must succeed."""
        sh("ip", "-n", self.name, *args, quiet=self.quiet)

    def links(self):
        """Adds the namespace's links (none here)."""

    def enter(self):
        setns(self.name)

    def close(self):
        subprocess.run(["ip", "netns", "del", self.name], stderr=subprocess.DEVNULL)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def spawn(cmd, stderr_path):
    """Starts a VMM in its own session, its stderr appended to
    `stderr_path`; kill() or the bench's exit ends it."""
    with open(stderr_path, "ab") as err:
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=err, start_new_session=True)
    PROCS.append(p)
    return p


def kill(p):
    """Kills `p`'s whole session (if still running) and reaps it."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()
    if p in PROCS:
        PROCS.remove(p)


def kill_all():
    """Kills every VMM spawn() started that is still there."""
    for p in list(PROCS):
        kill(p)


def tail(path, n=3):
    """The last `n` non-blank lines of a file, on one line."""
    try:
        with open(path, errors="replace") as f:
            lines = [l.strip() for l in f if l.strip()]
        return " | ".join(lines[-n:]) or "(empty)"
    except OSError:
        return "(none)"


class Console:
    """A guest's serial console on a VMM's stdin/stdout (process `p`)."""

    def __init__(self, p):
        self.p = p
        self.buf = b""

    def wait_for(self, marker, timeout):
        """The console's output up to and including `marker`, decoded; what
        follows it stays for the next call."""
        end = time.monotonic() + timeout
        while marker not in self.buf:
            if time.monotonic() > end:
                raise TimeoutError(f"no {marker!r} in {timeout:.0f} s; console: {self.buf[-300:]!r}")
            r, _, _ = select.select([self.p.stdout], [], [], 0.5)
            if r:
                chunk = os.read(self.p.stdout.fileno(), 65536)
                if not chunk:
                    raise EOFError(f"VMM exited ({self.p.poll()}); console: {self.buf[-300:]!r}")
                self.buf += chunk
        i = self.buf.index(marker) + len(marker)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out.decode(errors="replace")


def ctl(args, api, *verb):
    """`tandem ctl --api-sock API VERB...`'s JSON answer."""
    out = subprocess.run([args.tandem, "ctl", "--api-sock", api, *verb],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    try:
        return json.loads(out.stdout)
    except ValueError:
        raise RuntimeError(f"tandem ctl {' '.join(verb)}: {out.stdout[-300:]!r} "
                           f"{out.stderr[-300:]!r}")


def wait(what, limit, done):
    """Polls `done()` until it is true; TimeoutError after `limit` s."""
    end = time.monotonic() + limit
    while not done():
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {limit} s")
        time.sleep(0.02)


def make_certs(d, *args):
    """resources/tls-certs.sh D ARGS... (a CA and a host certificate in `d`)."""
    subprocess.run([os.path.join(REPO, "resources", "tls-certs.sh"), d, *args],
                   check=True, stdout=subprocess.DEVNULL)


def tls_opts(d):
    """The tandem options that use the TLS identity in `d`."""
    return ["--tls-cert", os.path.join(d, "host.pem"), "--tls-key", os.path.join(d, "host.key"),
            "--tls-ca", os.path.join(d, "ca.pem")]


def exit_on_signals():
    """SIGINT, SIGTERM and SIGHUP exit through SystemExit (128 + the
    signal), so that every `finally` (VMMs, namespaces, files) runs."""
    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)

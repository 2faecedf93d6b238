"""Traffic to and from a guest for bench/colo.sh: TCP throughput both ways
and ping, the same way alone and through a COLO pair.

The guest runs two services started before the snapshot (so a secondary
synced from it runs them too, and both guests answer alike): a sink on
SINK_PORT (reads a connection to its end) and a source on SOURCE_PORT
(writes zeroes until the client closes). The host side runs in the bench's
namespace; nothing leaves it.

client -> guest: each connection sends for `seconds`, shuts its write side
and waits for the guest to close: throughput is every byte sent over the
time until the last guest close (so nothing still in flight is counted as
delivered). guest -> client: each connection reads for `seconds`, then
closes: bytes read over `seconds`.
"""
import socket
import statistics
import threading
import time

from migrate_probe import Pinger

SINK_PORT, SOURCE_PORT = 5010, 5011
CHUNK = 64 * 1024

# The guest's services: busybox nc, persistent listeners.
SERVICES = ("printf '#!/bin/sh\\nexec wc -c >/dev/null\\n' > /tmp/sink; "
            "printf '#!/bin/sh\\nexec cat /dev/zero\\n' > /tmp/source; "
            "chmod +x /tmp/sink /tmp/source; "
            f"nc -ll -p {SINK_PORT} -e /tmp/sink & "
            f"nc -ll -p {SOURCE_PORT} -e /tmp/source & true")


# The client's congestion control (None: the host's default), e.g. cubic.
CLIENT_CC = None


def _connect(ip, port, timeout, conns):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if CLIENT_CC:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, CLIENT_CC.encode())
    # A bounded send buffer, shared out among the connections: what is
    # still queued at the end is little (the guest takes ~1 Mbit/s).
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, max(16 * 1024, 256 * 1024 // conns))
    s.settimeout(timeout)
    s.connect((ip, port))
    return s


def _parallel(conns, one):
    """Runs `one()` (bytes moved) on `conns` threads: the byte counts and
    the errors."""
    results, errors = [], []

    def run():
        try:
            results.append(one())
        except OSError as e:
            errors.append(str(e))
    threads = [threading.Thread(target=run) for _ in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def tcp_in(ip, seconds, conns=1, timeout=120.0):
    """Client -> guest over `conns` connections: Mbit/s, or None."""
    t0 = time.monotonic()

    def one():
        s = _connect(ip, SINK_PORT, timeout, conns)
        buf = b"\x5a" * CHUNK
        sent = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sent += s.send(buf)
        s.shutdown(socket.SHUT_WR)
        while s.recv(4096):
            pass
        s.close()
        return sent
    results, errors = _parallel(conns, one)
    took = time.monotonic() - t0
    if errors or not results:
        return None, errors
    return sum(results) * 8 / took / 1e6, []


def tcp_out(ip, seconds, conns=1, timeout=120.0):
    """Guest -> client over `conns` connections: Mbit/s, or None."""

    def one():
        s = _connect(ip, SOURCE_PORT, timeout, conns)
        got = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            n = len(s.recv(CHUNK))
            if n == 0:
                break
            got += n
        s.close()
        return got
    results, errors = _parallel(conns, one)
    if errors or not results:
        return None, errors
    return sum(results) * 8 / seconds / 1e6, []


def ping(ip, seconds, interval):
    """Pings for `seconds`: (avg ms, max ms, loss %)."""
    p = Pinger(ip, interval)
    try:
        time.sleep(seconds)
    finally:
        p.done.set()
        for t in p.threads:
            t.join()
    rtts = list(p.replies.values())
    sent = max(1, len(p.sent))
    if not rtts:
        return None, None, 100.0
    return statistics.mean(rtts), max(rtts), 100.0 * (sent - len(rtts)) / sent


def measure(ip, seconds, conns, ping_ms):
    """Ping, then both directions, then ping again for 3 s: a dict of
    figures (None where it failed) and the errors seen.

    Ping comes first, on a guest that carries no other traffic: what a
    frame's way through the pair costs. The second ping, at once after
    the guest->client stream's end, is reported apart: the guest itself
    is busy for a while then (its vCPU at 100% for ~0.2 s alone and up to
    ~1 s in a pair here), which is the guest's work, not the frame path."""
    out, errs = {}, []
    out["ping_avg_ms"], out["ping_max_ms"], out["ping_loss_pct"] = ping(
        ip, seconds, ping_ms / 1000.0)
    out["in_mbit"], e = tcp_in(ip, seconds, conns)
    errs += e
    out["out_mbit"], e = tcp_out(ip, seconds, conns)
    errs += e
    out["ping_after_tcp_avg_ms"], out["ping_after_tcp_max_ms"], _ = ping(
        ip, 3.0, ping_ms / 1000.0)
    return out, errs

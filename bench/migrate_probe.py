"""What a guest feels while it migrates, measured by the host the same way
for every VMM: an ICMP echo request every 10 ms (a raw socket, answered by
the guest kernel) and the gaps that the guest's `tandem-jitter` (in the
default guest's /bin) reports over UDP. Used by bench/migrate_measure.py.

Times are time.monotonic() seconds. A gap goes on the host's timeline by
its datagram's arrival: t = arrival - (now_us - end_us) / 1e6, so guest and
host clocks need no common origin (as tandem's own `--probe` does it). Every
datagram repeats the last <= 32 gaps: they are taken once each, by id.
"""
import os
import socket
import statistics
import struct
import threading
import time


class Pinger:
    """Pings `ip` every `interval` s from a thread until stop()."""
    _idents = iter(range(1, 1 << 30))

    def __init__(self, ip, interval=0.01):
        self.ip, self.interval = ip, interval
        # A fresh id per pinger: a late reply to an earlier one never counts.
        self.ident = (os.getpid() * 131 + next(self._idents)) & 0xFFFF
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        self.sock.settimeout(0.05)
        self.sent = []  # send time of ping n
        self.replies = {}  # n -> round trip, ms
        self.done = threading.Event()
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._send, self._recv)]
        for t in self.threads:
            t.start()

    def _send(self):
        t0 = time.monotonic()
        n = 0
        while not self.done.is_set():
            now = time.monotonic()
            self.sent.append(now)
            try:
                self.sock.sendto(echo_request(self.ident, n & 0xFFFF, n), (self.ip, 0))
            except OSError:
                pass  # not answered: lost
            n += 1
            time.sleep(max(0.0, t0 + n * self.interval - time.monotonic()))

    def _recv(self):
        while not self.done.is_set():
            try:
                data = self.sock.recv(2048)
            except socket.timeout:
                continue
            now = time.monotonic()
            icmp = data[(data[0] & 0x0F) * 4:]
            if len(icmp) < 16:
                continue
            kind, _, _, ident, _ = struct.unpack("!BBHHH", icmp[:8])
            if kind != 0 or ident != self.ident:
                continue
            n = struct.unpack("!Q", icmp[8:16])[0]
            if n < len(self.sent) and n not in self.replies:
                self.replies[n] = (now - self.sent[n]) * 1000.0

    def halt(self):
        """Stops sending and receiving now (no wait for late replies; the
        socket stays open)."""
        self.done.set()
        for t in self.threads:
            t.join()

    def arrivals_after(self, t0):
        """When the replies to the pings sent after `t0` arrived."""
        return [self.sent[i] + rtt / 1000.0 for i, rtt in self.replies.items()
                if self.sent[i] > t0]

    def stop(self, wait=1.0):
        """Stops sending, waits `wait` s for the last replies; returns
        [(sent, rtt_ms or None)]: None for no reply within `wait` s."""
        self.done.set()
        self.threads[0].join()
        time.sleep(wait)
        self.threads[1].join()
        self.sock.close()
        out = []
        for n, t in enumerate(self.sent):
            rtt = self.replies.get(n)
            out.append((t, rtt if rtt is not None and rtt <= wait * 1000.0 else None))
        return out


def echo_request(ident, seq, n):
    payload = struct.pack("!Q", n) + b"tandem-bench" * 2
    head = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    csum = checksum(head + payload)
    return struct.pack("!BBHHH", 8, 0, csum, ident, seq) + payload


def checksum(data):
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


class Jitter:
    """Receives every `tandem-jitter` datagram on (host, port) for the
    whole bench, from a thread; runs take theirs by arrival time."""

    def __init__(self, host, port):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self.sock.settimeout(0.2)
        self.log = []  # (arrival, datagram)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._recv, daemon=True)
        self.thread.start()

    def _recv(self):
        while not self.done.is_set():
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            self.log.append((time.monotonic(), data))

    def wait(self, since, timeout, what):
        """Waits for a datagram that arrived after `since`; returns its arrival."""
        end = time.monotonic() + timeout
        while True:
            got = [a for a, _ in self.log[-2000:] if a >= since]
            if got:
                return got[0]
            if time.monotonic() > end:
                raise TimeoutError(f"no datagram from the guest's tandem-jitter in "
                                   f"{timeout:.0f} s ({what})")
            time.sleep(0.05)

    def gaps(self, t_from, t_to):
        """The datagrams that arrived in [t_from, t_to]: ([(t, gap_ms)] each
        gap once, [(arrival, max_gap_ms)] per datagram, bad datagrams)."""
        gaps, maxima, seen, bad = [], [], set(), 0
        for arrival, data in list(self.log):
            if not t_from <= arrival <= t_to:
                continue
            r = parse(data)
            if r is None:
                bad += 1
                continue
            now_us, max_gap_us, triples = r
            maxima.append((arrival, max_gap_us / 1000.0))
            for ident, end_us, gap_us in triples:
                if ident not in seen:
                    seen.add(ident)
                    gaps.append((arrival - (now_us - end_us) / 1e6, gap_us / 1000.0))
        return gaps, maxima, bad

    def close(self):
        self.done.set()
        self.thread.join()
        self.sock.close()


def parse(data):
    """`TJ1 seq now_us loops max_gap_us n (id end_us gap_us)*n` ->
    (now_us, max_gap_us, [(id, end_us, gap_us)]), or None."""
    try:
        f = [int(x) for x in data.split()[1:]] if data.startswith(b"TJ1 ") else []
    except ValueError:
        return None
    if len(f) < 5 or len(f) != 5 + 3 * f[4]:
        return None
    return f[1], f[3], [tuple(f[i:i + 3]) for i in range(5, len(f), 3)]


def window(pings, gaps, maxima, lo, hi):
    """What [lo, hi) saw: the largest gap (a reported gap by when it ended,
    a datagram's maximum by its arrival), datagrams, and pings by when they
    were sent: loss and round trips."""
    def inside(t):
        return lo <= t < hi
    g = [(ms, t) for t, ms in gaps if inside(t)] + [(ms, t) for t, ms in maxima if inside(t)]
    ps = [r for t, r in pings if inside(t)]
    ok = [r for r in ps if r is not None]
    return {
        "secs": hi - lo,
        "max_gap_ms": max(g)[0] if g else None,
        "max_gap_t": max(g)[1] if g else None,  # when it ended (or was reported)
        "reports": sum(1 for t, _ in maxima if inside(t)),
        "gaps_over_400": sum(1 for t, ms in gaps if inside(t) and ms > 400),
        "pings": len(ps),
        "loss_pct": 100.0 * (len(ps) - len(ok)) / len(ps) if ps else None,
        "rtt_avg_ms": statistics.mean(ok) if ok else None,
        "rtt_max_ms": max(ok) if ok else None,
    }

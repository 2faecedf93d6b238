"""The two-host figures of bench/colo.sh (--hosts-runs N): a pair whose
primary runs in namespace "host A" and secondary in "host B", the
replication stream on their own link, the client (this bench's pinger) in
a third namespace on a LAN both hosts' guests reach, and an etcd server in
a fourth, reached by each host over its own link; the lease is an etcd
lease with TTL --lease-ttl-s. Each run cuts host A off from B and from etcd
(its LAN stays) while the client pings the guest every --ping-ms, and
gives: the takeover (cut -> the secondary's colo-status says failed_over)
and the failover as the client sees it (cut -> the first reply to a ping
sent after the cut). The pair's streams are TLS, each host with its own
certificate (resources/tls-certs.sh). Both are bounded below by the lease's TTL: the
secondary may serve only once the primary's lease expired.

The same topology as tests/src/hosts.rs; addresses from documentation
ranges, in namespaces made and removed here. Not a test.
"""
import os
import subprocess
import time

from migrate_measure import MAC
from migrate_probe import Pinger
from common import ctl, kill, make_certs, setns, sh, spawn, tail, tls_opts, wait
from snapshot_measure import Console

HOST, GUEST, PREFIX = "192.0.2.1", "192.0.2.2", 24
REP_A, REP_B = "203.0.113.1", "203.0.113.2"
ETCD = {"a": ("203.0.113.6", "203.0.113.5"), "b": ("203.0.113.10", "203.0.113.9")}


class Hosts:
    """The four namespaces, their links and etcd; `close` removes them."""

    def __init__(self, tag, tmp):
        self.ns = {k: f"tandem-{tag}-{k}-{os.getpid()}" for k in ("a", "b", "c", "e")}
        self.etcd, self.data = None, os.path.join(tmp, f"{tag}-etcd")
        for name in self.ns.values():
            subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)
            sh("ip", "netns", "add", name)
            self.run(name, "ip", "link", "set", "lo", "up")
            for key in ("all", "default"):
                self.run(name, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1")
        c = self.ns["c"]
        sh("ip", "-n", c, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", c, "addr", "add", f"{HOST}/{PREFIX}", "dev", "br0")
        sh("ip", "-n", c, "link", "set", "br0", "up")
        for host in ("a", "b"):
            ns = self.ns[host]
            sh("ip", "-n", ns, "link", "add", "brl", "type", "bridge")
            sh("ip", "-n", ns, "link", "set", "brl", "up")
            sh("ip", "-n", ns, "tuntap", "add", "dev", "tap0", "mode", "tap")
            sh("ip", "-n", ns, "link", "set", "dev", "tap0", "master", "brl", "up")
            self.veth(ns, "lan", None, c, f"lan-{host}", None)
            sh("ip", "-n", ns, "link", "set", "dev", "lan", "master", "brl")
            sh("ip", "-n", c, "link", "set", "dev", f"lan-{host}", "master", "br0")
            self.veth(ns, "etcd", ETCD[host][0], self.ns["e"], f"to-{host}", ETCD[host][1])
        self.veth(self.ns["a"], "rep", REP_A, self.ns["b"], "rep", REP_B)
        self.start_etcd()

    @staticmethod
    def run(ns, *cmd):
        sh("ip", "netns", "exec", ns, *cmd)

    @staticmethod
    def veth(ns, dev, addr, other, peer, peer_addr):
        sh("ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", peer,
           "netns", other)
        for n, d, a in ((ns, dev, addr), (other, peer, peer_addr)):
            if a:
                sh("ip", "-n", n, "addr", "add", f"{a}/30", "dev", d)
            sh("ip", "-n", n, "link", "set", "dev", d, "up")

    def arbiter(self, host, key):
        return f"etcd:http://{ETCD[host][1]}:2379/tandem/{key}"

    def start_etcd(self):
        urls = ",".join(f"http://{ETCD[h][1]}:2379" for h in ("a", "b"))
        self.etcd = subprocess.Popen(
            ["ip", "netns", "exec", self.ns["e"], "etcd", "--name", "bench", "--data-dir",
             self.data, "--listen-client-urls", urls, "--advertise-client-urls", urls,
             "--listen-peer-urls", "http://127.0.0.1:2380",
             "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
             "--initial-cluster", "bench=http://127.0.0.1:2380", "--log-level", "warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # its own group: kill() signals the group
        end = time.monotonic() + 30
        while subprocess.run(["ip", "netns", "exec", self.ns["e"], "etcdctl", "--endpoints",
                              urls, "endpoint", "health"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL).returncode != 0:
            if time.monotonic() > end:
                raise RuntimeError("etcd does not answer (is etcd-server installed?)")
            time.sleep(0.1)

    def cut_a(self):
        """Host A off from B and from etcd: both ends of each link down."""
        for ns, dev in ((self.ns["a"], "rep"), (self.ns["b"], "rep"),
                        (self.ns["a"], "etcd"), (self.ns["e"], "to-a")):
            sh("ip", "-n", ns, "link", "set", "dev", dev, "down")

    def close(self):
        if self.etcd:
            kill(self.etcd)
        for name in self.ns.values():
            subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)
        subprocess.run(["rm", "-rf", self.data])


def host_pki(tmp):
    """Host A's and host B's TLS options: one CA (resources/tls-certs.sh),
    B's certificate naming its replication address."""
    a, b = os.path.join(tmp, "pki-a"), os.path.join(tmp, "pki-b")
    if not os.path.exists(os.path.join(b, "host.pem")):
        make_certs(a, REP_A)
        make_certs(b, "--ca-from", a, REP_B)
    return [tls_opts(d) for d in (a, b)]


def one(args, snap, tmp, n, home):
    """One two-host pair, cut off; its figures. `home`: the namespace this
    bench runs in (entered again after the pinger's socket is made)."""
    hosts = Hosts(f"cohost{n}", tmp)
    err = os.path.join(tmp, f"hosts{n}")
    api_p, api_s = err + ".p.api", err + ".s.api"
    procs = []
    tls_a, tls_b = host_pki(tmp)
    try:
        ttl = str(args.lease_ttl_s)
        p = spawn(["ip", "netns", "exec", hosts.ns["a"], args.tandem, "run", "--restore", snap,
                   "--api-sock", api_p, "--net", f"tap=tap0,mac={MAC}", *tls_a], err + ".p")
        procs.append(p)
        con = Console(p)
        con.wait_for(con.send("true"), args.cmd_timeout)
        s = spawn(["ip", "netns", "exec", hosts.ns["b"], args.tandem, "run", "--colo",
                   "secondary", "--colo-listen", f"tcp:{REP_B}:7700", "--colo-arbiter",
                   hosts.arbiter("b", f"bench{n}"), "--colo-lease-ttl-s", ttl,
                   "--mem", f"{args.mem}M", "--cpus", str(args.cpus), "--api-sock", api_s,
                   "--net", f"tap=tap0,mac={MAC}", *tls_b], err + ".s")
        procs.append(s)
        wait("the secondary listens", 60, lambda: "waiting for a migration" in tail(err + ".s", 50))
        a = ctl(args, api_p, "colo-start", f"tcp:{REP_B}:7700", "--arbiter",
                hosts.arbiter("a", f"bench{n}"), "--lease-ttl-s", ttl,
                "--checkpoint-period-ms", str(args.period_ms),
                "--heartbeat-ms", str(args.heartbeat_ms),
                "--heartbeat-timeout-ms", str(args.timeout_ms))
        if not a.get("ok"):
            raise RuntimeError(f"colo-start: {a}")
        wait("protected", 120, lambda: ctl(args, api_p, "colo-status")["colo"]["state"]
             == "protected")
        time.sleep(2.0)
        setns(hosts.ns["c"])
        try:
            pinger = Pinger(GUEST, args.ping_ms / 1000.0)
        finally:
            setns(home)
        try:
            time.sleep(1.0)
            t_cut = time.monotonic()
            hosts.cut_a()
            wait("the secondary serves", 60,
                 lambda: ctl(args, api_s, "colo-status")["colo"]["state"] == "failed_over")
            t_over = time.monotonic()
            time.sleep(2.0)
        finally:
            pinger.halt()
        after = pinger.arrivals_after(t_cut)
        if not after:
            raise RuntimeError("no ping reply after host A was cut off")
        fenced = "tandem: COLO: fenced" in tail(err + ".p", 200)
        return {"takeover_ms": (t_over - t_cut) * 1000.0,
                "failover_ms": (min(after) - t_cut) * 1000.0,
                "primary_fenced": fenced}
    finally:
        for q in procs:
            kill(q)
        hosts.close()
        for f in (api_p, api_s):
            if os.path.exists(f):
                os.unlink(f)


def report(args, runs, failures):
    """Lines for the bench's report, and the figures for its JSON."""
    if not runs:
        return [f"two hosts: no run completed ({'; '.join(failures)})"], {}
    out, figs = [], {"lease_ttl_s": args.lease_ttl_s, "runs": len(runs)}
    for k in ("takeover_ms", "failover_ms"):
        v = sorted(r[k] for r in runs)
        figs[k] = {"min": v[0], "median": v[len(v) // 2]}
    out.append(
        f"two hosts, host A cut off (lease TTL {args.lease_ttl_s} s, heartbeat timeout "
        f"{args.timeout_ms} ms), min/median of {len(runs)}: secondary serving "
        f"{figs['takeover_ms']['min']:.0f} / {figs['takeover_ms']['median']:.0f} ms after "
        f"the cut, first client reply {figs['failover_ms']['min']:.0f} / "
        f"{figs['failover_ms']['median']:.0f} ms after it (bounded below by the TTL, "
        f"{args.lease_ttl_s * 1000} ms)")
    fenced = sum(1 for r in runs if r["primary_fenced"])
    out.append(f"two hosts: the cut-off primary fenced itself in {fenced} of {len(runs)} runs")
    if failures:
        out.append(f"two hosts: failed runs: {'; '.join(failures)}")
    return out, figs

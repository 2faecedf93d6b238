//! Two hosts, a client and etcd on one machine, each in a network
//! namespace the test creates and removes: "host A" and "host B" (a
//! tandem each), the client, and the etcd server.
//!
//! ```text
//!   client: br0 (HOST_IP0) ── lan-a ─┬─ A: lan ── brl ── tap0 (guest NIC 0)
//!                          └ lan-b ─┐│   rep 203.0.113.1 ────┐
//!                                   ││   etcd 203.0.113.6 ─┐ │
//!                                   │└─ B: lan ── brl ── tap0 │
//!                                   │    rep 203.0.113.2 ─────┘ (replication)
//!                                   │    etcd 203.0.113.10 ─┐
//!   etcd:  to-a 203.0.113.5 ───────────┼───────────────────────┘ (A's link)
//!          to-b 203.0.113.9 ───────────┴── (B's link)
//! ```
//!
//! Each link can be cut on its own ([`Hosts::cut`]: both ends down; this
//! kernel has no tc drop action or netfilter for a silent cut) and
//! restored. Once set up, the hosts' own stacks send nothing on the
//! client's LAN (IPv6 off, no address there), so every frame a host puts
//! there is its guest's: the client's packet counter of `lan-a`/`lan-b`
//! counts what that host's guest sent it (a bridge may send one frame
//! while the LAN is being set up: compare counts taken later).
//! Addresses come from documentation ranges and exist only here.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::base::{scratch, HOST_IP0, PREFIX};
use crate::netns::NetNs;

/// A's and B's addresses on the replication link.
pub const REP_A: &str = "203.0.113.1";
pub const REP_B: &str = "203.0.113.2";
/// etcd's address as A and as B reach it.
pub const ETCD_FOR_A: &str = "203.0.113.5";
pub const ETCD_FOR_B: &str = "203.0.113.9";
const ETCD_PORT: u16 = 2379;

/// A link [`Hosts::cut`] can cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// A ↔ B (the replication stream).
    Replication,
    /// A ↔ etcd.
    EtcdA,
    /// B ↔ etcd.
    EtcdB,
}

/// The namespaces, their links, and the etcd server (started).
pub struct Hosts {
    pub a: NetNs,
    pub b: NetNs,
    pub client: NetNs,
    pub etcd_ns: NetNs,
    etcd: Option<Child>,
    data: PathBuf,
    log: PathBuf,
}

impl Hosts {
    /// Builds the topology for test `tag` and starts etcd.
    pub fn new(tag: &str) -> Hosts {
        let a = NetNs::new(&format!("{tag}-a"));
        let b = NetNs::new(&format!("{tag}-b"));
        let client = NetNs::new(&format!("{tag}-c"));
        let etcd_ns = NetNs::new(&format!("{tag}-e"));
        for ns in [&a, &b, &client, &etcd_ns] {
            for key in ["all", "default"] {
                ns.must(
                    "sysctl",
                    &["-qw", &format!("net.ipv6.conf.{key}.disable_ipv6=1")],
                );
            }
        }
        client.add_bridge("br0", &format!("{HOST_IP0}/{PREFIX}"), &[]);
        for (host, lan) in [(&a, "lan-a"), (&b, "lan-b")] {
            host.must("ip", &["link", "add", "brl", "type", "bridge"]);
            host.must("ip", &["link", "set", "brl", "up"]);
            for tap in ["tap0", "tap1"] {
                host.add_bare_tap(tap);
            }
            host.must("ip", &["link", "set", "tap0", "master", "brl"]);
            veth(host, "lan", None, &client, lan, None);
            host.must("ip", &["link", "set", "lan", "master", "brl"]);
            client.must("ip", &["link", "set", lan, "master", "br0"]);
        }
        veth(&a, "rep", Some(REP_A), &b, "rep", Some(REP_B));
        veth(
            &a,
            "etcd",
            Some("203.0.113.6"),
            &etcd_ns,
            "to-a",
            Some(ETCD_FOR_A),
        );
        veth(
            &b,
            "etcd",
            Some("203.0.113.10"),
            &etcd_ns,
            "to-b",
            Some(ETCD_FOR_B),
        );
        let mut hosts = Hosts {
            a,
            b,
            client,
            etcd_ns,
            etcd: None,
            data: scratch(&format!("{tag}-etcd")),
            log: scratch(&format!("{tag}-etcd.log")),
        };
        hosts.start_etcd();
        hosts
    }

    /// The arbiter option for host A (`--arbiter`) or B
    /// (`--colo-arbiter`): the etcd address that host reaches, key `key`.
    pub fn arbiter(&self, host_a: bool, key: &str) -> String {
        let addr = if host_a { ETCD_FOR_A } else { ETCD_FOR_B };
        format!("etcd:http://{addr}:{ETCD_PORT}/tandem/{key}")
    }

    /// Starts etcd on its data directory (kept across a restart) and
    /// waits until it answers on both links.
    pub fn start_etcd(&mut self) {
        assert!(self.etcd.is_none(), "etcd runs already");
        let etcd = "/usr/bin/etcd";
        assert!(
            std::path::Path::new(etcd).exists(),
            "{etcd} is missing: resources/setup.sh installs etcd-server"
        );
        let clients = format!("http://{ETCD_FOR_A}:{ETCD_PORT},http://{ETCD_FOR_B}:{ETCD_PORT}");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("etcd's log file");
        let child = self
            .etcd_ns
            .command(etcd)
            .args([
                "--name",
                "tandem",
                "--data-dir",
                self.data.to_str().expect("UTF-8 path"),
                "--listen-client-urls",
                &clients,
                "--advertise-client-urls",
                &clients,
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-cluster",
                "tandem=http://127.0.0.1:2380",
                "--log-level",
                "warn",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("etcd's log file"))
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.etcd = Some(child);
        let t = Instant::now();
        for addr in [ETCD_FOR_A, ETCD_FOR_B] {
            let endpoint = format!("http://{addr}:{ETCD_PORT}");
            loop {
                let ok = self
                    .etcd_ns
                    .command("etcdctl")
                    .args(["--endpoints", &endpoint, "endpoint", "health"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
                if ok {
                    break;
                }
                assert!(
                    t.elapsed() < Duration::from_secs(30),
                    "etcd does not answer at {endpoint}: {}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// Kills etcd (SIGKILL); its data stays for a restart.
    pub fn kill_etcd(&mut self) {
        if let Some(mut c) = self.etcd.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Cuts `link`: both its ends go down (each side's kernel drops what
    /// it would send there; nothing crosses).
    pub fn cut(&self, link: Link) {
        for (ns, dev) in self.ends(link) {
            ns.must("ip", &["link", "set", "dev", dev, "down"]);
        }
    }

    /// Restores a cut `link` (its addresses and routes come back).
    pub fn restore(&self, link: Link) {
        for (ns, dev) in self.ends(link) {
            ns.must("ip", &["link", "set", "dev", dev, "up"]);
        }
    }

    fn ends(&self, link: Link) -> [(&NetNs, &'static str); 2] {
        match link {
            Link::Replication => [(&self.a, "rep"), (&self.b, "rep")],
            Link::EtcdA => [(&self.a, "etcd"), (&self.etcd_ns, "to-a")],
            Link::EtcdB => [(&self.b, "etcd"), (&self.etcd_ns, "to-b")],
        }
    }

    /// Frames the client received from host A's (`true`) or B's LAN port.
    pub fn from_host(&self, host_a: bool) -> u64 {
        let dev = if host_a { "lan-a" } else { "lan-b" };
        self.client.link_packets(dev).0
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        self.kill_etcd();
        let _ = std::fs::remove_dir_all(&self.data);
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A veth pair `dev` in `ns` ↔ `peer` in `other`, each with its /30
/// address if given; both up.
fn veth(
    ns: &NetNs,
    dev: &str,
    addr: Option<&str>,
    other: &NetNs,
    peer: &str,
    peer_addr: Option<&str>,
) {
    let st = Command::new("ip")
        .args([
            "-n", &ns.name, "link", "add", dev, "type", "veth", "peer", "name", peer,
        ])
        .args(["netns", &other.name])
        .status()
        .expect("run ip");
    assert!(st.success(), "veth {dev} in {} to {peer}", ns.name);
    for (n, d, a) in [(ns, dev, addr), (other, peer, peer_addr)] {
        if let Some(a) = a {
            n.must("ip", &["addr", "add", &format!("{a}/30"), "dev", d]);
        }
        n.must("ip", &["link", "set", "dev", d, "up"]);
    }
}

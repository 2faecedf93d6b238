//! Network namespaces and taps that a test creates and always removes.
//! Traffic stays inside them: addresses come from documentation ranges
//! (192.0.2.0/24, 198.51.100.0/24) on taps that exist only in the namespace.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::Command;

/// A network namespace, deleted (with its taps) on drop.
pub struct NetNs {
    pub name: String,
}

fn ip(args: &[&str]) {
    let st = Command::new("ip").args(args).status().expect("run ip");
    assert!(st.success(), "ip {args:?} failed");
}

impl NetNs {
    /// Creates namespace `tandem-<tag>-<pid>` with loopback up.
    pub fn new(tag: &str) -> NetNs {
        let name = format!("tandem-{tag}-{}", std::process::id());
        let _ = Command::new("ip")
            .args(["netns", "del", &name])
            .stderr(std::process::Stdio::null())
            .status();
        ip(&["netns", "add", &name]);
        let ns = NetNs { name };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    /// Adds tap `dev` with host address `cidr`, up.
    pub fn add_tap(&self, dev: &str, cidr: &str) {
        ip(&["-n", &self.name, "tuntap", "add", "dev", dev, "mode", "tap"]);
        ip(&["-n", &self.name, "addr", "add", cidr, "dev", dev]);
        ip(&["-n", &self.name, "link", "set", dev, "up"]);
    }

    /// Adds tap `dev` with no address, up.
    pub fn add_bare_tap(&self, dev: &str) {
        ip(&["-n", &self.name, "tuntap", "add", "dev", dev, "mode", "tap"]);
        ip(&["-n", &self.name, "link", "set", dev, "up"]);
    }

    /// Adds bridge `br` with host address `cidr` and the bare taps
    /// `ports` on it (created here), all up.
    pub fn add_bridge(&self, br: &str, cidr: &str, ports: &[&str]) {
        ip(&["-n", &self.name, "link", "add", br, "type", "bridge"]);
        ip(&["-n", &self.name, "addr", "add", cidr, "dev", br]);
        ip(&["-n", &self.name, "link", "set", br, "up"]);
        for p in ports {
            self.add_bare_tap(p);
            ip(&["-n", &self.name, "link", "set", p, "master", br]);
        }
    }

    /// Adds a veth pair: `dev` here, `peer` in namespace `other` with
    /// address `peer_cidr`; both up.
    pub fn add_veth(&self, dev: &str, other: &NetNs, peer: &str, peer_cidr: &str) {
        ip(&[
            "-n",
            &self.name,
            "link",
            "add",
            dev,
            "type",
            "veth",
            "peer",
            "name",
            peer,
            "netns",
            &other.name,
        ]);
        ip(&["-n", &self.name, "link", "set", dev, "up"]);
        ip(&["-n", &other.name, "addr", "add", peer_cidr, "dev", peer]);
        ip(&["-n", &other.name, "link", "set", peer, "up"]);
    }

    /// Runs a program in the namespace; it must succeed.
    pub fn must(&self, program: &str, args: &[&str]) {
        let st = self.command(program).args(args).status().expect("run");
        assert!(st.success(), "{program} {args:?} in {} failed", self.name);
    }

    /// Joins `a` and `b` like a wire: every frame arriving on one is sent out
    /// of the other (tc ingress + mirred redirect). Unlike a bridge, this
    /// keeps a tap's socket send-buffer accounting while frames wait in a
    /// qdisc of `b`, so a tap write really returns EAGAIN when `b` is slow.
    pub fn wire(&self, a: &str, b: &str) {
        for (from, to) in [(a, b), (b, a)] {
            self.must("tc", &["qdisc", "add", "dev", from, "ingress"]);
            self.must(
                "tc",
                &[
                    "filter", "add", "dev", from, "parent", "ffff:", "protocol", "all", "u32",
                    "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", to,
                ],
            );
        }
    }

    /// The kernel's packet counters of `dev`: (rx_packets, tx_packets).
    pub fn link_packets(&self, dev: &str) -> (u64, u64) {
        let read = |what: &str| -> u64 {
            let out = self
                .command("cat")
                .arg(format!("/sys/class/net/{dev}/statistics/{what}"))
                .output()
                .expect("read link statistics");
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse()
                .expect("link statistic")
        };
        (read("rx_packets"), read("tx_packets"))
    }

    /// A command that runs inside the namespace.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    /// Runs `f` on a thread that has entered the namespace: sockets it opens
    /// live there.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let path = format!("/var/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let ns = File::open(&path).expect("open netns");
            // SAFETY: setns on a namespace fd we hold; affects this thread only.
            let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

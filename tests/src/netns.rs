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

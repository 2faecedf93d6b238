//! The etcd lease against a real etcd, which each test starts on free
//! loopback ports and kills at its end (`/usr/bin/etcd`, installed by
//! resources/setup.sh). Freezing etcd (SIGSTOP) stands for a partition.

use std::fs::{self, File};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::sleep;
use std::time::{Duration, Instant};

use replication::arbiter::{Arbiter, ArbiterError};
use replication::etcd::{call_timeout, EtcdLease, EtcdSpec};

const ETCD: &str = "/usr/bin/etcd";
const ETCDCTL: &str = "/usr/bin/etcdctl";
const KEY: &str = "/tandem/pair1";

/// One etcd of our own, killed (and its data removed) on drop.
struct Etcd {
    child: Child,
    dir: PathBuf,
    endpoint: String,
}

/// Two free loopback ports.
fn free_ports() -> (u16, u16) {
    let a = TcpListener::bind("127.0.0.1:0").unwrap();
    let b = TcpListener::bind("127.0.0.1:0").unwrap();
    (
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    )
}

impl Etcd {
    fn start(tag: &str) -> Etcd {
        assert!(
            Path::new(ETCD).exists() && Path::new(ETCDCTL).exists(),
            "{ETCD} or {ETCDCTL} is missing: resources/setup.sh installs etcd-server \
             and etcd-client"
        );
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("tandem-etcd-{tag}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let (client, peer) = free_ports();
        let endpoint = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = File::create(dir.join("etcd.log")).unwrap();
        let child = Command::new(ETCD)
            .args(["--name", "t", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &endpoint])
            .args(["--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("t={peer_url}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut etcd = Etcd {
            child,
            dir,
            endpoint,
        };
        etcd.wait_healthy();
        etcd
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }

    fn wait_healthy(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("etcd exited ({status}) while starting:\n{}", self.log());
            }
            let out = self.ctl_output(&["endpoint", "health"]);
            if out.status.success() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "etcd at {} not healthy after 20 s:\n{}",
                self.endpoint,
                self.log()
            );
            sleep(Duration::from_millis(100));
        }
    }

    fn ctl_output(&self, args: &[&str]) -> std::process::Output {
        Command::new(ETCDCTL)
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.endpoint))
            .arg("--command-timeout=2s")
            .args(args)
            .output()
            .unwrap()
    }

    /// `etcdctl ARGS`, which must succeed; its standard output.
    fn ctl(&self, args: &[&str]) -> String {
        let out = self.ctl_output(args);
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} etcd");
    }

    /// Stops etcd (SIGSTOP): its port still accepts, nothing answers.
    fn freeze(&self) {
        self.signal("-STOP");
    }

    fn thaw(&self) {
        self.signal("-CONT");
    }

    fn spec(&self, key: &str) -> EtcdSpec {
        format!("etcd:{}{key}", self.endpoint).parse().unwrap()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Polls `f` every 10 ms until it is true: the time it took, or `None`
/// after `limit`.
fn within(limit: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if f() {
            return Some(start.elapsed());
        }
        if start.elapsed() > limit {
            return None;
        }
        sleep(Duration::from_millis(10));
    }
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

#[test]
fn one_side_holds_and_a_release_hands_over_at_once() {
    let etcd = Etcd::start("hold");
    let spec = etcd.spec(KEY);
    let ttl = secs(2);
    let mut a = EtcdLease::open(&spec, "primary a", ttl).unwrap();
    let mut b = EtcdLease::open(&spec, "secondary b", ttl).unwrap();
    let gate_a = a.gate();
    assert_eq!(b.current_holder().unwrap(), None);
    assert!(a.try_acquire().unwrap());
    assert!(a.holds() && gate_a.is_open());
    assert!(a.try_acquire().unwrap(), "idempotent while held");
    assert!(!b.try_acquire().unwrap());
    assert!(!b.holds() && !b.gate().is_open());
    assert_eq!(b.current_holder().unwrap().as_deref(), Some("primary a"));
    assert_eq!(b.describe().holder.as_deref(), Some("primary a"));
    assert_eq!(
        etcd.ctl(&["get", KEY, "--print-value-only"]).trim(),
        "primary a"
    );

    let info = a.describe();
    assert_eq!(info.kind, "etcd");
    assert_eq!(info.resource, spec.to_string());
    assert!(info.held);
    assert_eq!(info.holder.as_deref(), Some("primary a"));
    let left = info.ttl_left.unwrap();
    assert!(left > Duration::ZERO && left <= ttl * 2 / 3, "{left:?}");

    // Kept alive past its TTL, the other side still shut out.
    let until = Instant::now() + ttl + secs(1);
    while Instant::now() < until {
        assert!(a.holds(), "the keep-alive let the gate run out");
        assert!(!b.try_acquire().unwrap());
        sleep(Duration::from_millis(200));
    }

    a.release();
    assert!(!gate_a.is_open() && !a.holds());
    let t = Instant::now();
    assert!(b.try_acquire().unwrap(), "free at once after a release");
    assert!(t.elapsed() < secs(1));
    assert_eq!(a.current_holder().unwrap().as_deref(), Some("secondary b"));
    assert!(!a.try_acquire().unwrap());
    assert_eq!(a.describe().holder.as_deref(), Some("secondary b"));

    let t = Instant::now();
    drop(b);
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "drop took {:?}",
        t.elapsed()
    );
    assert!(
        a.try_acquire().unwrap(),
        "dropping a holder releases its lease"
    );
}

#[test]
fn the_alone_mark_is_written_only_under_the_lease() {
    let etcd = Etcd::start("mark");
    let spec = etcd.spec(KEY);
    let mut a = EtcdLease::open(&spec, "a", secs(2)).unwrap();
    let mut b = EtcdLease::open(&spec, "b", secs(2)).unwrap();
    assert_eq!(b.alone_mark().unwrap(), None);
    assert!(matches!(a.mark_alone(3), Err(ArbiterError::NotHeld { .. })));
    assert!(a.try_acquire().unwrap());
    a.mark_alone(7).unwrap();
    assert_eq!(b.alone_mark().unwrap(), Some(7));
    let mark_key = format!("{KEY}/alone");
    assert_eq!(
        etcd.ctl(&["get", &mark_key, "--print-value-only"]).trim(),
        "7"
    );
    assert!(!b.try_acquire().unwrap());
    assert!(matches!(b.mark_alone(8), Err(ArbiterError::NotHeld { .. })));
    assert!(matches!(b.clear_alone(), Err(ArbiterError::NotHeld { .. })));
    assert_eq!(a.alone_mark().unwrap(), Some(7));
    a.clear_alone().unwrap();
    a.clear_alone().unwrap();
    assert_eq!(b.alone_mark().unwrap(), None);

    // The mark outlives its writer's lease.
    a.mark_alone(9).unwrap();
    a.release();
    assert!(b.try_acquire().unwrap());
    assert_eq!(b.alone_mark().unwrap(), Some(9));
    assert!(matches!(a.mark_alone(1), Err(ArbiterError::NotHeld { .. })));

    // The server checks the key is still ours, whatever our gate says.
    etcd.ctl(&["put", KEY, "intruder"]);
    assert!(b.holds(), "the gate cannot know");
    assert!(matches!(
        b.mark_alone(10),
        Err(ArbiterError::NotHeld { .. })
    ));
    assert_eq!(b.alone_mark().unwrap(), Some(9));

    etcd.ctl(&["put", &mark_key, "seven"]);
    let e = b.alone_mark().unwrap_err();
    assert!(matches!(e, ArbiterError::BadMark { .. }), "{e:?}");
    assert!(e.to_string().contains(&mark_key), "{e}");
}

#[test]
fn a_frozen_etcd_fences_the_holder_before_the_ttl() {
    let etcd = Etcd::start("freeze");
    let ttl = secs(2);
    let mut a = EtcdLease::open(&etcd.spec(KEY), "a", ttl).unwrap();
    assert!(a.try_acquire().unwrap());
    // Renewed in time, never past 2/3 of the TTL from now.
    let until = Instant::now() + ttl;
    while Instant::now() < until {
        let left = a.gate().time_left().unwrap();
        assert!(left > Duration::ZERO && left <= ttl * 2 / 3, "{left:?}");
        sleep(Duration::from_millis(50));
    }
    let frozen = Instant::now();
    etcd.freeze();
    let closed = within(ttl * 2, || !a.holds());
    let taken = frozen.elapsed();
    // Read while etcd is still frozen: after the thaw a renewal that
    // reaches the lease (still alive at the server) reopens the gate.
    let info = a.describe();
    let left = a.gate().time_left();
    etcd.thaw();
    let closed = closed.unwrap_or_else(|| panic!("still holds {taken:?} after the freeze"));
    // The last renewal answered was sent before the freeze, and opened
    // the gate for 2/3 of the TTL from its sending: tighter than the
    // 2/3 TTL + TTL/6 (a renewal period) + 200 ms asked for.
    let bound = ttl * 2 / 3 + Duration::from_millis(200);
    eprintln!("fenced {closed:?} after the freeze (bound {bound:?})");
    assert!(closed <= bound, "fenced after {closed:?}, bound {bound:?}");
    assert!(closed < ttl);
    assert!(!info.held);
    assert_eq!(info.ttl_left, None);
    assert_eq!(left, Some(Duration::ZERO));
}

#[test]
fn a_short_freeze_is_ridden_out_by_the_keep_alive() {
    let etcd = Etcd::start("ride");
    let ttl = secs(3);
    let spec = etcd.spec(KEY);
    let mut a = EtcdLease::open(&spec, "a", ttl).unwrap();
    let mut b = EtcdLease::open(&spec, "b", ttl).unwrap();
    assert!(a.try_acquire().unwrap());
    let gate = a.gate();
    etcd.freeze();
    let closed = within(ttl, || !gate.is_open());
    etcd.thaw();
    let closed = closed.expect("the gate ran out while etcd was frozen");
    // The server's lease outlives the gate by at least TTL/3: a renewal
    // after the thaw finds it and opens the gate again.
    let back = within(ttl / 6 + call_timeout(ttl) + secs(1), || gate.is_open());
    eprintln!("the gate ran out {closed:?} after the freeze, open again {back:?} after the thaw");
    assert!(back.is_some(), "the keep-alive did not reopen the gate");
    assert!(a.holds());
    assert!(!b.try_acquire().unwrap());
    assert_eq!(b.current_holder().unwrap().as_deref(), Some("a"));
    assert!(a.try_acquire().unwrap());
}

#[test]
fn a_lease_revoked_at_the_server_closes_the_gate() {
    let etcd = Etcd::start("revoked");
    let ttl = secs(2);
    let mut a = EtcdLease::open(&etcd.spec(KEY), "a", ttl).unwrap();
    assert!(a.try_acquire().unwrap());
    let list = etcd.ctl(&["lease", "list"]);
    let ids: Vec<&str> = list.lines().skip(1).map(str::trim).collect();
    assert_eq!(ids.len(), 1, "{list}");
    etcd.ctl(&["lease", "revoke", ids[0]]);
    let gate = a.gate();
    // The next renewal (within TTL/6) hears TTL 0 and closes the gate:
    // closed, not run out (a run-out gate keeps its deadline).
    let closed = within(
        ttl / 6 + call_timeout(ttl) + Duration::from_millis(300),
        || !gate.is_open() && gate.deadline().is_none(),
    );
    eprintln!("closed {closed:?} after the revocation");
    assert!(closed.is_some(), "the gate is {gate:?}");
    assert!(!a.holds());
    assert_eq!(a.current_holder().unwrap(), None);
    assert!(a.try_acquire().unwrap(), "a new lease after losing one");
    assert!(a.holds());
}

#[test]
fn an_unreachable_etcd_is_an_error_not_a_hang() {
    let (port, _) = free_ports();
    let spec: EtcdSpec = format!("etcd:http://127.0.0.1:{port}{KEY}")
        .parse()
        .unwrap();
    let ttl = secs(2);
    let mut a = EtcdLease::open(&spec, "a", ttl).unwrap();
    let limit = Duration::from_millis(1500);
    let t = Instant::now();
    let e = a.try_acquire().unwrap_err();
    eprintln!("nothing listening: {e} after {:?}", t.elapsed());
    assert!(t.elapsed() < limit, "took {:?}", t.elapsed());
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    assert!(!a.holds());
    let t = Instant::now();
    assert!(a.current_holder().is_err());
    assert!(a.alone_mark().is_err());
    assert!(t.elapsed() < limit * 2, "took {:?}", t.elapsed());

    // A frozen etcd: connected, never answering.
    let etcd = Etcd::start("frozen");
    let mut b = EtcdLease::open(&etcd.spec(KEY), "b", ttl).unwrap();
    etcd.freeze();
    let t = Instant::now();
    let e = b.try_acquire().unwrap_err();
    let took = t.elapsed();
    etcd.thaw();
    eprintln!("frozen: {e} after {took:?}");
    assert!(matches!(e, ArbiterError::Timeout { .. }), "{e:?}");
    assert!(took < limit, "took {took:?}");
    // Connected again on the next call.
    let mut last = None;
    let ok = within(secs(3), || match b.try_acquire() {
        Ok(held) => held,
        Err(e) => {
            last = Some(e);
            false
        }
    });
    assert!(ok.is_some(), "not acquired after the thaw: {last:?}");
    let t = Instant::now();
    drop(b);
    assert!(t.elapsed() < limit, "drop took {:?}", t.elapsed());
    drop(a);
}

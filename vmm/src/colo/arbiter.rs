//! Which arbiter a side of a pair uses, as the user names it, and the gate
//! every frame a side releases to the client passes.
//!
//! - `--colo-arbiter etcd:http://ADDR:PORT[,...]/KEY` with
//!   `--colo-lease-ttl-s N`: an etcd lease ([`replication::etcd`]), for a
//!   pair on two hosts. Each side names the endpoints it reaches etcd by;
//!   the key must be the same on both.
//! - otherwise the one-host lock file ([`replication::arbiter::LockFileLease`]):
//!   `--colo-lease PATH`, or a file in /tmp named after the secondary's
//!   address.
//!
//! [`Fence`]: a side may release output to the client while its lease's
//! gate is open (held and renewed in time), or, for the primary while the
//! pair is formed, while its *peer gate* is open: the secondary answered a
//! heartbeat or a checkpoint sent at `s`, so it heard from this side at or
//! after `s` and cannot declare it lost (and so take over) before
//! `s + heartbeat timeout`; the peer gate closes a fifth of that timeout
//! earlier. So a primary whose etcd went away goes on serving while its
//! secondary answers (the pair stays protected), and stops by itself,
//! whatever its threads are doing, once neither holds.
//!
//! Run by each side's `colo` thread (open, the gates' updates) and read by
//! its network proxy thread (the gate, at each frame). Never does I/O on
//! the proxy's path: a gate is two atomic loads.

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use replication::arbiter::{Arbiter, ArbiterError, Gate, LockFileLease};
use replication::etcd::{EtcdLease, EtcdSpec};

use crate::streams::Endpoint;

/// The lease's TTL when none is given, s (etcd's minimum is 2).
pub const DEFAULT_TTL_S: u32 = 3;

/// The arbiter a side opens.
#[derive(Debug, Clone)]
pub enum ArbiterSpec {
    /// The one-host lock file.
    LockFile(PathBuf),
    /// An etcd lease with this TTL.
    Etcd { spec: EtcdSpec, ttl: Duration },
}

impl ArbiterSpec {
    /// From the options: `arbiter` (`etcd:...`), else `lease` (a lock
    /// file), else the default lock file for the secondary's `addr`.
    pub fn from_options(
        arbiter: Option<&str>,
        lease: Option<PathBuf>,
        ttl_s: Option<u32>,
        addr: &Endpoint,
    ) -> Result<ArbiterSpec, String> {
        match arbiter {
            Some(a) => {
                if lease.is_some() {
                    return Err("give either a lease file or an arbiter, not both".into());
                }
                let spec: EtcdSpec = a.parse().map_err(|e: ArbiterError| e.to_string())?;
                let ttl = ttl_s.unwrap_or(DEFAULT_TTL_S);
                Ok(ArbiterSpec::Etcd {
                    spec,
                    ttl: Duration::from_secs(u64::from(ttl)),
                })
            }
            None if ttl_s.is_some() => {
                Err("a lease TTL is for an etcd arbiter (--colo-arbiter etcd:...)".into())
            }
            None => Ok(ArbiterSpec::LockFile(
                lease.unwrap_or_else(|| super::default_lease(addr)),
            )),
        }
    }

    /// Opens it for side `id` (no I/O with etcd yet).
    pub fn open(&self, id: &str) -> Result<Box<dyn Arbiter>, ArbiterError> {
        Ok(match self {
            ArbiterSpec::LockFile(path) => Box::new(LockFileLease::open(path, id)?),
            ArbiterSpec::Etcd { spec, ttl } => {
                let confine = || crate::sandbox::confine(crate::sandbox::Kind::Stream);
                Box::new(EtcdLease::open_with(spec, id, *ttl, confine)?)
            }
        })
    }
}

impl fmt::Display for ArbiterSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArbiterSpec::LockFile(p) => write!(f, "lock file {}", p.display()),
            ArbiterSpec::Etcd { spec, ttl } => write!(f, "{spec} (TTL {} s)", ttl.as_secs()),
        }
    }
}

/// What a side's released output passes: see the module doc.
#[derive(Debug, Clone)]
pub struct Fence {
    lease: Gate,
    peer: Gate,
    /// Set once this side fenced: nothing goes out again.
    shut: Arc<AtomicBool>,
}

impl Fence {
    /// The lease's gate, and a closed peer gate.
    pub fn new(lease: Gate) -> Fence {
        Fence {
            lease,
            peer: Gate::closed(),
            shut: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Whether output may go to the client now.
    pub fn open(&self) -> bool {
        !self.shut.load(Ordering::Acquire) && (self.lease.is_open() || self.peer.is_open())
    }

    /// This side fenced: closed for good, whatever the lease says.
    pub fn shut(&self) {
        self.shut.store(true, Ordering::Release);
    }

    /// The peer answered a message sent at `sent`: it cannot take over
    /// before `sent + timeout`; the peer gate stays open until four fifths
    /// of that.
    pub fn peer_answered(&self, sent: Instant, timeout: Duration) {
        self.peer.open_until(sent + timeout * 4 / 5);
    }

    /// The pair is over: only the lease counts from now on.
    pub fn peer_gone(&self) {
        self.peer.close();
    }
}

/// A fenced side asks who holds the lease: `None` while the arbiter does
/// not answer, else why this side ends (it lost, and never serves again).
pub fn lost(arbiter: &mut dyn Arbiter) -> Option<String> {
    let holder = arbiter.current_holder().ok()?;
    let who = holder.map_or("nobody holds it now".to_string(), |h| {
        format!("{h} holds it")
    });
    Some(format!(
        "this side lost the lease ({}: {who}); it must not serve, and ends",
        arbiter.describe().resource
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr() -> Endpoint {
        "unix:/tmp/x.sock".parse().unwrap()
    }

    #[test]
    fn options_pick_the_arbiter() {
        let a = ArbiterSpec::from_options(None, None, None, &addr()).unwrap();
        assert!(matches!(a, ArbiterSpec::LockFile(p) if p.starts_with("/tmp")));
        let e =
            ArbiterSpec::from_options(Some("etcd:http://127.0.0.1:2379/k"), None, Some(2), &addr())
                .unwrap();
        match e {
            ArbiterSpec::Etcd { spec, ttl } => {
                assert_eq!(spec.key, "/k");
                assert_eq!(ttl, Duration::from_secs(2));
            }
            other => panic!("{other:?}"),
        }
        assert!(ArbiterSpec::from_options(Some("etcd:nothing"), None, None, &addr()).is_err());
        assert!(ArbiterSpec::from_options(None, None, Some(3), &addr()).is_err());
        let both = ArbiterSpec::from_options(
            Some("etcd:http://127.0.0.1:2379/k"),
            Some("/tmp/l".into()),
            None,
            &addr(),
        );
        assert!(both.is_err());
    }

    #[test]
    fn the_peer_gate_opens_for_four_fifths_of_the_timeout() {
        let f = Fence::new(Gate::closed());
        assert!(!f.open());
        f.peer_answered(Instant::now(), Duration::from_secs(10));
        assert!(f.open());
        f.peer_gone();
        assert!(!f.open());
        f.peer_answered(
            Instant::now() - Duration::from_secs(9),
            Duration::from_secs(10),
        );
        assert!(!f.open(), "sent 9 s ago with a 10 s timeout: closed at 8 s");
        let held = Gate::closed();
        held.open_forever();
        let f = Fence::new(held);
        assert!(f.open());
        f.clone().shut();
        assert!(!f.open(), "a fence is shut for every clone");
    }
}

//! Who may serve the client: the lease (design.md §6, Arbiter).
//!
//! Owns the [`Arbiter`] trait, the [`Gate`] a side's output passes, and
//! [`LockFileLease`], the one-host lease (the etcd lease across hosts is
//! [`crate::etcd`]). Called by the VMM thread through [`crate::failover`];
//! it never decides a transition itself, never blocks longer than one
//! bounded call to its store, and never guesses: a call that cannot tell
//! says so with an error.
//!
//! The rule, for every arbiter:
//! - The side that serves the client holds the lease: the primary from
//!   its start, the secondary only after a failover.
//! - The secondary takes over only after it has acquired the lease, so a
//!   cut link with both sides alive never makes two servers: the primary
//!   still holds the lease, and the secondary waits.
//! - Before the primary releases any output without the secondary
//!   (primary-alone), it records that under the lease with
//!   [`Arbiter::mark_alone`]: the epoch from which its output was no
//!   longer covered by the secondary (its last committed checkpoint
//!   epoch + 1, see [`crate::failover`]).
//! - A secondary that acquires the lease and finds an alone mark newer
//!   than its last committed checkpoint epoch must not serve (its state is
//!   behind what the client already saw): it releases the lease and
//!   retires with a clear message. Unavailability is acceptable in a
//!   double fault; serving stale state never is.
//! - A side releases output only while its lease's [`Gate`] is open
//!   ([`Arbiter::gate`]): the gate closes, by itself, before a lease that
//!   cannot be renewed can pass to the other side. The gate is read at
//!   every frame on another thread: an atomic load and a clock read, no
//!   lock, no I/O.
//!
//! [`LockFileLease`]: an exclusive `flock` on a file, which the kernel
//! releases when the holder's process dies. `flock` locks belong to an
//! open file description, so two leases opened separately on one path
//! conflict even inside one process. The alone mark is a file beside the
//! lock (`PATH.alone`, the epoch in decimal), replaced atomically (write a
//! temporary file, fsync, rename, fsync the directory) and written only by
//! the lock holder. The lock file must never be deleted while the pair
//! runs: a new file at the same path would be a second lock; acquiring
//! checks that the path still names the locked file.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde::Serialize;

/// Errors of an arbiter. Each keeps the path, key or endpoint, and the
/// source.
#[derive(Debug, thiserror::Error)]
pub enum ArbiterError {
    #[error("cannot open the lock file {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot lock {path}")]
    Lock {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the lock file {path} was replaced or removed while locking it")]
    Replaced { path: PathBuf },
    #[error("the lease {resource} is not held by this side")]
    NotHeld { resource: String },
    #[error("cannot write the alone mark {path}")]
    WriteMark {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the alone mark {path}")]
    ReadMark {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the alone mark {resource} holds {content:?}, not an epoch")]
    BadMark { resource: String, content: String },
    #[error("cannot read the holder recorded in {path}")]
    ReadHolder {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("etcd: cannot {what}")]
    Etcd {
        what: String,
        #[source]
        source: etcd_client::Error,
    },
    #[error("etcd: no answer within {after:?}: cannot {what}")]
    Timeout { what: String, after: Duration },
    #[error("etcd: unexpected answer: {0}")]
    Protocol(String),
    #[error("bad etcd arbiter: {0}")]
    BadSpec(String),
    #[error("cannot start the etcd client's runtime")]
    Runtime(#[source] io::Error),
}

/// The process-wide base of [`Gate`] deadlines.
fn gate_base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

/// A deadline's encoding: nanoseconds since [`gate_base`], plus one, so
/// that every instant at or before the base is 1 (already past) and 0
/// stays free for "closed". Saturates below [`Gate::FOREVER`].
fn gate_ns(t: Instant) -> u64 {
    let ns = t.saturating_duration_since(gate_base()).as_nanos();
    u64::try_from(ns)
        .unwrap_or(u64::MAX)
        .saturating_add(1)
        .min(Gate::FOREVER - 1)
}

/// Whether a side may release output now: a deadline shared between the
/// thread that renews the lease and the threads that read it at every
/// frame. Cloning is cheap and every clone sees the same deadline.
///
/// Contract: the gate is *closed* (never opened, or [`Gate::close`]d),
/// *open until* an instant (open while now is before it, then *run out*:
/// shut, yet still renewable by the lease's holder), or *open forever*.
#[derive(Clone, Debug)]
pub struct Gate {
    /// 0: closed; [`Gate::FOREVER`]: open forever; else [`gate_ns`] of the
    /// deadline.
    deadline: Arc<AtomicU64>,
}

impl Gate {
    const CLOSED: u64 = 0;
    const FOREVER: u64 = u64::MAX;

    /// A new, closed gate.
    pub fn closed() -> Gate {
        Gate {
            deadline: Arc::new(AtomicU64::new(Self::CLOSED)),
        }
    }

    /// Whether output may be released now (now is before the deadline).
    pub fn is_open(&self) -> bool {
        match self.deadline.load(Ordering::Acquire) {
            Self::CLOSED => false,
            Self::FOREVER => true,
            d => gate_ns(Instant::now()) < d,
        }
    }

    /// Opens the gate until `t` (replacing any deadline, earlier or later;
    /// a `t` already past leaves it shut).
    pub fn open_until(&self, t: Instant) {
        self.deadline.store(gate_ns(t), Ordering::Release);
    }

    /// Opens the gate without a deadline.
    pub fn open_forever(&self) {
        self.deadline.store(Self::FOREVER, Ordering::Release);
    }

    /// Closes the gate.
    pub fn close(&self) {
        self.deadline.store(Self::CLOSED, Ordering::Release);
    }

    /// Moves the deadline later to `t`: never earlier, and never reopens a
    /// closed gate (one that ran out, yes). True if the deadline is now at
    /// or after `t`.
    pub(crate) fn extend_until(&self, t: Instant) -> bool {
        let want = gate_ns(t);
        let res = self
            .deadline
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| {
                (d != Self::CLOSED && d < want).then_some(want)
            });
        match res {
            Ok(_) => true,
            Err(d) => d != Self::CLOSED,
        }
    }

    /// The deadline of a gate opened until an instant, even one already
    /// past (the gate ran out; an instant before the process's first use
    /// of a gate reads as that first use); `None` when closed or open
    /// forever.
    pub fn deadline(&self) -> Option<Instant> {
        match self.deadline.load(Ordering::Acquire) {
            Self::CLOSED | Self::FOREVER => None,
            d => Some(gate_base() + Duration::from_nanos(d - 1)),
        }
    }

    /// How long the gate stays open: zero when closed or run out, `None`
    /// (no limit) when open forever.
    pub fn time_left(&self) -> Option<Duration> {
        match self.deadline.load(Ordering::Acquire) {
            Self::CLOSED => Some(Duration::ZERO),
            Self::FOREVER => None,
            d => Some(Duration::from_nanos(
                d.saturating_sub(gate_ns(Instant::now())),
            )),
        }
    }
}

/// What an arbiter reports for a status request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ArbiterInfo {
    /// `"lock-file"` or `"etcd"`.
    pub kind: &'static str,
    /// The lock file's path, or the etcd lease's spec (endpoints and key).
    pub resource: String,
    /// Whether this side holds the lease.
    pub held: bool,
    /// The identity the holder recorded. Empty when nobody recorded one;
    /// after a holder died it stays until the next holder overwrites it.
    pub holder: Option<String>,
    /// For a lease with a TTL: time left before this side stops serving
    /// unless it renews (its gate; a third of the TTL before the lease
    /// can expire at the store).
    #[serde(rename = "ttl_left_ms", serialize_with = "as_ms")]
    pub ttl_left: Option<Duration>,
}

/// A duration as whole milliseconds (JSON reads it at a glance).
fn as_ms<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        None => s.serialize_none(),
    }
}

/// A lease deciding which side may serve. See the module doc for the rule.
pub trait Arbiter: Send {
    /// Takes the lease if it is free; true if this side holds it now. A
    /// lease held elsewhere is `Ok(false)`, not an error.
    fn try_acquire(&mut self) -> Result<bool, ArbiterError>;
    /// Whether this side holds the lease (a TTL lease turns false before
    /// its TTL can run out when it cannot renew).
    fn holds(&self) -> bool;
    /// Gives the lease up (nothing if not held).
    fn release(&mut self);
    /// Records, under the lease, that the primary released output without
    /// the secondary from checkpoint epoch `epoch` on.
    fn mark_alone(&mut self, epoch: u64) -> Result<(), ArbiterError>;
    /// Removes the alone mark, under the lease (a new pair whose epochs
    /// start again, once its first checkpoint is committed).
    fn clear_alone(&mut self) -> Result<(), ArbiterError>;
    /// The alone mark, if one was recorded.
    fn alone_mark(&self) -> Result<Option<u64>, ArbiterError>;
    /// What to report for a status request.
    fn describe(&self) -> ArbiterInfo;
    /// The gate this side's output passes: open exactly while this side
    /// may release output under the lease. One shared gate for the
    /// arbiter's whole life: a clone taken before acquiring sees every
    /// later change.
    fn gate(&self) -> Gate;
    /// Who holds the lease now, as the store says (the identity the holder
    /// recorded), `None` if nobody; an error if the store cannot tell.
    /// Asks the store (one bounded call): for a fenced side to learn
    /// whether it lost.
    fn current_holder(&mut self) -> Result<Option<String>, ArbiterError>;
}

/// The one-host lease: an exclusive `flock` on a file.
#[derive(Debug)]
pub struct LockFileLease {
    path: PathBuf,
    mark_path: PathBuf,
    file: File,
    identity: String,
    held: bool,
    gate: Gate,
}

impl LockFileLease {
    /// Opens (creating it if needed) the lock file at `path`, without
    /// locking it. `identity` is what this side records as the holder
    /// (e.g. `"primary pid 1234"`).
    pub fn open(path: impl AsRef<Path>, identity: &str) -> Result<Self, ArbiterError> {
        let path = path.as_ref().to_path_buf();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|source| ArbiterError::Open {
                path: path.clone(),
                source,
            })?;
        let mut mark = path.clone().into_os_string();
        mark.push(".alone");
        Ok(LockFileLease {
            path,
            mark_path: PathBuf::from(mark),
            file,
            identity: identity.to_string(),
            held: false,
            gate: Gate::closed(),
        })
    }

    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The alone mark's path (`PATH.alone`).
    pub fn mark_path(&self) -> &Path {
        &self.mark_path
    }

    /// `flock(op)`, retried on EINTR. Ok(false) when it would block.
    fn flock(&self, op: libc::c_int) -> io::Result<bool> {
        loop {
            // SAFETY: flock on a file descriptor this struct owns (open for
            // its whole life); it touches no memory of ours.
            let rc = unsafe { libc::flock(self.file.as_raw_fd(), op) };
            if rc == 0 {
                return Ok(true);
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EWOULDBLOCK) => return Ok(false),
                _ => return Err(err),
            }
        }
    }

    /// Whether `path` still names the file we locked.
    fn same_file(&self) -> io::Result<bool> {
        let ours = self.file.metadata()?;
        match fs::metadata(&self.path) {
            Ok(now) => Ok(now.dev() == ours.dev() && now.ino() == ours.ino()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Records our identity in the lock file (best effort: it is only
    /// reported, never decided on).
    fn record_holder(&self) {
        let line = format!("{}\n", self.identity);
        let res = self
            .file
            .set_len(0)
            .and_then(|()| self.file.write_all_at(line.as_bytes(), 0));
        if let Err(e) = res {
            log::warn!(
                "lease {}: cannot record the holder: {e}",
                self.path.display()
            );
        }
    }

    /// The identity recorded in the lock file, if any.
    fn recorded_holder(&self) -> io::Result<Option<String>> {
        let mut buf = [0u8; 256];
        let n = self.file.read_at(&mut buf, 0)?;
        let text = String::from_utf8_lossy(&buf[..n]).trim().to_string();
        Ok((!text.is_empty()).then_some(text))
    }

    fn not_held(&self) -> ArbiterError {
        ArbiterError::NotHeld {
            resource: self.path.display().to_string(),
        }
    }

    fn write_mark(&self, content: &str) -> io::Result<()> {
        let mut tmp = self.mark_path.clone().into_os_string();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let mut f = File::create(&tmp)?;
        f.write_all(content.as_bytes())?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, &self.mark_path)?;
        self.sync_dir()
    }

    fn sync_dir(&self) -> io::Result<()> {
        let dir = match self.mark_path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        File::open(dir)?.sync_all()
    }
}

impl Arbiter for LockFileLease {
    fn try_acquire(&mut self) -> Result<bool, ArbiterError> {
        if self.held {
            return Ok(true);
        }
        let lock_err = |source| ArbiterError::Lock {
            path: self.path.clone(),
            source,
        };
        if !self
            .flock(libc::LOCK_EX | libc::LOCK_NB)
            .map_err(lock_err)?
        {
            return Ok(false);
        }
        match self.same_file() {
            Ok(true) => {}
            Ok(false) => {
                let _ = self.flock(libc::LOCK_UN);
                return Err(ArbiterError::Replaced {
                    path: self.path.clone(),
                });
            }
            Err(e) => {
                let _ = self.flock(libc::LOCK_UN);
                return Err(lock_err(e));
            }
        }
        self.held = true;
        self.gate.open_forever();
        self.record_holder();
        log::info!(
            "lease {}: acquired by {}",
            self.path.display(),
            self.identity
        );
        Ok(true)
    }

    fn holds(&self) -> bool {
        self.held
    }

    fn release(&mut self) {
        if !self.held {
            return;
        }
        self.gate.close();
        if let Err(e) = self.file.set_len(0) {
            log::warn!(
                "lease {}: cannot clear the holder: {e}",
                self.path.display()
            );
        }
        if let Err(e) = self.flock(libc::LOCK_UN) {
            // Closing the file would release it; keep the state honest.
            log::error!("lease {}: unlock failed: {e}", self.path.display());
        }
        self.held = false;
        log::info!(
            "lease {}: released by {}",
            self.path.display(),
            self.identity
        );
    }

    fn mark_alone(&mut self, epoch: u64) -> Result<(), ArbiterError> {
        if !self.held {
            return Err(self.not_held());
        }
        self.write_mark(&format!("{epoch}\n"))
            .map_err(|source| ArbiterError::WriteMark {
                path: self.mark_path.clone(),
                source,
            })
    }

    fn clear_alone(&mut self) -> Result<(), ArbiterError> {
        if !self.held {
            return Err(self.not_held());
        }
        let res = match fs::remove_file(&self.mark_path) {
            Ok(()) => self.sync_dir(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        };
        res.map_err(|source| ArbiterError::WriteMark {
            path: self.mark_path.clone(),
            source,
        })
    }

    fn alone_mark(&self) -> Result<Option<u64>, ArbiterError> {
        let content = match fs::read_to_string(&self.mark_path) {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(ArbiterError::ReadMark {
                    path: self.mark_path.clone(),
                    source,
                })
            }
        };
        content
            .trim()
            .parse::<u64>()
            .map(Some)
            .map_err(|_| ArbiterError::BadMark {
                resource: self.mark_path.display().to_string(),
                content: content.chars().take(64).collect(),
            })
    }

    fn describe(&self) -> ArbiterInfo {
        let holder = if self.held {
            Some(self.identity.clone())
        } else {
            self.recorded_holder().ok().flatten()
        };
        ArbiterInfo {
            kind: "lock-file",
            resource: self.path.display().to_string(),
            held: self.held,
            holder,
            ttl_left: None,
        }
    }

    fn gate(&self) -> Gate {
        self.gate.clone()
    }

    fn current_holder(&mut self) -> Result<Option<String>, ArbiterError> {
        if self.held {
            return Ok(Some(self.identity.clone()));
        }
        let locked = self
            .flock(libc::LOCK_EX | libc::LOCK_NB)
            .map_err(|source| ArbiterError::Lock {
                path: self.path.clone(),
                source,
            })?;
        if locked {
            // Free: give it back at once, we only looked.
            if let Err(e) = self.flock(libc::LOCK_UN) {
                log::error!("lease {}: unlock failed: {e}", self.path.display());
            }
            return Ok(None);
        }
        let holder = self
            .recorded_holder()
            .map_err(|source| ArbiterError::ReadHolder {
                path: self.path.clone(),
                source,
            })?;
        Ok(Some(holder.unwrap_or_else(|| "unknown".to_string())))
    }
}

impl Drop for LockFileLease {
    /// Closing the file releases the lock: close the gate with it.
    fn drop(&mut self) {
        self.gate.close();
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A fresh directory under the system temp dir, removed on drop.
    pub(crate) struct TempDir(pub PathBuf);

    impl TempDir {
        pub(crate) fn new(tag: &str) -> Self {
            static N: AtomicU32 = AtomicU32::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!(
                "tandem-replication-{tag}-{}-{n}",
                std::process::id()
            ));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn two_opens_conflict_in_one_process() {
        let dir = TempDir::new("lease");
        let path = dir.0.join("lease");
        let mut a = LockFileLease::open(&path, "a").unwrap();
        let mut b = LockFileLease::open(&path, "b").unwrap();
        assert!(a.try_acquire().unwrap());
        assert!(a.holds());
        assert!(a.try_acquire().unwrap(), "idempotent while held");
        assert!(!b.try_acquire().unwrap());
        assert!(!b.holds());
        assert_eq!(b.describe().holder.as_deref(), Some("a"));
        a.release();
        assert!(!a.holds());
        assert!(b.try_acquire().unwrap());
        assert!(!a.try_acquire().unwrap());
        assert_eq!(a.describe().holder.as_deref(), Some("b"));
    }

    #[test]
    fn drop_releases_like_a_dying_holder() {
        let dir = TempDir::new("lease-drop");
        let path = dir.0.join("lease");
        let mut a = LockFileLease::open(&path, "a").unwrap();
        let mut b = LockFileLease::open(&path, "b").unwrap();
        assert!(a.try_acquire().unwrap());
        assert!(!b.try_acquire().unwrap());
        drop(a);
        assert!(b.try_acquire().unwrap());
        let info = b.describe();
        assert_eq!(info.kind, "lock-file");
        assert!(info.held);
        assert_eq!(info.ttl_left, None);
    }

    #[test]
    fn alone_mark_written_only_under_the_lease() {
        let dir = TempDir::new("lease-mark");
        let path = dir.0.join("lease");
        let mut a = LockFileLease::open(&path, "a").unwrap();
        let b = LockFileLease::open(&path, "b").unwrap();
        assert_eq!(b.alone_mark().unwrap(), None);
        assert!(matches!(a.mark_alone(3), Err(ArbiterError::NotHeld { .. })));
        assert!(a.try_acquire().unwrap());
        a.mark_alone(7).unwrap();
        assert_eq!(b.alone_mark().unwrap(), Some(7));
        assert_eq!(fs::read_to_string(b.mark_path()).unwrap(), "7\n");
        a.mark_alone(9).unwrap();
        assert_eq!(a.alone_mark().unwrap(), Some(9));
        a.clear_alone().unwrap();
        a.clear_alone().unwrap();
        assert_eq!(b.alone_mark().unwrap(), None);
        let leftovers: Vec<_> = fs::read_dir(&dir.0).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temporary file left behind");
    }

    #[test]
    fn a_damaged_mark_is_an_error_not_a_guess() {
        let dir = TempDir::new("lease-bad");
        let path = dir.0.join("lease");
        let a = LockFileLease::open(&path, "a").unwrap();
        fs::write(a.mark_path(), "seven").unwrap();
        assert!(matches!(a.alone_mark(), Err(ArbiterError::BadMark { .. })));
    }

    #[test]
    fn a_replaced_lock_file_is_refused() {
        let dir = TempDir::new("lease-replaced");
        let path = dir.0.join("lease");
        let mut a = LockFileLease::open(&path, "a").unwrap();
        fs::remove_file(&path).unwrap();
        assert!(matches!(
            a.try_acquire(),
            Err(ArbiterError::Replaced { .. })
        ));
        assert!(!a.holds());
    }

    #[test]
    fn a_gate_opens_until_its_deadline() {
        let g = Gate::closed();
        assert!(!g.is_open());
        assert_eq!(g.deadline(), None);
        assert_eq!(g.time_left(), Some(Duration::ZERO));
        let t = Instant::now() + Duration::from_secs(60);
        g.open_until(t);
        assert!(g.is_open());
        let d = g.deadline().unwrap();
        assert!(d <= t && t - d < Duration::from_micros(1), "{d:?} vs {t:?}");
        let left = g.time_left().unwrap();
        assert!(left > Duration::from_secs(59) && left <= Duration::from_secs(60));
        g.open_until(Instant::now() + Duration::from_millis(30));
        assert!(g.is_open(), "open_until moves a deadline earlier too");
        std::thread::sleep(Duration::from_millis(40));
        assert!(!g.is_open(), "ran out");
        assert!(g.deadline().is_some(), "a run-out gate keeps its deadline");
        assert_eq!(g.time_left(), Some(Duration::ZERO));
        g.open_until(Instant::now() - Duration::from_secs(1));
        assert!(!g.is_open(), "a deadline in the past leaves it shut");
    }

    #[test]
    fn a_gate_open_forever_and_closed_again() {
        let g = Gate::closed();
        let seen = g.clone();
        g.open_forever();
        assert!(seen.is_open(), "clones share the deadline");
        assert_eq!(seen.deadline(), None);
        assert_eq!(seen.time_left(), None);
        g.close();
        assert!(!seen.is_open());
        // An instant before the process-wide base is past, not closed.
        let early = Instant::now().checked_sub(Duration::from_secs(3600));
        if let Some(early) = early {
            g.open_until(early);
            assert!(!g.is_open());
        }
    }

    #[test]
    fn extending_a_gate_never_moves_it_back_nor_reopens_it() {
        let g = Gate::closed();
        let soon = Instant::now() + Duration::from_secs(10);
        assert!(!g.extend_until(soon), "a closed gate stays closed");
        assert!(!g.is_open());
        g.open_until(soon);
        assert!(g.extend_until(soon - Duration::from_secs(5)));
        assert_eq!(g.deadline(), Some(soon), "never backwards");
        let later = soon + Duration::from_secs(5);
        assert!(g.extend_until(later));
        assert!(g.deadline().unwrap() > soon);
        g.open_until(Instant::now() - Duration::from_millis(1));
        assert!(!g.is_open());
        assert!(g.extend_until(later), "a run-out gate may be renewed");
        assert!(g.is_open());
        g.open_forever();
        assert!(g.extend_until(later));
        assert_eq!(g.time_left(), None, "forever stays forever");
    }

    #[test]
    fn the_lock_file_gate_follows_the_lock() {
        let dir = TempDir::new("lease-gate");
        let path = dir.0.join("lease");
        let mut a = LockFileLease::open(&path, "a").unwrap();
        let mut b = LockFileLease::open(&path, "b").unwrap();
        let gate = a.gate();
        assert!(!gate.is_open(), "closed before the first acquire");
        assert!(a.try_acquire().unwrap());
        assert!(gate.is_open(), "a clone taken before sees the acquire");
        assert_eq!(gate.time_left(), None);
        assert!(!b.try_acquire().unwrap());
        assert!(!b.gate().is_open());
        a.release();
        assert!(!gate.is_open());
        assert!(a.try_acquire().unwrap());
        assert!(gate.is_open());
        drop(a);
        assert!(!gate.is_open(), "dropping the lease closes its gate");
        assert!(b.try_acquire().unwrap());
        assert!(b.gate().is_open());
    }

    #[test]
    fn the_lock_file_tells_its_current_holder() {
        let dir = TempDir::new("lease-holder");
        let path = dir.0.join("lease");
        let mut a = LockFileLease::open(&path, "primary pid 1").unwrap();
        let mut b = LockFileLease::open(&path, "secondary pid 2").unwrap();
        assert_eq!(b.current_holder().unwrap(), None);
        assert!(a.try_acquire().unwrap(), "looking left it free");
        assert_eq!(
            a.current_holder().unwrap().as_deref(),
            Some("primary pid 1")
        );
        assert_eq!(
            b.current_holder().unwrap().as_deref(),
            Some("primary pid 1")
        );
        a.file.set_len(0).unwrap();
        assert_eq!(b.current_holder().unwrap().as_deref(), Some("unknown"));
        a.release();
        assert_eq!(b.current_holder().unwrap(), None);
        assert!(b.try_acquire().unwrap());
        assert_eq!(
            a.current_holder().unwrap().as_deref(),
            Some("secondary pid 2")
        );
    }

    #[test]
    fn open_fails_cleanly() {
        let dir = TempDir::new("lease-open");
        let path = dir.0.join("missing").join("lease");
        assert!(matches!(
            LockFileLease::open(&path, "a"),
            Err(ArbiterError::Open { .. })
        ));
    }
}

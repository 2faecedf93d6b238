//! Who may serve the client: the lease (design.md §6, Arbiter).
//!
//! Owns the [`Arbiter`] trait and [`LockFileLease`], the one-host lease.
//! Called by the VMM thread through [`crate::failover`]; it never decides
//! a transition itself, never blocks (every call is non-blocking), and
//! never guesses: a call that cannot tell says so with an error.
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
use std::time::Duration;

use serde::Serialize;

/// Errors of an arbiter. Each keeps the path and the source.
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
    #[error("the lease {path} is not held by this side")]
    NotHeld { path: PathBuf },
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
    #[error("the alone mark {path} holds {content:?}, not an epoch")]
    BadMark { path: PathBuf, content: String },
}

/// What an arbiter reports for a status request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ArbiterInfo {
    /// `"lock-file"`, later `"etcd"`.
    pub kind: &'static str,
    /// The lock file's path or the lease's key.
    pub resource: String,
    /// Whether this side holds the lease.
    pub held: bool,
    /// The identity the holder recorded. Empty when nobody recorded one;
    /// after a holder died it stays until the next holder overwrites it.
    pub holder: Option<String>,
    /// Time left before the lease expires, for a lease with a TTL.
    pub ttl_left: Option<Duration>,
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
}

/// The one-host lease: an exclusive `flock` on a file.
#[derive(Debug)]
pub struct LockFileLease {
    path: PathBuf,
    mark_path: PathBuf,
    file: File,
    identity: String,
    held: bool,
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
            return Err(ArbiterError::NotHeld {
                path: self.path.clone(),
            });
        }
        self.write_mark(&format!("{epoch}\n"))
            .map_err(|source| ArbiterError::WriteMark {
                path: self.mark_path.clone(),
                source,
            })
    }

    fn clear_alone(&mut self) -> Result<(), ArbiterError> {
        if !self.held {
            return Err(ArbiterError::NotHeld {
                path: self.path.clone(),
            });
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
                path: self.mark_path.clone(),
                content: content.chars().take(64).collect(),
            })
    }

    fn describe(&self) -> ArbiterInfo {
        let holder = if self.held {
            Some(self.identity.clone())
        } else {
            let mut buf = [0u8; 256];
            let n = self.file.read_at(&mut buf, 0).unwrap_or(0);
            let text = String::from_utf8_lossy(&buf[..n]).trim().to_string();
            (!text.is_empty()).then_some(text)
        };
        ArbiterInfo {
            kind: "lock-file",
            resource: self.path.display().to_string(),
            held: self.held,
            holder,
            ttl_left: None,
        }
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
    fn open_fails_cleanly() {
        let dir = TempDir::new("lease-open");
        let path = dir.0.join("missing").join("lease");
        assert!(matches!(
            LockFileLease::open(&path, "a"),
            Err(ArbiterError::Open { .. })
        ));
    }
}

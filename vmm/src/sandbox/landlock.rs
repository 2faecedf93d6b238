//! Landlock: the files a VM may open. After this the process (the calling
//! thread and every thread it starts later) may open only beneath the
//! paths of the rules it is given, read-only or read-write; the rest of
//! the filesystem answers EACCES. A kernel without Landlock is said once
//! by the caller, not an error.
//!
//! Runs once, on the main thread, before it starts any other thread
//! (Landlock confines the calling thread and its later children only).
//! Never does: decide which paths a VM needs (the CLI does, from its
//! options); fail a start because a rule's path does not exist (an absent
//! path cannot be opened anyway, and its user gets the open's own error).

use std::path::PathBuf;

use landlock::{
    Access, AccessFs, BitFlags, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr,
    RulesetError, RulesetStatus, ABI,
};

/// The Landlock rights handled: those of ABI 3 (files, directories,
/// renames across directories, truncation). Device ioctls (ABI 5) are left
/// to the seccomp filters.
const HANDLED: ABI = ABI::V3;

/// What a rule allows beneath its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsAccess {
    /// Read files, list directories (and map libraries executable).
    Read,
    /// Everything: read, write, make and remove files and sockets.
    ReadWrite,
    /// In a directory: make and remove sockets only (an API socket's or a
    /// unix listener's directory).
    Sockets,
    /// In a directory: make, write, replace and remove files, not read
    /// them (outputs written through `F.tmp` and a rename: metrics, a
    /// guest profile).
    Outputs,
}

/// One rule: `access` beneath `path` (the file itself, or everything in a
/// directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsRule {
    pub path: PathBuf,
    pub access: FsAccess,
}

/// Whether Landlock confines the process (`--landlock`).
#[derive(clap::ValueEnum, serde::Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Switch {
    /// Where the kernel has Landlock.
    #[default]
    On,
    Off,
}

/// A `PATH:r|rw` rule that does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("'{0}': expected PATH:r or PATH:rw (e.g. /srv/snapshots:rw)")]
pub struct BadRule(pub String);

impl std::str::FromStr for FsRule {
    type Err = BadRule;

    /// `PATH:r` or `PATH:rw` (the last colon splits, so a path may hold
    /// colons); a relative path is from the current directory.
    fn from_str(s: &str) -> Result<Self, BadRule> {
        let bad = || BadRule(s.to_string());
        let (path, access) = s.rsplit_once(':').ok_or_else(bad)?;
        let access = match access {
            "r" => FsAccess::Read,
            "rw" => FsAccess::ReadWrite,
            _ => return Err(bad()),
        };
        if path.is_empty() {
            return Err(bad());
        }
        let path = std::path::absolute(path).map_err(|_| bad())?;
        Ok(FsRule { path, access })
    }
}

/// How far the kernel enforces the rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enforced {
    Fully,
    /// An older Landlock: some of [`HANDLED`]'s rights are not restricted.
    Partly,
    /// This kernel has no Landlock (or it is disabled).
    No,
}

/// Whether [`restrict`] confined this process (for error messages).
static ACTIVE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether Landlock confines this process's files.
pub fn active() -> bool {
    ACTIVE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Confines the process's files to `rules` (see the module doc).
pub fn restrict(rules: &[FsRule]) -> Result<Enforced, RulesetError> {
    let all = AccessFs::from_all(HANDLED);
    let mut ruleset = Ruleset::default().handle_access(all)?.create()?;
    for rule in rules {
        // An absent path is skipped: nothing there to open.
        let Ok(fd) = PathFd::new(&rule.path) else {
            continue;
        };
        ruleset = ruleset.add_rule(PathBeneath::new(fd, rights(rule)))?;
    }
    let status = ruleset.restrict_self()?;
    let enforced = status.ruleset != RulesetStatus::NotEnforced;
    ACTIVE.store(enforced, std::sync::atomic::Ordering::Relaxed);
    Ok(match status.ruleset {
        RulesetStatus::FullyEnforced => Enforced::Fully,
        RulesetStatus::PartiallyEnforced => Enforced::Partly,
        RulesetStatus::NotEnforced => Enforced::No,
    })
}

/// The rights of `rule`: those of its access, only the ones a file can
/// have when its path is not a directory.
fn rights(rule: &FsRule) -> BitFlags<AccessFs> {
    let asked = match rule.access {
        FsAccess::Read => AccessFs::from_read(HANDLED),
        FsAccess::ReadWrite => AccessFs::from_all(HANDLED),
        FsAccess::Sockets => AccessFs::MakeSock | AccessFs::RemoveFile,
        FsAccess::Outputs => {
            AccessFs::MakeReg | AccessFs::WriteFile | AccessFs::Truncate | AccessFs::RemoveFile
        }
    };
    if rule.path.is_dir() {
        asked
    } else {
        asked & AccessFs::from_file(HANDLED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;

    #[test]
    fn rules_parse_path_and_access() {
        let r: FsRule = "/srv/a:b:rw".parse().unwrap();
        assert_eq!(r.path, PathBuf::from("/srv/a:b"));
        assert_eq!(r.access, FsAccess::ReadWrite);
        let r: FsRule = "/srv:r".parse().unwrap();
        assert_eq!(r.access, FsAccess::Read);
        for bad in ["/srv", "/srv:w", ":rw", "/srv:RW", ""] {
            assert!(bad.parse::<FsRule>().is_err(), "{bad}");
        }
    }

    /// In a thread of its own (Landlock stays with the thread): only what
    /// the rules allow can be opened, the rest is refused.
    #[test]
    fn only_the_ruled_paths_open() {
        let dir = std::env::temp_dir().join(format!("tandem-landlock-{}", std::process::id()));
        let (allowed, readonly, other) = (dir.join("rw"), dir.join("ro"), dir.join("other"));
        for d in [&allowed, &readonly, &other] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("f"), b"x").unwrap();
        }
        let rules = vec![
            FsRule {
                path: allowed.clone(),
                access: FsAccess::ReadWrite,
            },
            FsRule {
                path: readonly.clone(),
                access: FsAccess::Read,
            },
            FsRule {
                path: dir.join("absent"),
                access: FsAccess::Read,
            },
        ];
        let (a, r, o) = (allowed.clone(), readonly.clone(), other.clone());
        let result = std::thread::spawn(move || {
            let enforced = restrict(&rules).unwrap();
            let write_rw = std::fs::write(a.join("new"), b"y").map_err(|e| e.kind());
            let read_ro = std::fs::read(r.join("f")).map_err(|e| e.kind());
            let write_ro = std::fs::write(r.join("f"), b"z").map_err(|e| e.kind());
            let read_other = std::fs::read(o.join("f")).map_err(|e| e.kind());
            (enforced, write_rw, read_ro, write_ro, read_other)
        })
        .join()
        .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            result.0,
            Enforced::Fully,
            "this kernel's Landlock does not enforce ABI 3 (Linux 6.2)"
        );
        assert_eq!(result.1, Ok(()));
        assert_eq!(result.2, Ok(b"x".to_vec()));
        assert_eq!(result.3, Err(ErrorKind::PermissionDenied));
        assert_eq!(result.4, Err(ErrorKind::PermissionDenied));
    }

    /// A sockets directory takes a bound socket, not a file; an outputs
    /// directory takes a file written through a rename, and is not read.
    #[test]
    fn sockets_and_outputs_directories_take_only_their_own() {
        let dir = std::env::temp_dir().join(format!("tandem-landlock-so-{}", std::process::id()));
        let (socks, outs) = (dir.join("socks"), dir.join("outs"));
        for d in [&socks, &outs] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(outs.join("old"), b"secret").unwrap();
        let rules = vec![
            FsRule {
                path: socks.clone(),
                access: FsAccess::Sockets,
            },
            FsRule {
                path: outs.clone(),
                access: FsAccess::Outputs,
            },
        ];
        let (s, o) = (socks.clone(), outs.clone());
        let result = std::thread::spawn(move || {
            restrict(&rules).unwrap();
            let bind = std::os::unix::net::UnixListener::bind(s.join("api.sock"))
                .map(drop)
                .map_err(|e| e.kind());
            let unlink = std::fs::remove_file(s.join("api.sock")).map_err(|e| e.kind());
            let file_in_socks = std::fs::write(s.join("f"), b"x").map_err(|e| e.kind());
            let output = std::fs::write(o.join("m.tmp"), b"{}")
                .and_then(|()| std::fs::rename(o.join("m.tmp"), o.join("m.json")))
                .map_err(|e| e.kind());
            let read_outs = std::fs::read(o.join("old")).map_err(|e| e.kind());
            (bind, unlink, file_in_socks, output, read_outs)
        })
        .join()
        .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(result.0, Ok(()));
        assert_eq!(result.1, Ok(()));
        assert_eq!(result.2, Err(ErrorKind::PermissionDenied));
        assert_eq!(result.3, Ok(()));
        assert_eq!(result.4, Err(ErrorKind::PermissionDenied));
    }
}

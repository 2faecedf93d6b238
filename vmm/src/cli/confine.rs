//! `tandem run`'s confinement at start: Landlock on what this VM may open
//! ([`fs_rules`], from its options), then the seccomp filters (Landlock
//! first: its own system calls are not in the VMM thread's list).
//!
//! Runs on the main thread once its options are read, before it opens a
//! kernel, disk, tap or socket and before any other thread exists. Never
//! does: allow a path that no option names, beyond the system's read-only
//! directories, the devices a VM needs and the default COLO leases'
//! directory.

use std::path::{Path, PathBuf};

use super::run_args::RunArgs;
use crate::config;
use crate::sandbox::landlock::{self, Enforced, FsAccess, FsRule, Switch};
use crate::streams::Endpoint;

/// Why the process could not be confined.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("Landlock: {0} (--landlock off runs without it)")]
    Landlock(#[source] ::landlock::RulesetError),
    #[error(transparent)]
    Seccomp(#[from] crate::sandbox::SandboxError),
}

/// Read-only system directories: the resolver's and libraries' files (an
/// etcd client may resolve names), /proc and /sys (memory size, CPU
/// count).
const SYSTEM_READ: &[&str] = &["/etc", "/usr", "/lib", "/lib64", "/proc", "/sys"];

/// Devices a VM opens after start: KVM, taps (also a COLO takeover's), the
/// null device.
const DEVICES_RW: &[&str] = &["/dev/kvm", "/dev/net/tun", "/dev/null"];

/// Confines this process as `args` ask (Landlock, then seccomp).
pub fn start(args: &RunArgs) -> Result<(), ConfineError> {
    if may_pair(args) {
        crate::colo::make_lease_dir();
    }
    if args.landlock.unwrap_or_default() == Switch::On {
        for r in args.landlock_rules.iter().filter(|r| !r.path.exists()) {
            log::warn!(
                "Landlock: --landlock-rule {}: no such file or directory, so nothing there \
                 may be opened (make it before starting tandem)",
                r.path.display()
            );
        }
        match landlock::restrict(&fs_rules(args)).map_err(ConfineError::Landlock)? {
            Enforced::Fully => {}
            Enforced::Partly => log::info!("Landlock: this kernel enforces part of the rules"),
            Enforced::No => log::warn!(
                "Landlock: this kernel does not have it: the files tandem may open are not \
                 confined (docs/sandbox.md)"
            ),
        }
    }
    crate::sandbox::start(args.seccomp.unwrap_or_default())?;
    Ok(())
}

/// What this VM may open: see `tandem run --help`'s `--landlock`.
pub fn fs_rules(args: &RunArgs) -> Vec<FsRule> {
    let mut rules = Vec::new();
    let mut add = |path: &Path, access| {
        rules.push(FsRule {
            path: super::absolute(path),
            access,
        })
    };
    for p in SYSTEM_READ {
        add(Path::new(p), FsAccess::Read);
    }
    for p in DEVICES_RW {
        add(Path::new(p), FsAccess::ReadWrite);
    }
    for p in read_only(args) {
        add(&p, FsAccess::Read);
    }
    for d in &args.disks {
        let access = if d.readonly {
            FsAccess::Read
        } else {
            FsAccess::ReadWrite
        };
        add(&d.path, access);
    }
    for p in sockets(args) {
        add(&parent(&p), FsAccess::Sockets);
    }
    for p in outputs(args) {
        add(&parent(&p), FsAccess::Outputs);
    }
    if may_pair(args) {
        add(Path::new(crate::colo::LEASE_DIR), FsAccess::ReadWrite);
    }
    if let Some(p) = &args.colo_lease {
        add(&parent(p), FsAccess::ReadWrite);
    }
    rules.extend(args.landlock_rules.iter().cloned());
    rules
}

/// The files this VM reads: boot files, a snapshot, TLS files, its config.
fn read_only(args: &RunArgs) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = [
        &args.kernel,
        &args.initrd,
        &args.firmware,
        &args.guest_symbols,
        &args.restore,
        &args.config,
        &args.tls_cert,
        &args.tls_key,
        &args.tls_ca,
    ]
    .into_iter()
    .flatten()
    .cloned()
    .collect();
    if args.kernel.is_none() && args.firmware.is_none() {
        paths.push(config::default_guest_dir());
    }
    paths
}

/// The sockets this VM binds (in their directories it may make and
/// remove sockets, nothing else): the API socket, a unix: listener.
fn sockets(args: &RunArgs) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = args.api_sock.iter().cloned().collect();
    for ep in [&args.incoming, &args.colo_listen].into_iter().flatten() {
        if let Endpoint::Unix(p) = ep {
            paths.push(p.clone());
        }
    }
    paths
}

/// The files this VM writes through `F.tmp` and a rename (in their
/// directories it may make, write and replace files, not read them):
/// metrics, the guest profile.
fn outputs(args: &RunArgs) -> Vec<PathBuf> {
    [&args.metrics, &args.guest_profile]
        .into_iter()
        .flatten()
        .cloned()
        .collect()
}

/// Whether this VM may be a side of a COLO pair (a secondary, or a VM
/// with an API that `colo-start` can make a primary): then it may read and
/// write the default leases' directory (a lease keeps an "alone" mark
/// beside its lock, written through a rename).
fn may_pair(args: &RunArgs) -> bool {
    args.colo.is_some() || args.api_sock.is_some()
}

/// The directory `path` is in (the current one for a bare name).
fn parent(path: &Path) -> PathBuf {
    let path = super::absolute(path);
    path.parent().map_or(path.clone(), Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        run: RunArgs,
    }

    fn rules_of(argv: &[&str]) -> Vec<FsRule> {
        let mut all = vec!["tandem"];
        all.extend_from_slice(argv);
        fs_rules(&Wrap::parse_from(all).run)
    }

    fn has(rules: &[FsRule], path: &str, access: FsAccess) -> bool {
        rules
            .iter()
            .any(|r| r.path == Path::new(path) && r.access == access)
    }

    #[test]
    fn a_vms_paths_are_its_rules() {
        let rules = rules_of(&[
            "--kernel",
            "/k/vmlinux",
            "--disk",
            "path=/d/a.img",
            "--disk",
            "path=/d/b.img,readonly=on",
            "--api-sock",
            "/run/vm/api.sock",
            "--metrics",
            "/var/lib/vm/metrics.json",
            "--landlock-rule",
            "/srv/snaps:rw",
        ]);
        assert!(has(&rules, "/k/vmlinux", FsAccess::Read));
        assert!(has(&rules, "/d/a.img", FsAccess::ReadWrite));
        assert!(has(&rules, "/d/b.img", FsAccess::Read));
        assert!(has(&rules, "/run/vm", FsAccess::Sockets));
        assert!(has(&rules, "/var/lib/vm", FsAccess::Outputs));
        assert!(has(&rules, "/srv/snaps", FsAccess::ReadWrite));
        assert!(has(&rules, "/dev/kvm", FsAccess::ReadWrite));
        assert!(has(&rules, "/etc", FsAccess::Read));
        // Nothing else is writable: the API socket's and the metrics'
        // directories only take what tandem makes there.
        let writable: Vec<_> = rules
            .iter()
            .filter(|r| r.access == FsAccess::ReadWrite)
            .map(|r| r.path.display().to_string())
            .collect();
        assert_eq!(
            writable,
            [
                "/dev/kvm",
                "/dev/net/tun",
                "/dev/null",
                "/d/a.img",
                "/tmp/tandem-colo",
                "/srv/snaps"
            ]
        );
    }

    #[test]
    fn a_secondary_may_make_its_lease_and_listener() {
        let rules = rules_of(&[
            "--colo",
            "secondary",
            "--colo-listen",
            "unix:/run/pair/listen.sock",
            "--colo-lease",
            "/var/lock/pair.lock",
        ]);
        assert!(has(&rules, "/run/pair", FsAccess::Sockets));
        assert!(has(&rules, crate::colo::LEASE_DIR, FsAccess::ReadWrite));
        assert!(has(&rules, "/var/lock", FsAccess::ReadWrite));
    }
}

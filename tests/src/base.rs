//! The base snapshot: the default guest booted once per test run, paused
//! and snapshotted, so that tests which are not about booting start from a
//! restore (about a second) instead of a boot (30-40 s on hosts whose KVM
//! emulates the guest kernel, see docs/host-kvm.md).
//!
//! The base guest: the default kernel and initramfs, 128 MiB, 1 vCPU,
//! [`CMDLINE`] (kvm-clock, eth0 and eth1 configured and up), two NICs
//! (net0 `rsc=off` with [`MAC0`], net1 `rsc=on` with [`MAC1`]) and one
//! read-write disk (a [`DISK_BYTES`] ext4 image with id [`DISK_ID`], not
//! mounted), its console quiet (`dmesg -n 1`: a kernel message would land in
//! the middle of a command's output). It boots in a namespace of its own on
//! bare taps that carry no traffic, so a restored guest holds no neighbour
//! entries of that host side.
//!
//! The SMP base guest ([`base_smp`], [`TestVm::restore_base_smp`]): the
//! same guest with [`SMP_CPUS`] vCPUs, made the same way, once per run on
//! first use, in a directory of its own: `smp` under `TANDEM_TEST_BASE`,
//! or `target/test-base-smp/KEY` without it (its KEY hashes `--cpus` too).
//!
//! Sharing: test.sh exports `TANDEM_TEST_BASE`, a directory of its own per
//! run, removed at exit. The first test (of any test binary, on any thread)
//! that asks for the base creates it there under an exclusive `flock` on
//! `DIR/lock`; the others wait on the lock and reuse it. Without the
//! variable (`cargo test` run directly) the directory is
//! `target/test-base/KEY`, KEY a hash of the tandem binary, the guest files
//! and the recipe, so a snapshot made by another binary or another guest is
//! never restored; the directories of other keys are removed when a new base
//! is made.
//!
//! Never here: traffic on the base's host side, or a second boot after a
//! failed one in the same run (the failure is recorded and every later
//! caller fails with it).

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Instant;

use sha2::{Digest, Sha256};

use crate::netns::NetNs;
use crate::{ctl, guest_file, hex, tandem_bin, TestVm};

/// The base guest's kernel command line.
pub const CMDLINE: &str = "console=ttyS0 reboot=k panic=1 clocksource=kvm-clock \
                           tandem.ip=192.0.2.2/24 tandem.ip1=198.51.100.2/24";
/// eth0 (net0, `rsc=off`): MAC, guest address, the host side's address.
pub const MAC0: &str = "52:54:00:00:00:a1";
pub const GUEST_IP0: &str = "192.0.2.2";
pub const HOST_IP0: &str = "192.0.2.1";
/// eth1 (net1, `rsc=on`): MAC, guest address, the host side's address.
pub const MAC1: &str = "52:54:00:00:00:b2";
pub const GUEST_IP1: &str = "198.51.100.2";
pub const HOST_IP1: &str = "198.51.100.1";
/// The prefix length of both guest networks.
pub const PREFIX: u8 = 24;
/// The disk (vda): size, and the id the guest reads as its serial.
pub const DISK_BYTES: u64 = 16 << 20;
pub const DISK_ID: &str = "tandem-base";

/// net0 and net1: MAC and `rsc=`, what a restore must repeat.
const NICS: [(&str, &str); 2] = [(MAC0, "off"), (MAC1, "on")];

/// The `--net` argument of NIC `i` on `tap` (which may carry options a
/// restore may change, e.g. `tap1,sndbuf=64K`).
fn net_arg(i: usize, tap: &str) -> String {
    let (mac, rsc) = NICS[i];
    format!("tap={tap},mac={mac},rsc={rsc}")
}

/// The base snapshot and the disk as it was when the snapshot was taken.
#[derive(Clone, Debug)]
pub struct Base {
    pub snapshot: PathBuf,
    /// Never given to a VM: restores get a copy ([`TestVm::restore_base`]).
    pub disk: PathBuf,
}

/// The vCPU count of the SMP base guest ([`base_smp`]).
pub const SMP_CPUS: u32 = 2;

/// A base slot of this process: empty until its first caller made (or
/// found) the base, then the base or why there is none.
type Slot = Mutex<Option<Result<Base, String>>>;

/// The base of this run (1 vCPU), created by the first caller.
pub fn base() -> Base {
    static BASE: Slot = Mutex::new(None);
    base_in(&BASE, 1)
}

/// The SMP base of this run ([`SMP_CPUS`] vCPUs, otherwise the base
/// guest), created by its first caller.
pub fn base_smp() -> Base {
    static BASE_SMP: Slot = Mutex::new(None);
    base_in(&BASE_SMP, SMP_CPUS)
}

fn base_in(slot: &Slot, cpus: u32) -> Base {
    // One creator per process; other processes wait on the file lock.
    let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        let dir = base_dir(cpus);
        let r = std::panic::catch_unwind(|| shared_base(&dir.0, dir.1, cpus)).map_err(panic_text);
        *slot = Some(r);
    }
    match slot.as_ref().unwrap() {
        Ok(b) => b.clone(),
        Err(e) => panic!("no base snapshot ({cpus} vCPU): {e}"),
    }
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "base creation panicked".into())
}

/// The directory of the base with `cpus` vCPUs and whether it belongs to
/// this run only (then a failure is recorded there for the run's later
/// callers). The SMP base's is apart from the 1-vCPU base's, so that
/// neither prunes the other ([`prune_other_keys`]).
fn base_dir(cpus: u32) -> (PathBuf, bool) {
    let smp = cpus != 1;
    if let Some(d) = std::env::var_os("TANDEM_TEST_BASE") {
        let d = PathBuf::from(d);
        return (if smp { d.join("smp") } else { d }, true);
    }
    let mut h = Sha256::new();
    // The recipe: the boot arguments, and the disk's size.
    for arg in boot_args(Path::new("DISK"), Path::new("SOCK"), cpus) {
        h.update(arg);
        h.update([0]);
    }
    h.update(DISK_BYTES.to_le_bytes());
    h.update(QUIET_CONSOLE);
    for f in [
        tandem_bin(),
        guest_file("vmlinux"),
        guest_file("initramfs.cpio"),
    ] {
        let mut file = File::open(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = file.read(&mut buf).expect("read for the base key");
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    let key = hex(&h.finalize()[..8]);
    let parent = if smp { "test-base-smp" } else { "test-base" };
    (target_dir().join(parent).join(key), false)
}

/// target/ (the parent of the profile directory holding tandem).
fn target_dir() -> PathBuf {
    let bin = tandem_bin();
    bin.parent()
        .and_then(Path::parent)
        .expect("target directory")
        .to_path_buf()
}

/// An exclusive `flock` on `DIR/lock`, held while the file is open.
struct DirLock {
    _file: File,
}

impl DirLock {
    fn take(dir: &Path, wait: bool) -> Option<DirLock> {
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("lock"))
            .unwrap_or_else(|e| panic!("{}/lock: {e}", dir.display()));
        let op = if wait {
            libc::LOCK_EX
        } else {
            libc::LOCK_EX | libc::LOCK_NB
        };
        // SAFETY: flock on a descriptor we own; no memory is involved.
        let r = unsafe { libc::flock(f.as_raw_fd(), op) };
        if r == 0 {
            Some(DirLock { _file: f })
        } else if wait {
            panic!(
                "flock {}/lock: {}",
                dir.display(),
                std::io::Error::last_os_error()
            );
        } else {
            None
        }
    }
}

fn shared_base(dir: &Path, per_run: bool, cpus: u32) -> Base {
    std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let _lock = DirLock::take(dir, true);
    let b = Base {
        snapshot: dir.join("base.snap"),
        disk: dir.join("base.disk"),
    };
    let ready = dir.join("ready");
    let failed = dir.join("failed");
    if ready.exists() {
        return b;
    }
    if per_run {
        if let Ok(why) = std::fs::read_to_string(&failed) {
            panic!("an earlier test of this run failed to create it: {why}");
        }
    }
    let t = Instant::now();
    match std::panic::catch_unwind(|| create(dir, &b, cpus)) {
        Ok(()) => {
            let secs = t.elapsed().as_secs_f64();
            eprintln!(
                "base snapshot ({cpus} vCPU) created in {secs:.0} s: {}",
                dir.display()
            );
            std::fs::write(&ready, format!("created in {secs:.0} s\n")).expect("ready marker");
            if !per_run {
                prune_other_keys(dir);
            }
            b
        }
        Err(p) => {
            let why = panic_text(p);
            if per_run {
                let _ = std::fs::write(&failed, &why);
            }
            panic!("{why}");
        }
    }
}

/// Removes the bases of other keys next to `dir` that nobody is using.
fn prune_other_keys(dir: &Path) {
    let Some(parent) = dir.parent() else { return };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p != dir && p.is_dir() && DirLock::take(&p, false).is_some() {
            let _ = std::fs::remove_dir_all(&p);
        }
    }
}

/// What the base guest runs once booted, before its snapshot.
const QUIET_CONSOLE: &str = "dmesg -n 1";

/// `tandem run` arguments that boot the base guest with `cpus` vCPUs (on
/// taps tap0 and tap1).
fn boot_args(disk: &Path, sock: &Path, cpus: u32) -> Vec<String> {
    let path = |p: PathBuf| p.to_str().expect("UTF-8 path").to_string();
    [
        "--kernel".into(),
        path(guest_file("vmlinux")),
        "--initrd".into(),
        path(guest_file("initramfs.cpio")),
        "--mem".into(),
        "128M".into(),
        "--cpus".into(),
        cpus.to_string(),
        "--cmdline".into(),
        CMDLINE.into(),
        "--net".into(),
        net_arg(0, "tap0"),
        "--net".into(),
        net_arg(1, "tap1"),
        "--disk".into(),
        disk_arg(disk),
        "--api-sock".into(),
        path(sock.to_path_buf()),
    ]
    .into()
}

/// Boots the base guest with `cpus` vCPUs in a namespace of its own,
/// snapshots it and ends it.
fn create(dir: &Path, b: &Base, cpus: u32) {
    let snap_tmp = dir.join("base.snap.tmp");
    for f in [&b.snapshot, &b.disk, &snap_tmp] {
        let _ = std::fs::remove_file(f);
    }
    make_ext4(&b.disk);

    let ns = NetNs::new("base");
    ns.add_bare_tap("tap0");
    ns.add_bare_tap("tap1");
    let sock = dir.join("base.sock");
    let t = Instant::now();
    let mut vm = TestVm::start_with(
        ns.command(tandem_bin().to_str().unwrap()),
        &boot_args(&b.disk, &sock, cpus)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    vm.wait_ready();
    eprintln!(
        "base guest ({cpus} vCPU) booted in {:.0} s",
        t.elapsed().as_secs_f64()
    );
    let online = vm.ok("nproc", crate::CMD_TIMEOUT);
    assert_eq!(online, cpus.to_string(), "the base guest's CPUs online");
    // Kernel messages (e.g. "hrtimer: interrupt took N ns" under load)
    // would land in the middle of a command's output on the console: only
    // emergencies reach it in the base and every restore of it.
    vm.ok(QUIET_CONSOLE, crate::CMD_TIMEOUT);
    let (code, p) = ctl(&sock, &["pause"]);
    assert_eq!(code, 0, "pause the base guest: {p}");
    let (code, s) = ctl(&sock, &["snapshot", b.snapshot.to_str().unwrap()]);
    assert_eq!(code, 0, "snapshot the base guest: {s}\n{}", vm.stderr());
    eprintln!("base snapshot: {} bytes, {} ms", s["file_bytes"], s["ms"]);
    drop(vm); // SIGKILL: the disk is as it was at the snapshot.
    let _ = std::fs::remove_file(&sock);
}

/// `path=FILE,id=DISK_ID` (size: [`DISK_BYTES`]): the id is fixed (by default it is the file name,
/// which differs between the base and a restore's copy).
fn disk_arg(path: &Path) -> String {
    format!("path={},id={DISK_ID}", path.display())
}

/// A [`DISK_BYTES`] ext4 image at `path`.
fn make_ext4(path: &Path) {
    let f = File::create(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.set_len(DISK_BYTES).expect("size the base disk");
    drop(f);
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("mkfs.ext4 ({e}): run resources/setup.sh (e2fsprogs)"));
    assert!(
        out.status.success(),
        "mkfs.ext4 {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A unique scratch path in the temporary directory.
pub fn scratch(what: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("tandem-{what}-{}-{n}", std::process::id()))
}

/// The base guest's memory size and vCPU count, as `tandem run` takes them.
pub const BASE_MEM: &str = "128M";

/// The device options of the base guest (its two NICs on `taps`, its disk
/// at `disk`): what a restore or a migration's destination must give.
pub fn device_args(taps: [&str; 2], disk: &Path) -> Vec<String> {
    vec![
        "--net".into(),
        net_arg(0, taps[0]),
        "--net".into(),
        net_arg(1, taps[1]),
        "--disk".into(),
        disk_arg(disk),
    ]
}

/// A copy of the base disk (the caller removes it).
pub fn disk_copy() -> PathBuf {
    base().disk_copy()
}

/// A copy of the SMP base's disk (the caller removes it).
pub fn disk_copy_smp() -> PathBuf {
    base_smp().disk_copy()
}

impl Base {
    /// A copy of this base's disk (the caller removes it).
    pub fn disk_copy(&self) -> PathBuf {
        let copy = scratch("disk");
        std::fs::copy(&self.disk, &copy)
            .unwrap_or_else(|e| panic!("copy the base disk to {}: {e}", copy.display()));
        copy
    }
}

impl TestVm {
    /// Continues the base guest ([`base`]) inside `ns`: eth0 on tap
    /// `taps[0]`, eth1 on `taps[1]` (created if absent; the host side's
    /// addresses are the test's: [`HOST_IP0`], [`HOST_IP1`]), the disk on
    /// a copy of the base disk that is removed with the VM, and `extra`
    /// arguments (e.g. `--api-sock`, `--metrics`). A tap may carry options
    /// a restore may change: `"tap1,sndbuf=64K"`. Returns once the restored
    /// shell answers.
    pub fn restore_base(ns: &NetNs, taps: [&str; 2], extra: &[&str]) -> TestVm {
        let copy = disk_copy();
        let mut vm = Self::restore_base_on(ns, taps, &copy, extra);
        vm.remove_on_drop(copy);
        vm
    }

    /// [`TestVm::restore_base`] on the disk image `copy` (a [`disk_copy`]),
    /// which the caller keeps and removes.
    pub fn restore_base_on(ns: &NetNs, taps: [&str; 2], copy: &Path, extra: &[&str]) -> TestVm {
        Self::restore_from(&base(), ns, taps, copy, extra)
    }

    /// [`TestVm::restore_base`] of the SMP base ([`base_smp`]).
    pub fn restore_base_smp(ns: &NetNs, taps: [&str; 2], extra: &[&str]) -> TestVm {
        let copy = disk_copy_smp();
        let mut vm = Self::restore_base_smp_on(ns, taps, &copy, extra);
        vm.remove_on_drop(copy);
        vm
    }

    /// [`TestVm::restore_base_on`] of the SMP base, on `copy` (a
    /// [`disk_copy_smp`]), which the caller keeps and removes.
    pub fn restore_base_smp_on(ns: &NetNs, taps: [&str; 2], copy: &Path, extra: &[&str]) -> TestVm {
        Self::restore_from(&base_smp(), ns, taps, copy, extra)
    }

    fn restore_from(b: &Base, ns: &NetNs, taps: [&str; 2], copy: &Path, extra: &[&str]) -> TestVm {
        Self::restore_saved_on(&b.snapshot, ns, taps, copy, extra)
    }

    /// [`TestVm::restore_base_on`] of `snapshot`, a snapshot a test took of
    /// a guest restored from the base (its devices are the base's).
    pub fn restore_saved_on(
        snapshot: &Path,
        ns: &NetNs,
        taps: [&str; 2],
        copy: &Path,
        extra: &[&str],
    ) -> TestVm {
        let nets = [net_arg(0, taps[0]), net_arg(1, taps[1])];
        let disk = disk_arg(copy);
        let mut args = vec![
            "--restore",
            snapshot.to_str().expect("UTF-8 path"),
            "--net",
            &nets[0],
            "--net",
            &nets[1],
            "--disk",
            &disk,
        ];
        args.extend_from_slice(extra);
        let t = Instant::now();
        let mut vm = TestVm::start_with(ns.command(tandem_bin().to_str().unwrap()), &args);
        vm.ok("true", crate::CMD_TIMEOUT);
        eprintln!(
            "restored {} in {:.1} s",
            snapshot.display(),
            t.elapsed().as_secs_f64()
        );
        vm
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmdline_gives_the_guest_the_address_constants() {
        let args: Vec<&str> = CMDLINE.split_whitespace().collect();
        for want in [
            format!("tandem.ip={GUEST_IP0}/{PREFIX}"),
            format!("tandem.ip1={GUEST_IP1}/{PREFIX}"),
        ] {
            assert!(args.contains(&want.as_str()), "{want} not in {CMDLINE}");
        }
    }
}

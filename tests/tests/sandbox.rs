//! The sandbox on real guests (docs/sandbox.md):
//!
//! - every thread of a running VM (the run's base guest, restored, with
//!   its NICs, disk and API socket in use: a ping from the guest, a
//!   snapshot through the API) is confined: `Seccomp: 2` and
//!   `NoNewPrivs: 1` in `/proc/PID/task/*/status`;
//! - a call a thread's filter denies ends tandem with one line naming the
//!   thread and the call, and exit status 4 (`TANDEM_SECCOMP_TEST_DENY`
//!   makes the named thread call personality(2) once confined);
//! - `--seccomp off` installs no filter; `--seccomp log` installs them;
//! - a user without root who can open `/dev/kvm` and `/dev/net/tun` and
//!   owns taps made for them restores the base guest and pings it both
//!   ways; a tap made for root, and one that does not exist, are refused
//!   with a line that says how to make one. The devices are given to that user inside a
//!   mount namespace of the test's own (bind mounts of nodes the user
//!   owns), so the host's `/dev` is never changed.
//!
//! - Landlock: a snapshot to a directory the VM was not started with is
//!   refused with an answer naming `--landlock-rule`, and so is a revert
//!   from there, while the guest runs on; so is one beside the API socket
//!   (that directory takes sockets only); with the rule, or with
//!   `--landlock off`, the same snapshot is written.
//!
//! Every other guest test runs with the sandbox on (the default), so a
//! call a feature makes outside its thread's list fails there.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tandem_tests::base::{
    base, disk_copy, scratch, DISK_ID, GUEST_IP0, HOST_IP0, MAC0, MAC1, PREFIX,
};
use tandem_tests::netns::NetNs;
use tandem_tests::{ctl, guest_file, phase, require_kvm, tandem_bin, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;

/// Each thread of process `pid`: its name, `Seccomp:` and `NoNewPrivs:`.
fn threads(pid: u32) -> Vec<(String, String, String)> {
    let dir = format!("/proc/{pid}/task");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{dir}: {e}")) {
        let status = entry.unwrap().path().join("status");
        // A thread that ended since the listing has no status any more.
        let Ok(text) = std::fs::read_to_string(&status) else {
            continue;
        };
        let field = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key))
                .map(|v| v.trim().to_string())
                .unwrap_or_else(|| panic!("{}: no {key}", status.display()))
        };
        out.push((field("Name:"), field("Seccomp:"), field("NoNewPrivs:")));
    }
    out.sort();
    out
}

/// `tandem run` of the default guest with `args` and `env`.
fn default_cmd(args: &[&str], env: &[(&str, &str)]) -> Command {
    require_kvm();
    let mut cmd = Command::new(tandem_bin());
    cmd.arg("run")
        .arg("--kernel")
        .arg(guest_file("vmlinux"))
        .arg("--initrd")
        .arg(guest_file("initramfs.cpio"))
        .args(args)
        .envs(env.iter().copied());
    cmd
}

/// [`default_cmd`] started, its console unread (these tests need its
/// threads, not its guest).
fn start_default(args: &[&str], env: &[(&str, &str)]) -> std::process::Child {
    default_cmd(args, env)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tandem")
}

/// Waits until process `pid` has threads with each of `names`, and
/// returns its threads then.
fn threads_once(pid: u32, names: &[&str]) -> Vec<(String, String, String)> {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let t = threads(pid);
        if names.iter().all(|name| t.iter().any(|(n, _, _)| n == name)) {
            return t;
        }
        assert!(Instant::now() < end, "not all of {names:?} in 30 s: {t:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn every_thread_of_a_running_vm_is_confined() {
    phase("restore");
    let ns = NetNs::new("sandbox");
    ns.add_tap("tap0", &format!("{HOST_IP0}/{PREFIX}"));
    let sock = scratch("sandbox.sock");
    let snap = scratch("sandbox.snap");
    let s = sock.to_str().unwrap();
    let mut vm = TestVm::restore_base(&ns, ["tap0", "tap1"], &["--api-sock", s]);
    phase("use the NIC, the API and a snapshot");
    vm.ok(&format!("ping -c 2 -W 5 {HOST_IP0} >/dev/null"), CMD);
    let (rc, answer) = ctl(&sock, &["snapshot", snap.to_str().unwrap()]);
    assert_eq!(rc, 0, "snapshot: {answer}");
    assert!(Path::new(&snap).metadata().unwrap().len() > 1 << 20);
    vm.ok("true", CMD);
    phase("threads");
    let all = threads(vm.pid());
    let names: Vec<&str> = all.iter().map(|(n, _, _)| n.as_str()).collect();
    for expected in ["tandem", "vcpu0", "devices"] {
        assert!(names.contains(&expected), "no thread {expected}: {all:?}");
    }
    for (name, seccomp, nnp) in &all {
        assert_eq!(seccomp, "2", "thread {name} is not confined: {all:?}");
        assert_eq!(nnp, "1", "thread {name}: no_new_privs not set: {all:?}");
    }
    drop(vm);
    let _ = std::fs::remove_file(&snap);
}

#[test]
fn a_denied_call_ends_tandem_with_one_line_naming_thread_and_call() {
    for thread in ["vcpu0", "devices"] {
        phase(thread);
        let cmd = default_cmd(&[], &[("TANDEM_SECCOMP_TEST_DENY", thread)]);
        let (code, err) = exit_within(cmd, Duration::from_secs(60));
        assert_eq!(code, Some(4), "{thread}: stderr: {err}");
        let want = format!(
            "tandem: seccomp: thread '{thread}' made system call personality (135), \
             which its filter denies"
        );
        let lines: Vec<&str> = err.lines().filter(|l| l.contains("seccomp")).collect();
        assert_eq!(lines.len(), 1, "{thread}: stderr: {err}");
        assert!(lines[0].starts_with(&want), "{thread}: stderr: {err}");
    }
}

#[test]
fn seccomp_off_installs_no_filter_and_log_installs_them() {
    for (mode, want) in [("off", "0"), ("log", "2")] {
        phase(mode);
        let mut child = start_default(&["--seccomp", mode], &[]);
        let all = threads_once(child.id(), &["vcpu0", "devices"]);
        let _ = child.kill();
        let _ = child.wait();
        for (name, seccomp, _) in &all {
            assert_eq!(seccomp, want, "--seccomp {mode}: thread {name}: {all:?}");
        }
    }
}

/// The user (and group) the unprivileged test runs tandem as.
const USER: u32 = 65534;

/// Runs `cmd` (a program and its arguments), which must succeed.
fn must(cmd: &[&str]) {
    let st = Command::new(cmd[0]).args(&cmd[1..]).status().unwrap();
    assert!(st.success(), "{cmd:?}: {st}");
}

/// A command that runs `tandem` in `ns` as [`USER`], with no capabilities,
/// `/dev/kvm` and `/dev/net/tun` bound (in a mount namespace of its own)
/// to nodes in `dir` that the user owns.
fn as_user(ns: &NetNs, dir: &Path) -> Command {
    let d = dir.display();
    let script = format!(
        "mount --bind {d}/kvm /dev/kvm && mount --bind {d}/tun /dev/net/tun && \
         exec setpriv --reuid={USER} --regid={USER} --clear-groups --inh-caps=-all \
         --bounding-set=-all {} \"$@\"",
        tandem_bin().display()
    );
    let mut cmd = ns.command("unshare");
    cmd.args(["--mount", "sh", "-c", &script, "sh"]);
    cmd
}

/// Runs `cmd` to its end (killed after `limit`): its exit status and
/// stderr.
fn exit_within(mut cmd: Command, limit: Duration) -> (Option<i32>, String) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let end = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} still runs after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    (status.code(), err)
}

#[test]
fn a_user_without_root_restores_a_guest_with_its_own_taps_and_pings_it() {
    phase("set up");
    let ns = NetNs::new("unpriv");
    let owned = USER.to_string();
    for tap in ["utap0", "utap1"] {
        ns.must(
            "ip",
            &["tuntap", "add", "dev", tap, "mode", "tap", "user", &owned],
        );
        ns.must("ip", &["link", "set", tap, "up"]);
    }
    ns.must(
        "ip",
        &[
            "addr",
            "add",
            &format!("{HOST_IP0}/{PREFIX}"),
            "dev",
            "utap0",
        ],
    );
    ns.must(
        "ip",
        &[
            "tuntap", "add", "dev", "roottap", "mode", "tap", "user", "0",
        ],
    );
    let dir = scratch("unpriv");
    std::fs::create_dir(&dir).unwrap();
    let snap = dir.join("base.snap");
    std::fs::copy(&base().snapshot, &snap).unwrap();
    let disk = disk_copy();
    let user_disk = dir.join("disk");
    std::fs::rename(&disk, &user_disk)
        .or_else(|_| std::fs::copy(&disk, &user_disk).map(drop))
        .unwrap();
    let _ = std::fs::remove_file(&disk);
    let d = dir.to_str().unwrap();
    must(&["mknod", &format!("{d}/kvm"), "c", "10", "232"]);
    must(&["mknod", &format!("{d}/tun"), "c", "10", "200"]);
    must(&["chown", "-R", &format!("{USER}:{USER}"), d]);
    must(&["chmod", "700", d]);
    let sock = dir.join("api.sock");
    let disk_arg = format!("path={},id={DISK_ID}", user_disk.display());
    let nets = |t0: &str| {
        [
            format!("tap={t0},mac={MAC0},rsc=off"),
            format!("tap=utap1,mac={MAC1},rsc=on"),
        ]
    };

    for (tap, why) in [
        ("roottap", "made for root"),
        ("notap", "that does not exist"),
    ] {
        phase(&format!("a tap {why} is refused"));
        let [n0, n1] = nets(tap);
        let mut cmd = as_user(&ns, &dir);
        cmd.args(["run", "--restore", snap.to_str().unwrap()])
            .args(["--net", &n0, "--net", &n1, "--disk", &disk_arg]);
        let (code, err) = exit_within(cmd, Duration::from_secs(60));
        assert_eq!(code, Some(1), "tap {why}: stderr: {err}");
        let want = format!("cannot attach to tap '{tap}'");
        let how = format!("ip tuntap add {tap} mode tap user USER");
        assert!(
            err.contains(&want) && err.contains(&how),
            "tap {why}: stderr: {err}"
        );
    }

    phase("restore as the user, sandbox on");
    let [n0, n1] = nets("utap0");
    let args = [
        "--restore",
        snap.to_str().unwrap(),
        "--net",
        &n0,
        "--net",
        &n1,
        "--disk",
        &disk_arg,
        "--api-sock",
        sock.to_str().unwrap(),
    ];
    let mut vm = TestVm::start_with(as_user(&ns, &dir), &args);
    vm.ok("true", CMD);
    let status = std::fs::read_to_string(format!("/proc/{}/status", vm.pid())).unwrap();
    let field = |k: &str| {
        status
            .lines()
            .find(|l| l.starts_with(k))
            .unwrap_or("")
            .to_string()
    };
    assert!(
        field("Uid:").split_whitespace().skip(1).all(|u| u == owned),
        "{status}"
    );
    assert_eq!(
        field("CapEff:").split_whitespace().nth(1),
        Some("0000000000000000")
    );
    assert_eq!(field("Seccomp:").split_whitespace().nth(1), Some("2"));

    phase("ping both ways, and the API");
    vm.ok(&format!("ping -c 2 -W 5 {HOST_IP0} >/dev/null"), CMD);
    let st = ns
        .command("ping")
        .args(["-c", "2", "-W", "5", GUEST_IP0])
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "ping from the host: {}",
        String::from_utf8_lossy(&st.stdout)
    );
    let (rc, answer) = ctl(&sock, &["status"]);
    assert_eq!(rc, 0, "{answer}");
    drop(vm);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A directory outside /tmp (where the tests' API sockets are, which a VM
/// may write), removed on drop.
struct OutsideDir(std::path::PathBuf);

impl Drop for OutsideDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn landlock_keeps_snapshots_where_the_vm_was_told() {
    let ns = NetNs::new("landlock");
    ns.add_tap("tap0", &format!("{HOST_IP0}/{PREFIX}"));
    let out = OutsideDir(std::path::PathBuf::from(format!(
        "/var/tmp/tandem-landlock-{}",
        std::process::id()
    )));
    std::fs::create_dir_all(&out.0).unwrap();
    let snap = out.0.join("vm.snap");
    let s = snap.to_str().unwrap();
    let rule = format!("{}:rw", out.0.display());
    // `--landlock on` (the default) keeps the harness from adding a rule
    // for the API socket's directory (see TestVm::start_with).
    for (extra, allowed) in [
        (vec!["--landlock", "on"], false),
        (vec!["--landlock-rule", rule.as_str()], true),
        (vec!["--landlock", "off"], true),
    ] {
        phase(&format!("{extra:?}"));
        let sock = scratch("landlock.sock");
        let mut args = vec!["--api-sock", sock.to_str().unwrap()];
        args.extend_from_slice(&extra);
        let mut vm = TestVm::restore_base(&ns, ["tap0", "tap1"], &args);
        let (rc, answer) = ctl(&sock, &["snapshot", s]);
        if allowed {
            assert_eq!(rc, 0, "{extra:?}: {answer}");
            assert!(snap.metadata().unwrap().len() > 1 << 20);
            let (rc, answer) = ctl(&sock, &["revert", s]);
            assert_eq!(rc, 0, "{extra:?}: revert: {answer}");
        } else {
            assert_eq!(rc, 1, "{extra:?}: {answer}");
            let e = answer["error"].as_str().unwrap_or_default();
            assert!(
                e.contains("Permission denied") && e.contains("--landlock-rule"),
                "{answer}"
            );
            assert!(!snap.exists(), "a refused snapshot left {}", snap.display());
            // Nor beside the API socket: its directory takes sockets only.
            let beside = sock.with_extension("snap");
            let (rc, answer) = ctl(&sock, &["snapshot", beside.to_str().unwrap()]);
            assert_eq!(rc, 1, "a snapshot beside the API socket: {answer}");
            assert!(!beside.exists(), "{} was written", beside.display());
        }
        vm.ok("true", CMD);
        drop(vm);
        if !allowed {
            // A snapshot there (made by this test, not the VM) may not be
            // read back either.
            std::fs::copy(&base().snapshot, &snap).unwrap();
            let mut vm = TestVm::restore_base(&ns, ["tap0", "tap1"], &args);
            let (rc, answer) = ctl(&sock, &["revert", s]);
            assert_eq!(rc, 1, "revert: {answer}");
            vm.ok("true", CMD);
            drop(vm);
            std::fs::remove_file(&snap).unwrap();
        } else {
            let _ = std::fs::remove_file(&snap);
        }
    }
}

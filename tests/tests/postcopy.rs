//! Post-copy migration (`--postcopy`, `migrate-postcopy`) between tandem
//! processes on this machine, on a real guest: the base guest, restored,
//! writes a file in memory and starts `tandem-dirty` rewriting 8 MiB at
//! 16 MiB/s and a counting loop, and is saved once; each case restores that
//! save (no boot, no new first touch) as its source.
//!
//! 1. With `--postcopy --bandwidth 4 --auto-converge off` the guest dirties
//!    four times faster than the link sends, so the pre-copy cannot end;
//!    once a round no longer shrinks the dirty set it switches. The
//!    migration completes; the report names the pages fetched after the
//!    switch and the faults the guest waited on; at the destination the
//!    file has its checksum, every page `tandem-dirty` rewrote holds its
//!    last write, and the counting loop goes on.
//! 2. A TCP link through a forwarder is cut during post-copy: each side
//!    says in one line that the guest is lost and exits with status 1.
//! 3. Switched by hand (`tandem ctl migrate-postcopy`), then the
//!    destination is killed: the source says the guest is lost, exits 1.
//! 4. The source is killed during post-copy: the destination says the
//!    guest is lost, exits 1.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tandem_tests::base::{device_args, disk_copy, BASE_MEM, HOST_IP0, PREFIX};
use tandem_tests::netns::NetNs;
use tandem_tests::{ctl, migrate, migrate_cmd, phase, tandem_bin, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;

fn scratch(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tandem-pc-{what}-{}", std::process::id()))
}

fn unix(sock: &Path) -> String {
    format!("unix:{}", sock.display())
}

/// The base guest, restored, with /tmp/m written, `tandem-dirty 8 16`
/// (job 1) and a counting loop started, saved to a file; returns the file
/// and /tmp/m's checksum line.
fn prepared(ns: &NetNs) -> (PathBuf, String) {
    let api = scratch("prep.api");
    let mut vm = TestVm::restore_base(ns, ["tap0", "tap1"], &["--api-sock", api.to_str().unwrap()]);
    vm.ok(
        "awk 'BEGIN{srand(5); for(i=0;i<2048;i++) s=s sprintf(\"%08x\", rand()*2147483648); \
         for(j=0;j<32;j++) printf \"%d%s\", j, s}' > /tmp/m",
        CMD,
    );
    vm.start_dirty(8, 16);
    vm.ok(
        "mkfifo /tmp/tick; (exec 3<>/tmp/tick; n=0; while :; do n=$((n+1)); \
         echo $n >> /tmp/count; read -t 1 x <&3; done) &",
        CMD,
    );
    let sum = vm.ok("sha256sum /tmp/m", CMD);
    let snap = scratch("prepared.snap");
    let (code, a) = ctl(&api, &["snapshot", snap.to_str().unwrap()]);
    assert_eq!(code, 0, "{a}");
    vm.kill();
    (snap, sum)
}

/// A source restored from `snap` in `ns` (eth0 on tap0), with an API
/// socket; the disk copy is removed with it.
fn source(ns: &NetNs, snap: &Path, tag: &str) -> (TestVm, PathBuf) {
    let api = scratch(&format!("{tag}-src.api"));
    let copy = disk_copy();
    let mut vm = TestVm::restore_saved_on(
        snap,
        ns,
        ["tap0", "tap1"],
        &copy,
        &["--api-sock", api.to_str().unwrap()],
    );
    vm.remove_on_drop(copy);
    (vm, api)
}

/// `tandem run --incoming ADDR` with the base guest's devices (eth0 on
/// tap2), waiting.
fn destination(ns: &NetNs, incoming: &str, tag: &str) -> TestVm {
    let disk = disk_copy();
    let api = scratch(&format!("{tag}-dst.api"));
    let mut args: Vec<String> = vec![
        "--incoming".into(),
        incoming.into(),
        "--mem".into(),
        BASE_MEM.into(),
        "--api-sock".into(),
        api.display().to_string(),
    ];
    args.extend(device_args(["tap2", "tap3"], &disk));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut vm = TestVm::start_with(ns.command(tandem_bin().to_str().unwrap()), &args);
    vm.remove_on_drop(disk);
    let t = Instant::now();
    while !vm.stderr().contains("waiting for a migration on") {
        assert!(t.elapsed() < CMD && vm.running(), "{}", vm.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    vm
}

/// Waits until the migration from `api` is in post-copy.
fn await_postcopy(api: &Path) {
    let t = Instant::now();
    loop {
        let (_, a) = ctl(api, &["migrate-status"]);
        match a["migration"]["phase"].as_str() {
            Some("post-copy") => return,
            Some("completed" | "failed" | "cancelled") => panic!("ended before post-copy: {a}"),
            _ => {}
        }
        assert!(t.elapsed() < 3 * CMD, "no post-copy: {a}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The VMM ended with status 1 and said, in exactly one line, that the
/// guest is lost.
fn lost(vm: &mut TestVm, who: &str) {
    let st = vm.wait_exit(CMD);
    let err = vm.stderr();
    assert_eq!(st.code(), Some(1), "{who}: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("is lost")).collect();
    assert_eq!(
        lines.len(),
        1,
        "{who}: one line says the guest is lost: {err}"
    );
    phase(&format!("{who}: {}", lines[0]));
}

#[test]
fn postcopy_moves_a_guest_that_outpaces_the_link_and_a_break_loses_it() {
    let ns = NetNs::new("postcopy");
    ns.add_bridge("br0", &format!("{HOST_IP0}/{PREFIX}"), &["tap0", "tap2"]);
    let (snap, sum) = prepared(&ns);
    phase("prepared");
    completes(&ns, &snap, &sum);
    link_cut(&ns, &snap);
    destination_killed(&ns, &snap);
    source_killed(&ns, &snap);
    let _ = std::fs::remove_file(snap);
}

/// Case 1 (see the top).
fn completes(ns: &NetNs, snap: &Path, sum: &str) {
    let (mut src, api) = source(ns, snap, "ok");
    let sock = scratch("ok.sock");
    let mut dst = destination(ns, &unix(&sock), "ok");
    let opts = ["--postcopy", "--bandwidth", "4", "--auto-converge", "off"];
    let (code, report) = migrate(ns, &api, &unix(&sock), &opts);
    eprintln!("post-copy migration: {report}");
    assert_eq!(
        (code, report["phase"].as_str()),
        (0, Some("completed")),
        "{report}; the destination: {}",
        dst.stderr()
    );
    let p = &report["postcopy"];
    let needed = p["needed_pages"].as_u64().unwrap_or(0);
    assert!(
        needed >= 1024,
        "the guest's dirty pages were fetched after the switch: {report}"
    );
    assert_eq!(p["sent_pages"].as_u64(), Some(needed), "{report}");
    assert_eq!(p["source_kept_memory"], true, "{report}");
    assert!(p["fault_max_ms"].as_f64().is_some(), "{report}");
    assert!(
        report["downtime_ms"].as_f64().unwrap_or(0.0) > 0.0,
        "{report}"
    );
    assert_eq!(src.wait_exit(CMD).code(), Some(0), "{}", src.stderr());
    dst.ok("true", CMD);
    assert_eq!(dst.ok("sha256sum /tmp/m", CMD), sum);
    let dirty = dst.ok("kill %1; wait %1; cat /tmp/dirty.out", CMD);
    assert!(dirty.contains("every page holds its last write"), "{dirty}");
    let before = dst.ok("while read l; do n=$l; done < /tmp/count; echo $n", CMD);
    std::thread::sleep(Duration::from_secs(2));
    let after = dst.ok("while read l; do n=$l; done < /tmp/count; echo $n", CMD);
    assert_ne!(before, after, "the counting loop goes on");
    assert!(dst.stderr().contains("post-copy: all"), "{}", dst.stderr());
    phase(&format!(
        "1: completed in post-copy ({needed} pages after the switch, {} faults waited)",
        p["faults"]
    ));
}

/// Case 2: the link cut during post-copy.
fn link_cut(ns: &NetNs, snap: &Path) {
    let (mut src, api) = source(ns, snap, "cut");
    let mut dst = destination(ns, "tcp:127.0.0.1:4431", "cut");
    let (cut_tx, cut_rx) = std::sync::mpsc::channel::<(TcpStream, TcpStream)>();
    let (ready, listening) = std::sync::mpsc::channel();
    let forwarder = ns.spawn(move || {
        let l = TcpListener::bind(("127.0.0.1", 4432)).expect("the forwarder's port");
        ready.send(()).expect("the test waits");
        let (from, _) = l.accept().expect("the source connects");
        let onto = TcpStream::connect(("127.0.0.1", 4431)).expect("the destination");
        let ends = (from.try_clone().unwrap(), onto.try_clone().unwrap());
        cut_tx.send(ends).expect("the test holds the ends");
        let (mut a, mut b) = (from.try_clone().unwrap(), onto.try_clone().unwrap());
        let back = std::thread::spawn(move || std::io::copy(&mut b, &mut a));
        let (mut a, mut b) = (from, onto);
        let _ = std::io::copy(&mut a, &mut b);
        let _ = back.join();
    });
    listening.recv_timeout(CMD).expect("the forwarder listens");
    let opts = ["--postcopy", "--bandwidth", "4", "--auto-converge", "off"];
    let follower = migrate_cmd(ns, &api, "tcp:127.0.0.1:4432", &opts)
        .spawn()
        .expect("tandem ctl migrate");
    let (from, onto) = cut_rx.recv_timeout(CMD).expect("the source connected");
    await_postcopy(&api);
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = onto.shutdown(std::net::Shutdown::Both);
    let out = follower.wait_with_output().expect("tandem ctl migrate");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    eprintln!("post-copy, link cut: {report}");
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert_eq!(
        (report["phase"].as_str(), report["lost"].as_bool()),
        (Some("failed"), Some(true)),
        "{report}"
    );
    lost(&mut src, "2: the source");
    lost(&mut dst, "2: the destination");
    forwarder.join().expect("the forwarder");
}

/// Case 3: switched by hand, then the destination killed.
fn destination_killed(ns: &NetNs, snap: &Path) {
    let (mut src, api) = source(ns, snap, "dkill");
    let sock = scratch("dkill.sock");
    let mut dst = destination(ns, &unix(&sock), "dkill");
    let opts = ["--bandwidth", "4", "--auto-converge", "off"];
    let follower = migrate_cmd(ns, &api, &unix(&sock), &opts)
        .spawn()
        .expect("tandem ctl migrate");
    // In pre-copy (it cannot converge), switched by hand.
    let t = Instant::now();
    loop {
        let (code, a) = ctl(&api, &["migrate-postcopy"]);
        if code == 0 {
            break;
        }
        assert!(t.elapsed() < CMD, "migrate-postcopy refused: {a}");
        std::thread::sleep(Duration::from_millis(100));
    }
    await_postcopy(&api);
    dst.kill();
    let out = follower.wait_with_output().expect("tandem ctl migrate");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    eprintln!("post-copy, destination killed: {report}");
    assert_eq!(report["lost"], true, "{report}");
    lost(&mut src, "3: the source");
}

/// Case 4: the source killed during post-copy.
fn source_killed(ns: &NetNs, snap: &Path) {
    let (mut src, api) = source(ns, snap, "skill");
    let sock = scratch("skill.sock");
    let mut dst = destination(ns, &unix(&sock), "skill");
    let opts = ["--postcopy", "--bandwidth", "4", "--auto-converge", "off"];
    let follower = migrate_cmd(ns, &api, &unix(&sock), &opts)
        .spawn()
        .expect("tandem ctl migrate");
    await_postcopy(&api);
    src.kill();
    let _ = follower.wait_with_output();
    lost(&mut dst, "4: the destination");
}

//! A running VM taken back to a snapshot of itself (`tandem ctl revert`),
//! on a real guest (the run's base snapshot, restored): the state is
//! applied to the paused, already running VM (`VmHandle::apply_state`, what
//! COLO's secondary does at each checkpoint) and its memory replaced. The
//! guest's files are the snapshot's again, its NIC still carries traffic
//! (the live virtio device restarted on the saved queues), and a file that
//! is not a snapshot of this VM is refused with the VM running on.

use std::path::PathBuf;
use std::time::Duration;

use tandem_tests::base::{GUEST_IP0, HOST_IP0, PREFIX};
use tandem_tests::netns::NetNs;
use tandem_tests::{ctl, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;

fn scratch(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tandem-{what}-{}", std::process::id()))
}

fn ping(ns: &NetNs) {
    let out = ns
        .command("ping")
        .args(["-c", "3", "-i", "0.2", "-W", "20", GUEST_IP0])
        .output()
        .expect("ping");
    assert!(out.status.success(), "ping the guest: {out:?}");
}

#[test]
fn a_running_vm_goes_back_to_its_snapshot() {
    let sock = scratch("revert.sock");
    let snap = scratch("revert.snap");
    let ns = NetNs::new("revert");
    ns.add_tap("tap0", &format!("{HOST_IP0}/{PREFIX}"));
    let s = sock.to_str().unwrap();
    let mut vm = TestVm::restore_base(&ns, ["tap0", "tap1"], &["--api-sock", s]);
    vm.remove_on_drop(snap.clone());

    vm.ok("echo one > /tmp/marker", CMD);
    let (code, a) = ctl(&sock, &["snapshot", snap.to_str().unwrap()]);
    assert_eq!(code, 0, "{a}");
    vm.ok("echo two > /tmp/marker; echo later > /tmp/later", CMD);
    ping(&ns);

    let (code, a) = ctl(&sock, &["revert", snap.to_str().unwrap()]);
    assert_eq!(code, 0, "{a}");
    assert_eq!(a["state"], "running", "{a}");
    assert!(a["pages"].as_u64().unwrap_or(0) > 1000, "{a}");
    eprintln!("revert: {a}");
    // The shell is back where the snapshot caught it and may print its
    // prompt again: one command first, as after any restore.
    vm.ok("true", CMD);
    assert_eq!(vm.ok("cat /tmp/marker", CMD), "one");
    let (_, code) = vm.run("test -e /tmp/later", CMD);
    assert_ne!(code, 0, "/tmp/later was written after the snapshot");
    ping(&ns);

    // Refused before the VM pauses: the guest runs on untouched.
    let junk = scratch("revert.junk");
    std::fs::write(&junk, b"not a snapshot").unwrap();
    vm.remove_on_drop(junk.clone());
    let (code, a) = ctl(&sock, &["revert", junk.to_str().unwrap()]);
    assert_eq!(code, 1, "{a}");
    assert!(
        a["error"]
            .as_str()
            .unwrap_or("")
            .contains("not a tandem snapshot"),
        "{a}"
    );
    let (code, a) = ctl(&sock, &["status"]);
    assert_eq!((code, a["state"].as_str()), (0, Some("running")), "{a}");
    vm.ok("echo three > /tmp/marker", CMD);
    assert_eq!(vm.ok("cat /tmp/marker", CMD), "three");

    // And twice in a row, from a paused VM: it stays paused until resumed.
    assert_eq!(ctl(&sock, &["pause"]).0, 0);
    let (code, a) = ctl(&sock, &["revert", snap.to_str().unwrap()]);
    assert_eq!((code, a["state"].as_str()), (0, Some("paused")), "{a}");
    assert_eq!(ctl(&sock, &["resume"]).0, 0);
    vm.ok("true", CMD);
    assert_eq!(vm.ok("cat /tmp/marker", CMD), "one");
    ping(&ns);
}

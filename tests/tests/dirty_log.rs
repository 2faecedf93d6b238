//! Guest memory's dirty log on a real guest (the run's base snapshot,
//! restored): pages the guest writes (a file in tmpfs) are reported from
//! KVM's log, and pages virtio-net writes (frames received from the host)
//! from the device bitmap; the log turns on and off through `tandem ctl
//! dirty-log`.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;
use tandem_tests::base::{GUEST_IP0, HOST_IP0, PREFIX};
use tandem_tests::netns::NetNs;
use tandem_tests::{ctl, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
/// The file the guest writes: 8 MiB, 2048 pages of tmpfs.
const FILE_MIB: u64 = 8;
const PAGE: u64 = 4096;

fn scratch(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tandem-{what}-{}", std::process::id()))
}

fn pages(answer: &Value, field: &str) -> u64 {
    answer[field]
        .as_u64()
        .unwrap_or_else(|| panic!("no {field} in {answer}"))
}

#[test]
fn guest_and_device_writes_are_in_the_dirty_log() {
    let sock = scratch("dirty.sock");
    let ns = NetNs::new("dirty");
    ns.add_tap("tap0", &format!("{HOST_IP0}/{PREFIX}"));
    let s = sock.to_str().unwrap();
    let mut vm = TestVm::restore_base(&ns, ["tap0", "tap1"], &["--api-sock", s]);

    let (code, a) = ctl(&sock, &["dirty-log", "read"]);
    assert_eq!(code, 1, "a read before start must fail: {a}");
    let (code, a) = ctl(&sock, &["dirty-log", "start"]);
    assert_eq!(code, 0, "{a}");
    assert_eq!(pages(&a, "pages"), (128 << 20) / PAGE, "{a}");
    // What the guest wrote so far (the shell, the tick) is not the test's.
    assert_eq!(ctl(&sock, &["dirty-log", "read"]).0, 0);

    vm.ok(
        &format!("dd if=/dev/zero of=/tmp/dirty bs=1M count={FILE_MIB} 2>/dev/null"),
        CMD,
    );
    let (code, a) = ctl(&sock, &["dirty-log", "read"]);
    assert_eq!(code, 0, "{a}");
    let file_pages = (FILE_MIB << 20) / PAGE;
    assert!(
        pages(&a, "kvm_pages") >= file_pages,
        "an {FILE_MIB} MiB file in tmpfs is {file_pages} pages: {a}"
    );
    assert!(pages(&a, "pages") >= pages(&a, "kvm_pages"), "{a}");
    eprintln!("after the file: {a}");

    // Frames from the host: virtio-net writes them (and its used ring)
    // into guest memory, which KVM's log never sees.
    let out = ns
        .command("ping")
        .args(["-c", "10", "-i", "0.2", "-W", "20", GUEST_IP0])
        .output()
        .expect("ping");
    assert!(out.status.success(), "ping the guest: {out:?}");
    let (code, a) = ctl(&sock, &["dirty-log", "read"]);
    assert_eq!(code, 0, "{a}");
    assert!(pages(&a, "device_pages") >= 1, "received frames: {a}");
    eprintln!("after 10 pings: {a}");

    let (code, a) = ctl(&sock, &["dirty-log", "stop"]);
    assert_eq!((code, &a["logging"]), (0, &Value::Bool(false)), "{a}");
    let (code, a) = ctl(&sock, &["dirty-log", "read"]);
    assert_eq!(code, 1, "a read after stop must fail: {a}");
    // On again, and the guest still runs with it.
    assert_eq!(ctl(&sock, &["dirty-log", "start"]).0, 0);
    assert_eq!(vm.ok("echo $((6 * 7))", CMD), "42");
    let (code, a) = ctl(&sock, &["dirty-log", "read"]);
    assert_eq!(code, 0, "{a}");
    assert!(pages(&a, "pages") >= 1, "the shell wrote something: {a}");
}

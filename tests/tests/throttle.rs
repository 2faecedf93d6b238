//! vCPU throttling on a real guest (the run's base snapshot, restored): a
//! CPU-bound loop in the guest's shell takes several times as long while
//! `tandem ctl throttle 75` makes the vCPU sleep 75% of every window, and
//! its speed comes back with `throttle 0`. Each run is timed by the guest
//! itself (/proc/uptime), so the console's own delays do not count.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tandem_tests::netns::NetNs;
use tandem_tests::{ctl, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
/// About 1.5 s of user-mode work for the shell here, unthrottled.
const LOOP: &str = "read a b </proc/uptime; i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; \
                    read c d </proc/uptime; echo \"$a $c\"";

fn scratch(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tandem-{what}-{}", std::process::id()))
}

/// Seconds the loop took, by the guest's clock.
fn timed_loop(vm: &mut TestVm) -> f64 {
    let out = vm.ok(LOOP, tandem_tests::budget(Duration::from_secs(60)));
    // The loop's answer is the last line: the kernel may print to the
    // console meanwhile (on a loaded host, "hrtimer: interrupt took ...").
    let last = out.lines().last().unwrap_or("");
    let t: Vec<f64> = last
        .split_whitespace()
        .map(|w| w.parse().unwrap_or_else(|_| panic!("uptime in {out:?}")))
        .collect();
    assert_eq!(t.len(), 2, "{out:?}");
    t[1] - t[0]
}

fn throttle(sock: &Path, percent: &str) {
    let (code, a) = ctl(sock, &["throttle", percent]);
    assert_eq!(code, 0, "throttle {percent}: {a}");
    assert_eq!(a["percent"].to_string(), percent, "{a}");
}

#[test]
fn a_throttled_guest_runs_slower_and_recovers() {
    let sock = scratch("throttle.sock");
    let ns = NetNs::new("thr");
    let s = sock.to_str().unwrap();
    let mut vm = TestVm::restore_base(&ns, ["tap0", "tap1"], &["--api-sock", s]);

    let (code, a) = ctl(&sock, &["throttle", "100"]);
    assert_ne!(code, 0, "100% would stop the guest: {a}");

    let free = timed_loop(&mut vm);
    throttle(&sock, "75");
    let slow = timed_loop(&mut vm);
    throttle(&sock, "0");
    let again = timed_loop(&mut vm);
    eprintln!("loop: {free:.2} s free, {slow:.2} s at 75%, {again:.2} s free again");
    assert!(free > 0.2, "the loop is too short to time: {free} s");
    // Ideally 4x; a loaded host blurs both runs.
    assert!(
        slow > 2.0 * free,
        "75% throttle: {slow:.2} s against {free:.2} s"
    );
    assert!(
        again < slow / 1.5,
        "after throttle 0: {again:.2} s against {slow:.2} s throttled"
    );
    // Paused and resumed under a throttle, the guest still answers.
    throttle(&sock, "50");
    assert_eq!(ctl(&sock, &["pause"]).0, 0);
    assert_eq!(ctl(&sock, &["resume"]).0, 0);
    assert_eq!(vm.ok("echo $((6 * 7))", CMD), "42");
}

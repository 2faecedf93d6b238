//! The control API on a real guest (the run's base snapshot, restored):
//! status, pause and resume (the console stops answering while paused and
//! the guest clock does not see the pause), metrics, malformed requests
//! answered with JSON errors while the VM keeps running, and shutdown.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_tests::netns::NetNs;
use tandem_tests::{ctl, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
/// The last whole line of /tmp/count, read with shell builtins only.
const LAST_COUNT: &str = "while read l; do n=$l; done < /tmp/count; echo $n";

/// Sends raw lines on one connection and reads one answer per line.
fn raw(sock: &Path, lines: &[&[u8]]) -> Vec<Value> {
    let mut s = UnixStream::connect(sock).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    lines
        .iter()
        .map(|l| {
            s.write_all(l).unwrap();
            s.write_all(b"\n").unwrap();
            let mut answer = String::new();
            r.read_line(&mut answer).expect("answer");
            serde_json::from_str(&answer).expect("JSON answer")
        })
        .collect()
}

fn guest_uptime(vm: &mut TestVm) -> f64 {
    let out = vm.ok("cat /proc/uptime", CMD);
    out.split_whitespace()
        .next()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("uptime: {out}"))
}

#[test]
fn control_api_pause_resume_metrics_shutdown() {
    let sock = std::env::temp_dir().join(format!("tandem-api-{}.sock", std::process::id()));
    // The base guest keeps time with kvm-clock, not the TSC: the guest's
    // kvmclock is what tandem holds across a pause (the TSC of this host's
    // guests runs on).
    let ns = NetNs::new("api");
    ns.add_bare_tap("tap0");
    ns.add_bare_tap("tap1");
    let mut vm = TestVm::restore_base(
        &ns,
        ["tap0", "tap1"],
        &["--api-sock", sock.to_str().unwrap()],
    );

    let (code, st) = ctl(&sock, &["status"]);
    assert_eq!((code, &st["state"]), (0, &Value::from("running")), "{st}");
    assert_eq!(st["vcpus"], 1, "{st}");

    // A counter in the guest, using shell builtins only (read -t on a fifo
    // nobody writes is a sleep without a new process).
    vm.ok("mkfifo /tmp/tick && exec 3<>/tmp/tick", CMD);
    vm.ok(
        "(i=0; while :; do i=$((i+1)); echo $i >>/tmp/count; read -t 1 x <&3; done) &",
        CMD,
    );

    let cs = vm.ok(
        "cat /sys/devices/system/clocksource/clocksource0/current_clocksource",
        CMD,
    );
    assert_eq!(cs, "kvm-clock");

    // Pause: the console stops answering, the clock stops for the guest.
    let up1 = guest_uptime(&mut vm);
    let wall1 = Instant::now();
    let (code, p) = ctl(&sock, &["pause"]);
    assert_eq!(code, 0, "{p}");
    eprintln!("pause took {} ms", p["pause_ms"]);
    vm.send("echo during-pause-$((6*7))\n");
    std::thread::sleep(Duration::from_secs(8));
    assert!(
        !vm.console().contains("during-pause-42"),
        "the guest answered while paused"
    );
    let (code, st) = ctl(&sock, &["status"]);
    assert_eq!((code, &st["state"]), (0, &Value::from("paused")), "{st}");
    let (code, again) = ctl(&sock, &["pause"]);
    assert_eq!(code, 1, "pausing twice must fail: {again}");
    let (code, r) = ctl(&sock, &["resume"]);
    assert_eq!(code, 0, "{r}");
    vm.wait_for("during-pause-42", CMD);
    let up2 = guest_uptime(&mut vm);
    let wall = wall1.elapsed().as_secs_f64();
    let guest = up2 - up1;
    eprintln!("across the pause: host {wall:.1} s, guest {guest:.1} s");
    assert!(guest > 0.0, "guest time went backwards: {up1} -> {up2}");
    assert!(
        guest < wall - 6.0,
        "the guest saw the pause: host {wall:.1} s, guest {guest:.1} s"
    );
    // The counter goes on after the resume. It appends, and the last whole
    // line is read: a file rewritten in place (`>`) is empty for a moment
    // between its truncation and the write, and a read can land there.
    let c1: u64 = vm.ok(LAST_COUNT, CMD).parse().unwrap();
    std::thread::sleep(Duration::from_secs(5));
    let c2: u64 = vm.ok(LAST_COUNT, CMD).parse().unwrap();
    assert!(c2 > c1 && c1 > 0, "counter {c1} -> {c2}");

    // Metrics.
    let (code, m) = ctl(&sock, &["metrics"]);
    assert_eq!(code, 0, "{m}");
    assert!(m["metrics"]["emulation"].is_object(), "{m}");

    // Malformed requests get JSON errors; the VM goes on.
    let answers = raw(
        &sock,
        &[
            b"hello",
            b"{\"cmd\":\"reboot\"}",
            b"{\"cmd\":\"status\",\"x\":1}",
            b"\xff\xfe{",
            b"{\"cmd\":\"status\"}",
        ],
    );
    for a in &answers[..4] {
        assert_eq!(a["ok"], false, "{a}");
        assert!(a["error"].as_str().unwrap().contains("bad request"), "{a}");
    }
    assert_eq!(answers[4]["state"], "running");
    let mut big = vec![b'x'; 100 << 10];
    big.push(b'\n');
    let mut s = UnixStream::connect(&sock).unwrap();
    let _ = s.write_all(&big);
    drop(s);
    let (code, _) = ctl(&sock, &["resume"]);
    assert_eq!(code, 1, "resume when running must fail");
    assert_eq!(vm.ok("echo still-here", CMD), "still-here");

    // Shutdown ends the VMM with status 0 and removes the socket.
    let (code, a) = ctl(&sock, &["shutdown"]);
    assert_eq!(code, 0, "{a}");
    let st = vm.wait_exit(tandem_tests::budget(Duration::from_secs(20)));
    assert_eq!(st.code(), Some(0));
    assert!(!sock.exists(), "socket left behind");
    let (code, _) = ctl(&sock, &["status"]);
    assert_eq!(code, 1, "ctl on a dead socket must fail");
}

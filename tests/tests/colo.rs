//! COLO pairs on a real guest (the run's base snapshot, restored; no
//! boot): a primary (`tandem ctl colo-start`) and a secondary (`tandem run
//! --colo secondary`), both tandem processes on this machine, each NIC's
//! tap on a bridge in the test's namespace with the host's address.
//!
//! One test per failure, each in its own namespace (they run on the two
//! test threads side by side):
//! - the primary is killed (SIGKILL): the secondary takes the lease and
//!   serves from its last checkpoint (a ping every 20 ms from the kill on
//!   gets its first reply within the heartbeat timeout + 1 s): its
//!   console answers, a file written
//!   in guest memory after the pair started (so carried by a checkpoint)
//!   has its checksum, the counting loop goes on, and the guest answers
//!   pings through the bridge on the secondary's own tap. Before that, a
//!   forced failover on the secondary is refused while the primary holds
//!   the lease (never two servers). The guest mounts its disk and writes
//!   files to it across checkpoints (the primary's writes forwarded and
//!   journaled, the secondary's own in its overlay): after the failover
//!   they read back, and once the guest wrote one more, synced and
//!   unmounted, the secondary's image is clean (`e2fsck -fn`) and holds
//!   all of them. A second client stream, opened after the last
//!   checkpoint (so the guests' initial sequence numbers differ), goes on
//!   from the secondary with its segments rewritten, and arrives whole.
//! - a service whose replies differ between the two guests: mismatches
//!   make checkpoints, and the client gets each reply whole;
//! - the secondary is killed: the primary goes on alone (`primary_alone`,
//!   its alone mark in the lease), its guest unchanged and answering, a
//!   client stream running across it arrives whole, and the verbs a pair
//!   refuses (pause) work again; then `colo-reprotect` with a new
//!   secondary: its NICs back on their taps, a new pair, protected, and
//!   the guest answers pings through its compare.
//! - re-protect after a failover: the primary killed, the survivor
//!   re-protected by a third VM (its checkpoints over 3 page channels),
//!   the survivor killed: the third serves and
//!   a client stream running across both failovers arrives whole.
//! - the link is cut with both alive (the primary stopped with SIGSTOP,
//!   then continued): the secondary waits for the lease the primary holds,
//!   the primary goes on alone; when the primary then dies, the secondary
//!   finds the alone mark and retires (status 1): exactly one server, and
//!   never a stale one.
//!
//! - checkpoints every 2 s for over 3 minutes, their pages over 4 page
//!   channels, with a client's stream running through the pair: none
//!   abandoned, still protected, every byte arrived.
//!
//! A client's TCP stream runs through the pair (the compare) and across the
//! primary's death.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tandem_tests::base::{disk_copy, scratch, GUEST_IP0, HOST_IP0, PREFIX};
use tandem_tests::colo::{self, checkpoint_now, status, wait_checkpoints, wait_until};
use tandem_tests::netns::NetNs;
use tandem_tests::stream::{Pace, Stream, BULK};
use tandem_tests::{ctl, phase, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
/// Checkpoints every 2 s, a heartbeat every 100 ms, lost after 1 s.
const PERIOD_MS: &str = "2000";
const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(1000);
/// The client's stream: 3 MiB, 16 KiB every 200 ms (some 39 s), so that
/// it runs from before the pair started until after the failover.
const THROUGH: Pace = Pace {
    bytes: 3 << 20,
    piece: 16 << 10,
    every: Duration::from_millis(200),
};
/// A stream opened shortly before one side's death: 512 KiB, 16 KiB every
/// 200 ms (some 6 s; the kill comes 1 s in).
const LATE: Pace = Pace {
    bytes: 512 << 10,
    piece: 16 << 10,
    every: Duration::from_millis(200),
};
/// A period no test outlasts: checkpoints when the test asks.
const LONG_PERIOD_MS: &str = "600000";
const LAST_COUNT: &str = "while read l; do n=$l; done < /tmp/count; echo $n";

/// A pair in namespace `tag`: the primary (the base guest restored on
/// tap0/tap1, the counting loop started) and the secondary (on tap2/tap3,
/// waiting), and the secondary's address; tap0 and tap2 are on the bridge.
struct Pair {
    ns: NetNs,
    primary: TestVm,
    primary_api: PathBuf,
    secondary: TestVm,
    secondary_api: PathBuf,
    /// The secondary's disk image.
    secondary_disk: PathBuf,
    /// The primary's.
    primary_disk: PathBuf,
    addr: String,
    lease: PathBuf,
}

impl Pair {
    fn new(tag: &str) -> Pair {
        let ns = NetNs::new(tag);
        ns.add_bridge("br0", &format!("{HOST_IP0}/{PREFIX}"), &["tap0", "tap2"]);
        let primary_api = scratch(&format!("{tag}-p.api"));
        let primary_disk = disk_copy();
        let mut primary = TestVm::restore_base_on(
            &ns,
            ["tap0", "tap1"],
            &primary_disk,
            &["--api-sock", primary_api.to_str().unwrap()],
        );
        primary.remove_on_drop(primary_disk.clone());
        primary.ok(
            "mkfifo /tmp/tick; (exec 3<>/tmp/tick; n=0; while :; do n=$((n+1)); \
             echo $n >> /tmp/count; read -t 1 x <&3; done) &",
            CMD,
        );
        let sock = scratch(&format!("{tag}-colo.sock"));
        let addr = format!("unix:{}", sock.display());
        let lease = scratch(&format!("{tag}-colo.lock"));
        let secondary_api = scratch(&format!("{tag}-s.api"));
        let secondary_disk = disk_copy();
        let mut secondary = secondary(&ns, &addr, &lease, &secondary_api, secondary_disk.clone());
        secondary.remove_on_drop(sock);
        let mut mark = lease.clone().into_os_string();
        mark.push(".alone");
        secondary.remove_on_drop(mark.into());
        secondary.remove_on_drop(lease.clone());
        Pair {
            ns,
            primary,
            primary_api,
            secondary,
            secondary_api,
            secondary_disk,
            primary_disk,
            addr,
            lease,
        }
    }

    /// `colo-start` on the primary, a checkpoint every [`PERIOD_MS`];
    /// returns once it is protected and has committed `checkpoints`
    /// checkpoints.
    fn start(&mut self, checkpoints: u64) {
        self.start_every(PERIOD_MS, checkpoints);
    }

    fn start_every(&mut self, period_ms: &str, checkpoints: u64) {
        self.start_with(period_ms, checkpoints, &[]);
    }

    /// [`Pair::start_every`] with `extra` options for `colo-start`.
    fn start_with(&mut self, period_ms: &str, checkpoints: u64, extra: &[&str]) {
        let mut args = vec![
            "colo-start",
            &self.addr,
            "--checkpoint-period-ms",
            period_ms,
            "--lease",
            self.lease.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let (code, a) = ctl(&self.primary_api, &args);
        assert_eq!(code, 0, "colo-start: {a}");
        self.wait_checkpoints(checkpoints);
    }

    /// A checkpoint now (`colo-checkpoint`), committed on both sides.
    fn checkpoint(&self) -> serde_json::Value {
        checkpoint_now(&self.primary_api, &self.secondary_api)
    }

    fn wait_checkpoints(&self, n: u64) -> serde_json::Value {
        wait_checkpoints(&self.primary_api, n)
    }
}

/// `tandem run --colo secondary` in `ns` on tap2/tap3 and `image` (removed
/// with it), listening on `addr`; returns once it listens.
fn secondary(ns: &NetNs, addr: &str, lease: &Path, api: &Path, image: PathBuf) -> TestVm {
    colo::secondary(ns, ["tap2", "tap3"], (addr, lease, api), image, &[])
}

/// The counting loop's last number (the shell may first report a
/// background job that ended: the last line).
fn count(vm: &mut TestVm) -> u64 {
    let out = vm.ok(LAST_COUNT, CMD);
    let last = out.lines().last().unwrap_or_default().trim();
    last.parse()
        .unwrap_or_else(|e| panic!("a count: {e}: {out:?}"))
}

#[test]
fn the_secondary_takes_over_when_the_primary_dies() {
    let mut pair = Pair::new("colo-a");
    phase("a: primary restored, secondary waiting");
    // A client stream into the guest, through the pair and across the
    // failover.
    let stream = Stream::start(&mut pair.primary, &pair.ns, 5001, 21, THROUGH);
    // Checkpoints when the test asks (`colo-checkpoint`), so that a
    // connection can be opened after the last one before the kill.
    pair.start_every(LONG_PERIOD_MS, 1);
    pair.checkpoint();
    let s = status(&pair.primary_api);
    phase(&format!("a: protected: {s}"));
    let sync = &s["sync"];
    assert_eq!(sync["phase"], "completed", "{s}");
    assert!(s["checkpoints"]["max_pause_ms"].as_f64() > Some(0.0), "{s}");

    // The secondary may not serve while the primary lives: it holds the
    // lease (a cut link with both alive makes no second server).
    let (code, a) = ctl(&pair.secondary_api, &["colo-failover"]);
    assert_eq!(code, 0, "{a}");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(status(&pair.secondary_api)["state"], "protected");
    assert_eq!(status(&pair.primary_api)["state"], "protected");
    phase("a: a forced failover refused while the primary lives");

    // A file written after the pair started reaches the secondary only
    // through a checkpoint.
    pair.primary.ok(
        "dd if=/dev/urandom of=/tmp/colo bs=32768 count=1 2>/dev/null",
        CMD,
    );
    let sum = pair.primary.ok("sha256sum /tmp/colo", CMD);
    phase("a: a file in guest memory");
    // The disk: written, a checkpoint, written again.
    pair.primary.ok(
        "mount -t ext4 /dev/vda /mnt && cp /tmp/colo /mnt/one && sync",
        CMD,
    );
    phase("a: the disk mounted, a file written and synced");
    pair.checkpoint();
    pair.primary.ok("cp /tmp/colo /mnt/two && sync", CMD);
    phase("a: a checkpoint, and a second file");
    let before = count(&mut pair.primary);
    // A connection opened since the last checkpoint (its server listening
    // before it, in both guests): the two guests choose different initial
    // sequence numbers, and the client knows the primary's only.
    let mut epoch = 0;
    let (p_api, s_api) = (pair.primary_api.clone(), pair.secondary_api.clone());
    let late = Stream::start_after(&mut pair.primary, &pair.ns, 5002, 22, LATE, |_| {
        let s = checkpoint_now(&p_api, &s_api);
        epoch = s["epoch"].as_u64().unwrap_or(0);
    });
    phase("a: the files are in a committed checkpoint; a stream opened since");
    assert!(stream.running(), "the stream runs across the failover");
    assert!(late.running(), "the late stream runs across the failover");
    assert_eq!(
        status(&pair.primary_api)["epoch"].as_u64(),
        Some(epoch),
        "no checkpoint since the late stream started"
    );
    pair.primary.kill();
    let killed = Instant::now();
    // A ping every 20 ms from the kill on: only the secondary can answer.
    let pings = pair
        .ns
        .command("ping")
        .args(["-n", "-i", "0.02", "-w", "5", GUEST_IP0])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("ping");
    wait_until("the secondary serves", CMD, || {
        status(&pair.secondary_api)["state"] == "failed_over"
    });
    let took = killed.elapsed();
    let first = first_reply(pings);
    phase(&format!(
        "a: failed over {} ms after the kill; first ping reply ~{} ms after it",
        took.as_millis(),
        first.as_millis()
    ));
    assert!(
        first < HEARTBEAT_TIMEOUT + Duration::from_secs(1),
        "the first reply came {first:?} after the kill"
    );
    wait_until("the secondary says so", CMD, || {
        pair.secondary.stderr().contains("this VM serves now")
    });
    assert!(
        pair.secondary
            .stderr()
            .contains("opened since the last checkpoint keep their sequence numbers"),
        "the late connection's numbers rewritten: {}",
        pair.secondary.stderr()
    );
    let vm = &mut pair.secondary;
    // Its console shows first what its guest printed on from the last
    // checkpoint (the primary's commands' ends): one command to get past.
    vm.number_from(100_000);
    vm.run("true", CMD);
    assert_eq!(vm.ok("sha256sum /tmp/colo", CMD), sum);
    let hash = sum
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    for f in ["/mnt/one", "/mnt/two"] {
        let got = vm.ok(&format!("sha256sum {f}"), CMD);
        assert!(got.starts_with(&hash), "{f} after the failover: {got}");
    }
    vm.ok("echo served-after > /mnt/three && sync && umount /mnt", CMD);
    disk_holds(&pair.secondary_disk, &hash);
    phase("a: the files read back, and the image is clean and holds them");
    let after = count(vm);
    assert!(
        after >= before,
        "the count went back: {before} then {after}"
    );
    wait_until("the counting loop goes on", CMD, || count(vm) > after);
    let out = pair
        .ns
        .command("ping")
        .args(["-c", "3", "-i", "0.2", "-W", "20", GUEST_IP0])
        .output()
        .expect("ping");
    assert!(out.status.success(), "ping the secondary's guest: {out:?}");
    phase("a: the guest counts on and answers pings");
    stream.check(vm);
    late.check(vm);
    let s = status(&pair.secondary_api);
    phase(&format!(
        "a: the secondary's guest serves; both streams arrived whole: {s}"
    ));
}

#[test]
fn the_primary_goes_on_alone_when_the_secondary_dies() {
    let mut pair = Pair::new("colo-b");
    phase("b: primary restored, secondary waiting");
    not_the_same_disk(&pair);
    // A service whose replies differ between the two guests (their own
    // context switch counts and uptimes).
    pair.primary.ok(
        "printf '#!/bin/sh\\ngrep ctxt /proc/stat\\ncat /proc/uptime\\n' > /tmp/reply; \
         chmod +x /tmp/reply; nc -ll -p 5004 -e /tmp/reply & \
         while ! grep -q ':138C ' /proc/net/tcp /proc/net/tcp6; do sleep 0.2; done",
        CMD,
    );
    pair.start(1);
    differing_replies(&pair);
    // A pair refuses what would change the VM under it.
    let (code, a) = ctl(&pair.primary_api, &["pause"]);
    assert_ne!(code, 0, "pause in a pair: {a}");
    let sum = pair.primary.ok("sha256sum /etc/passwd", CMD);

    // A client stream into the guest (its server in both guests: a
    // checkpoint between), through the pair and across the secondary's
    // death.
    let (p_api, s_api) = (pair.primary_api.clone(), pair.secondary_api.clone());
    let stream = Stream::start_after(&mut pair.primary, &pair.ns, 5003, 23, LATE, |_| {
        checkpoint_now(&p_api, &s_api);
    });
    assert!(
        stream.running(),
        "the stream runs across the secondary's death"
    );
    pair.secondary.kill();
    let killed = Instant::now();
    wait_until("the primary goes alone", CMD, || {
        status(&pair.primary_api)["state"] == "primary_alone"
    });
    phase(&format!(
        "b: alone {} ms after the kill",
        killed.elapsed().as_millis()
    ));
    let s = status(&pair.primary_api);
    let epoch = s["epoch"].as_u64().unwrap_or(0);
    // The same report is in the metrics.
    let (_, m) = ctl(&pair.primary_api, &["metrics"]);
    assert_eq!(m["metrics"]["colo"]["state"], "primary_alone", "{m}");
    assert_eq!(m["metrics"]["colo"]["role"], "primary", "{m}");
    let mut mark = pair.lease.clone().into_os_string();
    mark.push(".alone");
    let text = std::fs::read_to_string(PathBuf::from(mark)).expect("the alone mark");
    assert!(
        text.contains(&format!("{}", epoch + 1)),
        "the alone mark {text:?} names epoch {}",
        epoch + 1
    );
    assert_eq!(pair.primary.ok("sha256sum /etc/passwd", CMD), sum);
    let c = count(&mut pair.primary);
    wait_until("the counting loop goes on", CMD, || {
        count(&mut pair.primary) > c
    });
    let (code, a) = ctl(&pair.primary_api, &["pause"]);
    assert_eq!(code, 0, "pause once alone: {a}");
    let (code, a) = ctl(&pair.primary_api, &["resume"]);
    assert_eq!(code, 0, "resume: {a}");
    stream.check(&mut pair.primary);
    phase("b: the primary goes on alone; the stream arrived whole");

    // Protected again by a new secondary on a copy of its image as it is.
    let image = scratch("colo-b-disk3");
    std::fs::copy(&pair.primary_disk, &image).expect("copy the primary's image");
    let sock = scratch("colo-b3.sock");
    let addr = format!("unix:{}", sock.display());
    let api = scratch("colo-b3.api");
    let mut third = secondary(&pair.ns, &addr, &pair.lease, &api, image);
    third.remove_on_drop(sock);
    let (code, a) = ctl(
        &pair.primary_api,
        &["colo-reprotect", &addr, "--checkpoint-period-ms", PERIOD_MS],
    );
    assert_eq!(code, 0, "colo-reprotect: {a}");
    let s = wait_checkpoints(&pair.primary_api, 2);
    assert_eq!(s["role"], "primary", "{s}");
    assert_eq!(status(&api)["state"], "protected");
    // Its NICs went back onto their taps and into the new pair's proxy:
    // the guest answers through the compare.
    pair.ns.must("ping", &["-c", "3", "-W", "5", GUEST_IP0]);
    assert_eq!(pair.primary.ok("sha256sum /etc/passwd", CMD), sum);
    phase("b: the alone primary re-protected; it answers through the new pair");
    bulk_through_the_pair(&mut pair, &api);
}

/// 3 MiB into the guest as fast as a cubic sender goes: both guests run out
/// of receive buffers now and then (a wait the device once never came back
/// from: the driver was not asked to notify), and no frame is dropped
/// inside the pair (one guest getting a frame the other did not costs a
/// mismatch each).
fn bulk_through_the_pair(pair: &mut Pair, secondary_api: &Path) {
    let (p_api, s_api) = (pair.primary_api.clone(), secondary_api.to_path_buf());
    let dropped = |s: &serde_json::Value| s["proxy"]["dropped"].as_u64().unwrap_or(u64::MAX);
    let mismatched = |s: &serde_json::Value| s["compare"]["mismatched"].as_u64().unwrap_or(0);
    let before = [status(&p_api), status(&s_api)];
    let started = Instant::now();
    let bulk = Stream::start_after(&mut pair.primary, &pair.ns, 5007, 27, BULK, |_| {
        checkpoint_now(&p_api, &s_api);
    });
    bulk.check(&mut pair.primary);
    let waits = |api: &Path| {
        let (_, m) = ctl(api, &["metrics"]);
        m["metrics"]["net"][0]["counters"]["no_rx_buffer_waits"].clone()
    };
    let (p, s) = (status(&pair.primary_api), status(secondary_api));
    phase(&format!(
        "b: 3 MiB through the pair in {:.1} s; receive-buffer waits: primary {}, secondary {}; primary's proxy dropped {} \
         (before: {}); compare {}",
        started.elapsed().as_secs_f64(),
        waits(&pair.primary_api),
        waits(secondary_api),
        dropped(&p),
        dropped(&before[0]),
        p["compare"]
    ));
    // The secondary's guest gets every frame the primary's got.
    assert_eq!(
        dropped(&s),
        dropped(&before[1]),
        "the secondary's proxy dropped frames: {}",
        s["proxy"]
    );
    assert_eq!(mismatched(&p), mismatched(&before[0]), "{}", p["compare"]);
}

#[test]
fn the_survivor_is_protected_again_and_survives_a_second_failover() {
    let mut pair = Pair::new("colo-e");
    let stream = Stream::start(&mut pair.primary, &pair.ns, 5001, 51, THROUGH);
    pair.start(1);
    phase("e: protected, a client stream running");
    pair.primary.kill();
    wait_until("the secondary serves", CMD, || {
        status(&pair.secondary_api)["state"] == "failed_over"
    });
    phase("e: the primary killed; the secondary serves");
    // A new secondary on a copy of the survivor's image as it is now, its
    // NIC on the same bridge.
    pair.ns.add_bare_tap("tap4");
    pair.ns
        .must("ip", &["link", "set", "tap4", "master", "br0"]);
    let image = scratch("colo-e-disk");
    std::fs::copy(&pair.secondary_disk, &image).expect("copy the survivor's image");
    let sock = scratch("colo-e2.sock");
    let addr = format!("unix:{}", sock.display());
    let api = scratch("colo-e2.api");
    let mut third = colo::secondary(
        &pair.ns,
        ["tap4", "tap5"],
        (&addr, &pair.lease, &api),
        image,
        &[],
    );
    third.remove_on_drop(sock);
    let (code, a) = ctl(
        &pair.secondary_api,
        &[
            "colo-reprotect",
            &addr,
            "--checkpoint-period-ms",
            PERIOD_MS,
            "--colo-channels",
            "3",
        ],
    );
    assert_eq!(code, 0, "colo-reprotect: {a}");
    // The new pair's checkpoints over 3 page channels: the third VM's
    // state after the second failover came through them.
    let s = wait_checkpoints(&pair.secondary_api, 2);
    assert_eq!(s["role"], "primary", "{s}");
    assert_eq!(s["channels"], 3, "{s}");
    assert_eq!(s["sync"]["phase"], "completed", "{s}");
    assert_eq!(status(&api)["state"], "protected");
    phase("e: the survivor re-protected by a third VM");
    // Refused on a side that does not serve alone.
    let (code, _) = ctl(&pair.secondary_api, &["colo-reprotect", &addr]);
    assert_ne!(code, 0, "a protected side is not re-protected");
    assert!(stream.running(), "the stream runs across both failovers");
    pair.secondary.kill();
    wait_until("the third VM serves", CMD, || {
        status(&api)["state"] == "failed_over"
    });
    phase("e: the survivor killed; the third VM serves");
    third.ok("true", CMD);
    stream.check(&mut third);
    phase("e: the stream arrived whole across both failovers");
}

/// When `ping -i 0.02`'s first reply came, from its sequence number (an
/// upper bound: the process started just after the kill).
fn first_reply(ping: std::process::Child) -> Duration {
    let out = ping.wait_with_output().expect("ping's output");
    let text = String::from_utf8_lossy(&out.stdout);
    let seq = text
        .lines()
        .find_map(|l| l.split("icmp_seq=").nth(1))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no ping reply within 5 s of the kill: {text}"));
    Duration::from_millis(20 * (seq + 1))
}

/// The secondary's image, its guest's disk unmounted after the failover:
/// clean, with the files written before (`hash` each) and after it.
fn disk_holds(image: &Path, hash: &str) {
    let image = image.to_str().expect("a UTF-8 path");
    let tool = |name: &str, args: &[&str]| {
        std::process::Command::new(name)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{name}: {e} (install e2fsprogs)"))
    };
    let fsck = tool("e2fsck", &["-fn", image]);
    assert_eq!(fsck.status.code(), Some(0), "e2fsck -fn: {fsck:?}");
    for f in ["/one", "/two"] {
        let out = tool("debugfs", &["-R", &format!("cat {f}"), image]);
        let got = tandem_tests::hex(&<sha2::Sha256 as sha2::Digest>::digest(&out.stdout));
        assert_eq!(got, hash, "{f} in the image");
    }
    let out = tool("debugfs", &["-R", "cat /three", image]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "served-after");
}

fn signal(vm: &TestVm, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &vm.pid().to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill {sig}");
}

#[test]
fn a_cut_link_never_makes_two_servers() {
    let mut pair = Pair::new("colo-c");
    pair.start(1);
    phase("c: protected");
    signal(&pair.primary, "-STOP");
    wait_until("the secondary misses the primary", CMD, || {
        status(&pair.secondary_api)["state"] == "failing_over"
    });
    // The stopped primary still holds the lease: no takeover.
    std::thread::sleep(Duration::from_secs(2));
    let s = status(&pair.secondary_api);
    assert_eq!(s["state"], "failing_over", "{s}");
    signal(&pair.primary, "-CONT");
    wait_until("the primary goes alone", CMD, || {
        status(&pair.primary_api)["state"] == "primary_alone"
    });
    let s = status(&pair.secondary_api);
    assert_eq!(s["state"], "failing_over", "one server only: {s}");
    pair.primary.ok("true", CMD);
    phase("c: the primary serves alone, the secondary waits");

    // The primary dies: the secondary gets the lease, finds that the
    // primary served past its last checkpoint, and must not serve.
    pair.primary.kill();
    let st = pair.secondary.wait_exit(CMD);
    assert_eq!(st.code(), Some(1), "{}", pair.secondary.stderr());
    assert!(
        pair.secondary.stderr().contains("this secondary retires"),
        "{}",
        pair.secondary.stderr()
    );
    phase("c: the stale secondary retired");
}

/// A secondary whose disk is not the primary's image refuses the pair
/// before it is protected: both sides say why, the secondary exits 1, the
/// primary runs on as before.
fn not_the_same_disk(pair: &Pair) {
    let image = disk_copy();
    let mut bytes = std::fs::read(&image).expect("read the copy");
    bytes[4096] ^= 0xff;
    std::fs::write(&image, bytes).expect("change the copy");
    let addr = format!("unix:{}", scratch("colo-b-wrong.sock").display());
    let lease = scratch("colo-b-wrong.lock");
    let mut wrong = secondary(&pair.ns, &addr, &lease, &scratch("colo-b-w.api"), image);
    wrong.remove_on_drop(lease.clone());
    let (code, a) = ctl(
        &pair.primary_api,
        &["colo-start", &addr, "--lease", lease.to_str().unwrap()],
    );
    assert_eq!(code, 0, "colo-start: {a}");
    let st = wrong.wait_exit(CMD);
    assert_eq!(st.code(), Some(1), "{}", wrong.stderr());
    assert!(
        wrong
            .stderr()
            .contains("disk blk0 is not the primary's image"),
        "{}",
        wrong.stderr()
    );
    let mut s = serde_json::Value::Null;
    wait_until("the primary gives up the pair", CMD, || {
        s = status(&pair.primary_api);
        s["state"] == "retired"
    });
    assert!(
        s["reason"]
            .as_str()
            .unwrap_or("")
            .contains("not the primary's image"),
        "{s}"
    );
    phase("b: a secondary on another disk image is refused");
}

/// Requests to the guest's service whose replies differ between the two
/// guests: each mismatch is a checkpoint, and the client gets each reply
/// whole (the primary's).
fn differing_replies(pair: &Pair) {
    for i in 0..4 {
        let reply = pair
            .ns
            .spawn(|| {
                let mut s = std::net::TcpStream::connect((GUEST_IP0, 5004)).expect("connect");
                s.set_read_timeout(Some(CMD)).expect("timeout");
                let mut text = String::new();
                std::io::Read::read_to_string(&mut s, &mut text).expect("the reply");
                text
            })
            .join()
            .expect("the client");
        let lines: Vec<&str> = reply.lines().collect();
        let whole = lines.len() == 2
            && lines[0].starts_with("ctxt ")
            && lines[1].split_whitespace().count() == 2;
        assert!(whole, "reply {i}: {reply:?}");
    }
    let s = status(&pair.primary_api);
    phase(&format!("b: differing replies: {}", s["compare"]));
    assert!(s["compare"]["mismatched"].as_u64() >= Some(1), "{s}");
    assert!(
        s["checkpoints"]["by_reason"]["mismatch"].as_u64() >= Some(1),
        "{s}"
    );
}

/// A stream for the long test: 4 MiB, 16 KiB every 750 ms (some 3 min 12 s).
const LONG: Pace = Pace {
    bytes: 4 << 20,
    piece: 16 << 10,
    every: Duration::from_millis(750),
};

/// Checkpoints every 2 s for over 3 minutes while a client's stream runs
/// through the pair: no hang (every checkpoint committed, none abandoned,
/// the pair still protected, the console answers) and no lost byte.
#[test]
fn three_minutes_of_checkpoints_with_traffic() {
    let mut pair = Pair::new("colo-d");
    let stream = Stream::start(&mut pair.primary, &pair.ns, 5005, 33, LONG);
    // The pages of each checkpoint over 4 channels at once.
    pair.start_with(PERIOD_MS, 1, &["--colo-channels", "4"]);
    let t = Instant::now();
    phase("d: protected (4 page channels), the stream runs");
    while stream.running() {
        assert!(t.elapsed() < Duration::from_secs(600), "the stream hangs");
        std::thread::sleep(Duration::from_secs(5));
    }
    let took = t.elapsed();
    let s = status(&pair.primary_api);
    phase(&format!(
        "d: the stream took {:.0} s: {}",
        took.as_secs_f64(),
        s["checkpoints"]
    ));
    assert!(took > Duration::from_secs(180), "{took:?}");
    assert_eq!(s["state"], "protected", "{s}");
    assert_eq!(s["checkpoints"]["abandoned"], 0, "{s}");
    let total = s["checkpoints"]["total"].as_u64().unwrap_or(0);
    assert!(total >= 80, "{total} checkpoints in {took:?}");
    let s2 = status(&pair.secondary_api);
    assert_eq!(s2["state"], "protected");
    assert_eq!(
        (s["channels"].as_u64(), s2["channels"].as_u64()),
        (Some(4), Some(4))
    );
    assert!(s2["applied_pages"].as_u64() > Some(0), "{s2}");
    stream.check(&mut pair.primary);
}

//! Live migration between tandem processes on this machine, on a real
//! guest (the run's base snapshot, restored; no boot). The guest's first
//! NIC sits on a bridge in the test's namespace with the source's tap and
//! the destination's, and the host's address is on the bridge, so the host
//! reaches the guest wherever it runs.
//!
//! The guest runs `tandem-dirty` rewriting 32 MiB at a fixed rate,
//! `tandem-jitter` reporting its gaps to the host, and a counting loop.
//! First, migrations that fail: a destination with the wrong memory size
//! (refused before any memory moves), one killed mid-stream, a TCP stream
//! cut half-way by a forwarder, one of three streams (`--connections 3`)
//! cut in the first round, a cancel in `--mode inline`, one that
//! cannot converge in its time limit (`--downtime-ms 1 --auto-converge off
//! --timeout-s 20`); after each the source's guest runs on, unchanged, and
//! its VMM says so. Then the dirtying guest migrates (Unix socket, three
//! streams, with the jitter probe and its plot, at 8 MiB/s: it dirties
//! faster than half of that, so auto-converge must throttle it for the
//! migration to end) while a TCP stream from the host runs into it: the
//! source exits 0 saying where the guest went; at the destination the
//! console answers, a memory-resident file has its old checksum, every page
//! `tandem-dirty` rewrote holds its last write, the counting loop goes on,
//! the stream arrived whole, the guest answers pings through the bridge
//! (which learnt its new port from the self-announce), and the disk image,
//! handed over at the switch-over, reads back what the guest synced before.
//!
//! Beside it (the other test thread, its own namespace), an idle guest
//! moves twice: in `--mode inline` over TCP (its dirty log write-protecting
//! all of memory at the start, `--initially-set off`; every other
//! migration here starts it all dirty), then on from that destination
//! to a third tandem in the default thread mode, with a TCP stream running
//! across both moves, the disk handed over twice, and the CMOS RTC the
//! guest set a day ahead still a day ahead at the end (its state moved).

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tandem_tests::base::{device_args, disk_copy, BASE_MEM, GUEST_IP0, HOST_IP0, PREFIX};
use tandem_tests::netns::NetNs;
use tandem_tests::pki::Pki;
use tandem_tests::rtc;
use tandem_tests::stream::{Pace, Stream};
use tandem_tests::{ctl, migrate, migrate_cmd, phase, tandem_bin, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
/// The counting loop's last count, read with shell builtins only (a new
/// process beside a busy one is at risk on this host: design.md §9).
const LAST_COUNT: &str = "while read l; do n=$l; done < /tmp/count; echo $n";
/// Where the guest's `tandem-jitter` sends its gaps (the probe listens).
const JITTER_PORT: u16 = 7777;

fn scratch(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tandem-{what}-{}", std::process::id()))
}

/// `tandem run --incoming ADDR --api-sock API` in `ns` with the base
/// guest's devices on `taps` and `disk`, and `--mem mem`.
fn destination(
    ns: &NetNs,
    incoming: &str,
    api: &Path,
    taps: [&str; 2],
    disk: &Path,
    mem: &str,
) -> TestVm {
    destination_with(ns, incoming, api, taps, disk, mem, &[])
}

/// [`destination`], with `extra` options (e.g. TLS files).
fn destination_with(
    ns: &NetNs,
    incoming: &str,
    api: &Path,
    taps: [&str; 2],
    disk: &Path,
    mem: &str,
    extra: &[String],
) -> TestVm {
    let mut args: Vec<String> = vec![
        "--incoming".into(),
        incoming.into(),
        "--mem".into(),
        mem.into(),
        "--api-sock".into(),
        api.display().to_string(),
    ];
    args.extend(device_args(taps, disk));
    args.extend_from_slice(extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut vm = TestVm::start_with(ns.command(tandem_bin().to_str().unwrap()), &args);
    // The line is on stderr (the console is the guest's, once it runs).
    let t = Instant::now();
    while !vm.stderr().contains("waiting for a migration on") {
        assert!(
            t.elapsed() < CMD && vm.running(),
            "the destination did not listen: {}",
            vm.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    vm
}

fn unix(sock: &Path) -> String {
    format!("unix:{}", sock.display())
}

/// The source of a test: namespace `tag` with a bridge holding the host's
/// address and the taps `bridged` (the source's eth0 is tap0), the base
/// guest restored there with an API socket, and the disk image every end
/// uses (one at a time: it is handed over), removed with the source.
fn source(tag: &str, bridged: &[&str]) -> (NetNs, PathBuf, PathBuf, TestVm) {
    source_with(tag, bridged, &[])
}

/// [`source`], with `extra` options for `tandem run`.
fn source_with(tag: &str, bridged: &[&str], extra: &[&str]) -> (NetNs, PathBuf, PathBuf, TestVm) {
    let api = scratch(&format!("{tag}-src.sock"));
    let ns = NetNs::new(tag);
    ns.add_bridge("br0", &format!("{HOST_IP0}/{PREFIX}"), bridged);
    let image = disk_copy();
    let mut args = vec!["--api-sock", api.to_str().unwrap()];
    args.extend_from_slice(extra);
    let mut src = TestVm::restore_base_on(&ns, ["tap0", "tap1"], &image, &args);
    src.remove_on_drop(image.clone());
    (ns, api, image, src)
}

/// A migration that completed (`tandem ctl migrate` exit status 0).
fn assert_completed(code: i32, report: &serde_json::Value) {
    assert_eq!(
        (code, report["phase"].as_str()),
        (0, Some("completed")),
        "{report}"
    );
}

#[test]
fn a_running_guest_moves_to_another_tandem() {
    let (ns, api, image, mut src) = source("migrate", &["tap0", "tap4"]);

    // A file in tmpfs (guest memory) and loops that dirty memory from user
    // space (native speed here) while the migrations run.
    phase("restored");
    vm_prepare(&mut src);
    phase("prepared");
    let sum = src.ok("sha256sum /tmp/m", CMD);
    failed_migrations(&ns, &api, &mut src, &sum);
    phase("failures done");
    dirtying_migration(&ns, &api, src, &image, &sum);
    phase("dirtying migration done");
}

/// The idle guest's stream: 512 KiB, 16 KiB every 400 ms (some 13 s),
/// so that it runs across the first move at least.
const IDLE: Pace = Pace {
    bytes: 512 << 10,
    piece: 16 << 10,
    every: Duration::from_millis(400),
};

/// Where the idle guest sets its CMOS RTC before it moves: a day ahead.
const RTC_AHEAD_S: i64 = 86_400;

/// An idle guest (a file in memory, the counting loop, its RTC set a day
/// ahead, nothing dirtying)
/// moves in `--mode inline` over TCP, then on from that destination to a
/// third tandem in thread mode over a Unix socket: each move completes,
/// each VMM it left exits 0, and the guest goes on at each destination;
/// a TCP stream started before the first move arrives whole at the last,
/// the RTC is still a day ahead of the host's clock there, and the disk is
/// handed over twice.
#[test]
fn an_idle_guest_moves_twice() {
    // Every tandem here has a TLS identity from one CA, naming 127.0.0.1.
    let pki = Pki::new("migidle", &["127.0.0.1"]);
    let tls = pki.args();
    let tls_ref: Vec<&str> = tls.iter().map(String::as_str).collect();
    let (ns, api, image, mut src) = source_with("migidle", &["tap0", "tap2", "tap4"], &tls_ref);
    write_file(&mut src);
    start_counting(&mut src);
    rtc::set_ahead(&mut src, RTC_AHEAD_S);
    let sum = src.ok("sha256sum /tmp/m", CMD);
    phase("idle: prepared");
    plain_off_host_refused();

    // First move: inline, over TLS on TCP (loopback in the test's
    // namespace), after peers without the right certificate are refused.
    let api1 = scratch("idle-1.api");
    let mut first = destination_with(
        &ns,
        "tcp:127.0.0.1:4421",
        &api1,
        ["tap2", "tap3"],
        &image,
        BASE_MEM,
        &tls,
    );
    intruders_refused(&ns, &pki, &mut first, "127.0.0.1:4421");
    wrong_destination_refused(&ns, &api, &mut src, &image, &sum);
    let stream = Stream::start(&mut src, &ns, 5002, 12, IDLE);
    // This one write-protects all of memory at the start of its dirty log
    // (`--initially-set off`); the others start it all dirty.
    let (code, report) = migrate(
        &ns,
        &api,
        "tcp:127.0.0.1:4421",
        &["--mode", "inline", "--initially-set", "off"],
    );
    phase("idle: moved inline");
    eprintln!("inline migration over TLS: {report}");
    assert_completed(code, &report);
    assert!(first.stderr().contains("refused"), "{}", first.stderr());
    assert!(stream.running(), "the stream runs across the first move");
    check_report(&report, "inline", false);
    source_gone(&mut src, "migrated to tcp:127.0.0.1:4421");
    guest_goes_on(&mut first, &sum);

    // Second move, from the first destination: thread mode, Unix socket.
    let sock2 = scratch("idle-2.sock");
    let mut second = destination(
        &ns,
        &unix(&sock2),
        &scratch("idle-2.api"),
        ["tap4", "tap5"],
        &image,
        BASE_MEM,
    );
    let streaming = stream.running();
    let (code, report) = migrate(&ns, &api1, &unix(&sock2), &[]);
    phase(&format!(
        "idle: moved again (the stream {} running)",
        if streaming { "still" } else { "no longer" }
    ));
    eprintln!("chained migration: {report}");
    assert_completed(code, &report);
    check_report(&report, "thread", true);
    source_gone(&mut first, "migrated to unix:");
    guest_goes_on(&mut second, &sum);
    let ahead = RTC_AHEAD_S as f64;
    rtc::assert_offset(&mut second, ahead - 3.0, ahead, "after two moves");
    stream.check(&mut second);
    ping(&ns);
    phase("idle: the guest goes on after two moves");
}

/// Without a TLS identity, a listener off this host is refused at start
/// (no guest is built), naming the options to give.
fn plain_off_host_refused() {
    let out =
        tandem_tests::tandem_output(&["run", "--incoming", "tcp:0.0.0.0:4499", "--mem", BASE_MEM]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--tls-cert") && err.contains("--insecure"),
        "{err}"
    );
}

/// Peers of a TLS destination at `addr` without a certificate its CA
/// signed: a plain TCP client writing a migration's first bytes, and a TLS
/// client whose certificate another CA signed. Each is refused before a
/// byte of VM state is read (the destination says so and still waits: its
/// guest has not run), so the real source can come after them.
fn intruders_refused(ns: &NetNs, pki: &Pki, dst: &mut TestVm, addr: &str) {
    let (host, port) = addr.split_once(':').expect("HOST:PORT");
    let mut plain = ns
        .command("bash")
        .args([
            "-c",
            &format!("exec 3<>/dev/tcp/{host}/{port}; printf 'a plain migration' >&3; sleep 1"),
        ])
        .spawn()
        .expect("a plain TCP client");
    let _ = plain.wait();
    let alien = Pki::new("alien", &["127.0.0.1"]);
    let out = ns
        .command("bash")
        .args([
            "-c",
            &format!(
                "(echo intruder; sleep 1) | timeout 20 openssl s_client -quiet -connect {addr} \
                 -cert {} -key {} -CAfile {} 2>&1",
                alien.file("host.pem"),
                alien.file("host.key"),
                pki.file("ca.pem")
            ),
        ])
        .output()
        .expect("openssl s_client");
    eprintln!(
        "alien TLS client: {}",
        String::from_utf8_lossy(&out.stdout).trim()
    );
    let t = Instant::now();
    while dst.stderr().matches("refused").count() < 2 {
        assert!(t.elapsed() < CMD, "intruders not refused: {}", dst.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    let err = dst.stderr();
    assert!(err.contains("still waiting"), "{err}");
    assert!(!err.contains("incoming migration:"), "{err}");
    assert!(dst.running(), "{err}");
    phase(&format!(
        "idle: intruders refused: {}",
        tandem_tests::tail(&err, 400)
    ));
}

/// A destination whose certificate another CA signed: the source refuses
/// it in the handshake, the migration fails, the guest runs on.
fn wrong_destination_refused(ns: &NetNs, api: &Path, src: &mut TestVm, image: &Path, sum: &str) {
    let alien = Pki::new("alien-dst", &["127.0.0.1"]);
    let mut impostor = destination_with(
        ns,
        "tcp:127.0.0.1:4423",
        &scratch("idle-impostor.api"),
        ["tap4", "tap5"],
        image,
        BASE_MEM,
        &alien.args(),
    );
    let (code, report) = migrate(ns, api, "tcp:127.0.0.1:4423", &[]);
    eprintln!("to an impostor: {report}");
    assert_ne!(code, 0, "{report}");
    assert_eq!(report["phase"], "failed", "{report}");
    assert!(
        report["error"]
            .as_str()
            .is_some_and(|e| e.contains("certificate")),
        "{report}"
    );
    impostor.kill();
    assert_eq!(src.ok("sha256sum /tmp/m", CMD), sum);
    phase("idle: an impostor destination refused; the guest runs on");
}

/// Migrations that fail, each leaving the source's guest running.
fn failed_migrations(ns: &NetNs, api: &Path, src: &mut TestVm, sum: &str) {
    // A destination that is not this VM (other memory size): refused before
    // any memory moves; the guest runs on at the source.
    let wrong_sock = scratch("mig-wrong.sock");
    let wrong_disk = disk_copy();
    let wrong_api = scratch("mig-wrong.api");
    let mut wrong = destination(
        ns,
        &unix(&wrong_sock),
        &wrong_api,
        ["tap2", "tap3"],
        &wrong_disk,
        "256M",
    );
    wrong.remove_on_drop(wrong_disk);
    let (code, report) = migrate(ns, api, &unix(&wrong_sock), &[]);
    assert_eq!(code, 1, "{report}");
    assert_eq!(report["phase"], "failed", "{report}");
    let error = report["error"].as_str().unwrap_or("");
    assert!(
        error.contains("MiB"),
        "the refusal names the memory size: {report}"
    );
    let st = wrong.wait_exit(CMD);
    assert_eq!(st.code(), Some(1), "{}", wrong.stderr());
    assert!(
        wrong.stderr().contains("incoming migration"),
        "{}",
        wrong.stderr()
    );
    still_running(src, api, sum, 1);

    // A destination killed mid-stream.
    let slow = ["--bandwidth", "4"];
    let (report, mut dst) = migrate_while(ns, api, &slow, TestVm::kill);
    assert_error(&report, "migration stream");
    dst.wait_exit(CMD);
    still_running(src, api, sum, 2);
    cut_stream(ns, api, src, sum);
    cut_lane(ns, api, src, sum, 4);
    // The cancel in --mode inline: its slices run from the device loop's
    // turns, and the guest (and its devices) run on.
    let inline = ["--bandwidth", "4", "--mode", "inline"];
    let (report, mut dst) = migrate_while(ns, api, &inline, |_| {
        let (code, a) = ctl(api, &["migrate-cancel"]);
        assert_eq!(code, 0, "{a}");
    });
    assert_eq!(report["phase"], "cancelled", "{report}");
    assert_eq!(report["params"]["mode"], "inline", "{report}");
    assert!(
        report["pages"].as_u64().unwrap_or(0) > 0,
        "it sent: {report}"
    );
    assert_eq!(dst.wait_exit(CMD).code(), Some(1), "{}", dst.stderr());
    still_running(src, api, sum, 5);
    hopeless(ns, api, src, sum);
}

fn assert_error(report: &serde_json::Value, part: &str) {
    assert!(
        report["error"].as_str().unwrap_or("").contains(part),
        "the error says {part:?}: {report}"
    );
}

/// A migration over TCP through a forwarder that cuts the stream after
/// 8 MiB: the source's guest runs on, the destination ends with status 1.
fn cut_stream(ns: &NetNs, api: &Path, src: &mut TestVm, sum: &str) {
    const CUT_AFTER: u64 = 8 << 20;
    let disk = disk_copy();
    let dst_api = scratch("mig-cut.api");
    let mut dst = destination(
        ns,
        "tcp:127.0.0.1:4411",
        &dst_api,
        ["tap2", "tap3"],
        &disk,
        BASE_MEM,
    );
    dst.remove_on_drop(disk);
    let proxy = cutting_proxy(ns, 4412, 4411, CUT_AFTER);
    let (code, report) = migrate(ns, api, "tcp:127.0.0.1:4412", &[]);
    eprintln!("cut migration: {report}");
    assert_eq!(
        (code, report["phase"].as_str()),
        (1, Some("failed")),
        "{report}"
    );
    assert_error(&report, "migration stream");
    assert_eq!(proxy.join().expect("the forwarder"), CUT_AFTER);
    assert_eq!(dst.wait_exit(CMD).code(), Some(1), "{}", dst.stderr());
    still_running(src, api, sum, 3);
}

/// Forwards one connection on 127.0.0.1:`port` (in `ns`) to `to`, passing
/// `limit` bytes towards it, then cuts both ways; returns what it passed.
fn cutting_proxy(ns: &NetNs, port: u16, to: u16, limit: u64) -> JoinHandle<u64> {
    cutting_proxy_of(ns, port, to, limit, 1, 0)
}

/// Forwards the first `n` connections on 127.0.0.1:`port` (in `ns`) to
/// `to`, each whole except connection `cut` (0: the first made), which
/// passes `limit` bytes towards `to` and is then cut both ways; returns
/// what that one passed.
fn cutting_proxy_of(
    ns: &NetNs,
    port: u16,
    to: u16,
    limit: u64,
    n: usize,
    cut: usize,
) -> JoinHandle<u64> {
    let (ready, listening) = std::sync::mpsc::channel();
    let proxy = ns.spawn(move || {
        let l = TcpListener::bind(("127.0.0.1", port)).expect("the forwarder's port");
        ready.send(()).expect("the test waits");
        let mut cut_one = None;
        for i in 0..n {
            let (from, _) = l.accept().expect("the source connects");
            let onto = TcpStream::connect(("127.0.0.1", to)).expect("the destination");
            let (mut back_from, mut back_to) =
                (onto.try_clone().unwrap(), from.try_clone().unwrap());
            std::thread::spawn(move || std::io::copy(&mut back_from, &mut back_to));
            let passing = if i == cut { limit } else { u64::MAX };
            let forward = std::thread::spawn(move || {
                let (mut from, mut onto) = (from, onto);
                let passed = std::io::copy(&mut (&mut from).take(passing), &mut onto);
                let _ = from.shutdown(std::net::Shutdown::Both);
                let _ = onto.shutdown(std::net::Shutdown::Both);
                passed.unwrap_or(0)
            });
            if i == cut {
                cut_one = Some(forward);
            }
        }
        cut_one.map_or(0, |f| f.join().expect("the forwarder"))
    });
    listening
        .recv_timeout(Duration::from_secs(10))
        .expect("the forwarder listens");
    proxy
}

/// A migration over three streams (`--connections 3`) through a forwarder
/// that cuts the third (stream 2; the main one is 0) after 8 MiB, in the
/// first round: the source's guest runs on and its report names the
/// stream; the destination ends with status 1, saying the same.
fn cut_lane(ns: &NetNs, api: &Path, src: &mut TestVm, sum: &str, failures: usize) {
    const CUT_AFTER: u64 = 8 << 20;
    let disk = disk_copy();
    let mut dst = destination(
        ns,
        "tcp:127.0.0.1:4413",
        &scratch("mig-cut-lane.api"),
        ["tap2", "tap3"],
        &disk,
        BASE_MEM,
    );
    dst.remove_on_drop(disk);
    let proxy = cutting_proxy_of(ns, 4414, 4413, CUT_AFTER, 3, 2);
    let (code, report) = migrate(ns, api, "tcp:127.0.0.1:4414", &["--connections", "3"]);
    eprintln!("migration with a stream cut: {report}");
    assert_eq!(
        (code, report["phase"].as_str()),
        (1, Some("failed")),
        "{report}"
    );
    assert_error(&report, "stream 2 of 3");
    assert_eq!(proxy.join().expect("the forwarder"), CUT_AFTER);
    assert_eq!(dst.wait_exit(CMD).code(), Some(1), "{}", dst.stderr());
    let err = dst.stderr();
    let said: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("incoming migration"))
        .collect();
    assert!(
        said.len() == 1 && said[0].contains("stream 2 of 3"),
        "one line naming the stream: {err}"
    );
    still_running(src, api, sum, failures);
}

/// One that cannot converge: a 1 ms budget without auto-converge, sent
/// at 2 MiB/s, where one page takes 2 ms: however few pages a round finds
/// dirty, the last copy would be over the budget, so it ends at its time
/// limit. (At full speed it can converge: this host's vCPUs get stalls of
/// tens of ms, so every guest's dirtying has quiet windows in which a
/// round finds a handful of pages, and 30 pages fit in 1 ms.)
fn hopeless(ns: &NetNs, api: &Path, src: &mut TestVm, sum: &str) {
    let opts = [
        "--downtime-ms",
        "1",
        "--auto-converge",
        "off",
        "--timeout-s",
        "20",
        "--bandwidth",
        "2",
    ];
    let t = Instant::now();
    let (report, mut dst) = migrate_while(ns, api, &opts, |_| {});
    let took = t.elapsed();
    assert_error(&report, "not done after 20 s");
    assert!(
        took >= Duration::from_secs(20) && took < Duration::from_secs(40),
        "the time limit held: {took:?}"
    );
    assert_eq!(report["throttle"], 0, "auto-converge was off: {report}");
    assert_eq!(dst.wait_exit(CMD).code(), Some(1), "{}", dst.stderr());
    still_running(src, api, sum, 6);
}

/// The dirtying guest (`tandem-dirty` at 16 MiB/s) moves over a Unix
/// socket at 8 MiB/s (`--bandwidth`), with auto-converge (the default):
/// the guest dirties faster than half the send rate, so the migration
/// ends only once the throttle has slowed it down. With the jitter probe,
/// a plot, and a TCP stream into it; the disk mounted and a file synced
/// to it before.
fn dirtying_migration(ns: &NetNs, api: &Path, mut src: TestVm, image: &Path, sum: &str) {
    src.ok(
        "mount -t ext4 /dev/vda /mnt && cp /tmp/m /mnt/m && sync",
        CMD,
    );
    let sock = scratch("mig-dst.sock");
    let dst_api = scratch("mig-dst.api");
    let mut dst = destination(
        ns,
        &unix(&sock),
        &dst_api,
        ["tap4", "tap5"],
        image,
        BASE_MEM,
    );
    // Empty until the guest arrives: it cannot be run or saved.
    for verb in [&["resume"][..], &["snapshot", "/tmp/tandem-mig-none.snap"]] {
        let (code, a) = ctl(&dst_api, verb);
        assert_eq!(code, 1, "{a}");
        assert_error(&a, "waits for an incoming migration");
    }
    let stream = Stream::start(&mut src, ns, 5001, 11, LOADED);
    let plot = std::env::temp_dir().join(format!("tandem-mig-plot-{}.png", std::process::id()));
    // Every 50 ms: each echo costs the emulated guest kernel milliseconds
    // here, and 100 a second would load the guest more than the migration.
    let probe = [
        "--connections",
        "3",
        "--bandwidth",
        "8",
        "--probe",
        GUEST_IP0,
        "--probe-interval-ms",
        "50",
        "--plot",
        plot.to_str().unwrap(),
    ];
    phase("dirtying: set up");
    let (code, report) = migrate(ns, api, &unix(&sock), &probe);
    phase("dirtying: migrated");
    eprintln!("migration: {report}");
    assert_completed(code, &report);
    check_report(&report, "thread", true);
    assert_eq!(report["params"]["connections"], 3, "{report}");
    assert!(
        report["throttle"].as_u64().unwrap_or(0) > 0,
        "auto-converge throttled the guest (it dirties 16 MiB/s, sending is capped at 8): {report}"
    );
    check_probe(&report, &plot);
    source_gone(&mut src, "migrated to unix:");
    guest_goes_on(&mut dst, sum);
    // Its 32 MiB, rewritten through every round over three streams: each
    // page holds the last counter the guest gave it (an older copy of a
    // page delivered after a newer one would show here).
    let dirty = dst.ok("kill %1; wait %1; cat /tmp/dirty.out", CMD);
    assert!(dirty.contains("every page holds its last write"), "{dirty}");
    phase("dirtying: the guest goes on");
    stream.check(&mut dst);
    phase("dirtying: the stream arrived");
    disk_and_network(&mut dst, ns, sum);
    dst.remove_on_drop(image.to_path_buf());
}

/// The report of a completed migration in `mode`, its dirty log started
/// all dirty (`KVM_DIRTY_LOG_INITIALLY_SET`: this host's KVM offers it) or
/// all write-protected at once.
fn check_report(report: &serde_json::Value, mode: &str, all_dirty: bool) {
    assert_eq!(report["params"]["mode"], mode, "{report}");
    assert_eq!(report["log_all_dirty"], all_dirty, "{report}");
    assert!(report["log_start_ms"].as_f64().is_some(), "{report}");
    let pages = report["pages"].as_u64().unwrap_or(0);
    assert!(
        pages >= 32768,
        "all of guest RAM was sent at least once: {report}"
    );
    assert!(report["zero_pages"].as_u64().unwrap_or(0) > 0, "{report}");
    let downtime = report["downtime_ms"].as_f64().unwrap_or(f64::NAN);
    assert!(downtime > 0.0, "the downtime was measured: {report}");
}

/// The probe saw the guest before and during the migration, and drew it.
fn check_probe(report: &serde_json::Value, plot: &Path) {
    let p = &report["probe"];
    assert!(p["warning"].is_null(), "{p}");
    for w in ["before", "during"] {
        let s = &p["summary"][w];
        assert!(s["pings"].as_u64().unwrap_or(0) > 0, "{w}: {p}");
        assert!(s["max_gap_ms"].as_f64().is_some(), "{w}: {p}");
    }
    let before = &p["summary"]["before"];
    assert!(before["rtt_avg_ms"].as_f64().is_some(), "replies: {p}");
    assert!(
        before["reports"].as_u64().unwrap_or(0) >= 10,
        "tandem-jitter reported: {p}"
    );
    assert!(p["text"].as_str().unwrap_or("").contains("max gap"), "{p}");
    let png = std::fs::read(plot).expect("the plot was written");
    let _ = std::fs::remove_file(plot);
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n"),
        "a PNG: {} bytes",
        png.len()
    );
}

/// The source exited 0 and said where the guest went.
fn source_gone(src: &mut TestVm, said: &str) {
    let st = src.wait_exit(CMD);
    assert_eq!(st.code(), Some(0), "{}", src.stderr());
    assert!(src.stderr().contains(said), "{}", src.stderr());
}

/// The guest runs at the destination, as it was: the console answers, the
/// file in memory is unchanged, the counting loop counts on.
fn guest_goes_on(dst: &mut TestVm, sum: &str) {
    dst.ok("true", CMD);
    assert_eq!(dst.ok("sha256sum /tmp/m", CMD), sum);
    let before = dst.ok(LAST_COUNT, CMD);
    let t = Instant::now();
    while dst.ok(LAST_COUNT, CMD) == before {
        assert!(
            t.elapsed() < CMD,
            "the counting loop runs on at the destination"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The disk is the destination's now: what the guest synced reads back
/// from the image (the guest's page cache dropped), and it writes; and the
/// guest answers pings through the bridge.
fn disk_and_network(dst: &mut TestVm, ns: &NetNs, sum: &str) {
    dst.ok("echo 3 > /proc/sys/vm/drop_caches", CMD);
    let on_disk = dst.ok("sha256sum /mnt/m", CMD);
    assert_eq!(on_disk.replace("/mnt/m", "/tmp/m"), sum);
    dst.ok("echo after > /mnt/after && sync", CMD);
    ping(ns);
}

fn ping(ns: &NetNs) {
    let out = ns
        .command("ping")
        .args(["-c", "3", "-i", "0.2", "-W", "20", GUEST_IP0])
        .output()
        .expect("ping");
    assert!(out.status.success(), "ping the migrated guest: {out:?}");
}

/// The dirtying guest's stream: 512 KiB, 64 KiB every 100 ms. That guest
/// (tandem-jitter's 1 ms loop, tandem-dirty, the probe's pings, all on one
/// vCPU whose kernel is emulated here) takes in some 14 KiB/s, on the
/// source as at the destination, so the stream lasts well past the move.
const LOADED: Pace = Pace {
    bytes: 512 << 10,
    piece: 64 << 10,
    every: Duration::from_millis(100),
};

/// Starts a destination and `tandem ctl migrate` to it with `opts`, lets
/// it run a second, calls `meanwhile` with the destination, and returns the
/// failed migration's report and the destination.
fn migrate_while(
    ns: &NetNs,
    api: &Path,
    opts: &[&str],
    meanwhile: impl FnOnce(&mut TestVm),
) -> (serde_json::Value, TestVm) {
    let sock = scratch("mig-fail.sock");
    let disk = disk_copy();
    let dst_api = scratch("mig-fail.api");
    let mut dst = destination(
        ns,
        &unix(&sock),
        &dst_api,
        ["tap2", "tap3"],
        &disk,
        BASE_MEM,
    );
    dst.remove_on_drop(disk);
    let follower = migrate_cmd(ns, api, &unix(&sock), opts)
        .spawn()
        .expect("tandem ctl migrate");
    std::thread::sleep(Duration::from_secs(1));
    meanwhile(&mut dst);
    let out = follower.wait_with_output().expect("tandem ctl migrate");
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    eprintln!("failed migration ({opts:?}): {report}");
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert_ne!(report["phase"], "completed", "{report}");
    (report, dst)
}

/// The source's guest runs and answers, its file unchanged, and the dirty
/// log is off again; its VMM said so for the `failures`-th time.
fn still_running(src: &mut TestVm, api: &Path, sum: &str, failures: usize) {
    let (code, a) = ctl(api, &["status"]);
    assert_eq!((code, a["state"].as_str()), (0, Some("running")), "{a}");
    assert_eq!(src.ok("sha256sum /tmp/m", CMD), sum);
    let (_, a) = ctl(api, &["dirty-log", "read"]);
    assert_eq!(a["error"], "the dirty log is off (dirty_log start)", "{a}");
    let t = Instant::now();
    while src.stderr().matches("; the guest runs on here").count() < failures {
        assert!(
            t.elapsed() < CMD,
            "the source's VMM said so: {}",
            src.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    phase(&format!("failure {failures}: the source's guest runs on"));
}

/// Writes /tmp/m (about 1 MiB of pseudo-random text, in 64 writes: each
/// syscall is costly here) and starts `tandem-dirty` rewriting 32 MiB at
/// 16 MiB/s (job 1; its first touch of each page is a page fault in the
/// emulated kernel here, some 30 s for 32 MiB: alone, and waited for),
/// then `tandem-jitter` reporting to the host (job 2) and a counting loop
/// that appends the number of each second to /tmp/count (job 3; shell
/// builtins only, `read -t` on a FIFO nobody writes is the sleep: the
/// guest has one vCPU, which a busy loop would take from the shell).
fn vm_prepare(vm: &mut TestVm) {
    write_file(vm);
    eprintln!("{}", vm.start_dirty(32, 16));
    vm.ok(
        &format!("tandem-jitter {HOST_IP0}:{JITTER_PORT} > /tmp/jitter.out &"),
        CMD,
    );
    start_counting(vm);
}

/// Writes /tmp/m: about 1 MiB of pseudo-random text, in 64 writes.
fn write_file(vm: &mut TestVm) {
    vm.ok(
        "awk 'BEGIN{srand(3); for(i=0;i<2048;i++) s=s sprintf(\"%08x\", rand()*2147483648); \
         for(j=0;j<64;j++) printf \"%d%s\", j, s}' > /tmp/m",
        CMD,
    );
}

/// The counting loop (see [`vm_prepare`]).
fn start_counting(vm: &mut TestVm) {
    vm.ok(
        "mkfifo /tmp/tick; (exec 3<>/tmp/tick; n=0; while :; do n=$((n+1)); \
         echo $n >> /tmp/count; read -t 1 x <&3; done) &",
        CMD,
    );
}

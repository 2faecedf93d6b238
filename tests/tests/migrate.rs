//! Live migration between two tandem processes on this machine, on a real
//! guest (the run's base snapshot, restored; no boot): the source's guest
//! dirties memory natively while `tandem ctl migrate` sends it over a Unix
//! socket to `tandem run --incoming`. The guest's first NIC sits on a
//! bridge in the test's namespace with the source's tap and the
//! destination's, and the host's address is on the bridge, so the host
//! reaches the guest wherever it runs.
//!
//! First, migrations that fail: a destination with the wrong memory size
//! (refused before any memory moves), a destination killed mid-stream, one
//! that cannot converge in its time limit, a cancel; after each the
//! source's guest runs on. Then one that completes while a TCP stream from
//! the host runs into the guest: the source exits 0 saying where the guest
//! went; at the destination the console answers, a memory-resident file
//! has the checksum it had before, the dirtying loop still runs, the
//! stream arrived whole, the guest answers pings through the bridge
//! (which learnt its new port from the destination's self-announce), and
//! the disk image, handed over at the switch-over (the source releases its
//! lock, the destination takes it), reads back what the guest synced at
//! the source and takes writes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use std::io::{Read, Write};
use std::net::TcpStream;

use sha2::{Digest, Sha256};
use tandem_tests::base::{device_args, disk_copy, BASE_MEM, GUEST_IP0, HOST_IP0, PREFIX};
use tandem_tests::netns::NetNs;
use tandem_tests::{ctl, hex, pseudo_random, tandem_bin, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
/// The dirtying loop's last count, read with shell builtins only (a new
/// process beside a busy one is at risk on this host: design.md §9).
const LAST_COUNT: &str = "while read l; do n=$l; done < /tmp/count; echo $n";

fn scratch(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tandem-{what}-{}", std::process::id()))
}

/// `tandem run --incoming unix:SOCK --api-sock SOCK.api` in `ns` with the
/// base guest's devices on `taps` and `disk`, and `--mem mem`.
fn destination(ns: &NetNs, sock: &Path, taps: [&str; 2], disk: &Path, mem: &str) -> TestVm {
    let incoming = format!("unix:{}", sock.display());
    let api = format!("{}.api", sock.display());
    let mut args: Vec<String> = vec![
        "--incoming".into(),
        incoming,
        "--mem".into(),
        mem.into(),
        "--api-sock".into(),
        api,
    ];
    args.extend(device_args(taps, disk));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let vm = TestVm::start_with(ns.command(tandem_bin().to_str().unwrap()), &args);
    // The line is on stderr (the console is the guest's, once it runs).
    let t = Instant::now();
    while !vm.stderr().contains("waiting for a migration on") {
        assert!(
            t.elapsed() < CMD,
            "the destination did not listen: {}",
            vm.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    vm
}

/// `tandem ctl migrate ... --json`: exit status and the report.
fn migrate(api: &Path, to: &Path) -> (i32, serde_json::Value) {
    let to = format!("unix:{}", to.display());
    ctl(api, &["migrate", &to, "--json"])
}

#[test]
fn a_running_guest_moves_to_another_tandem() {
    let api = scratch("mig-src.sock");
    let ns = NetNs::new("migrate");
    ns.add_bridge("br0", &format!("{HOST_IP0}/{PREFIX}"), &["tap0", "tap4"]);
    // The image both ends use (one at a time: it is handed over).
    let image = disk_copy();
    let mut src = TestVm::restore_base_on(
        &ns,
        ["tap0", "tap1"],
        &image,
        &["--api-sock", api.to_str().unwrap()],
    );
    src.remove_on_drop(image.clone());

    // A file in tmpfs (guest memory) and a loop that dirties memory from
    // user space (native speed here) while the migration runs.
    vm_prepare(&mut src);
    let sum = src.ok("sha256sum /tmp/m", CMD);
    failed_migrations(&ns, &api, &mut src, &sum);
    completed_migration(&ns, &api, src, &image, &sum);
}

/// Migrations that fail, each leaving the source's guest running.
fn failed_migrations(ns: &NetNs, api: &Path, src: &mut TestVm, sum: &str) {
    // A destination that is not this VM (other memory size): refused before
    // any memory moves; the guest runs on at the source.
    let wrong_sock = scratch("mig-wrong.sock");
    let wrong_disk = disk_copy();
    let mut wrong = destination(ns, &wrong_sock, ["tap2", "tap3"], &wrong_disk, "256M");
    wrong.remove_on_drop(wrong_disk);
    let (code, report) = migrate(api, &wrong_sock);
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
    still_running(src, api, sum);

    // A destination killed mid-stream, a migration that cannot converge in
    // its time, a cancel: each leaves the guest running at the source.
    let slow = ["--bandwidth", "4"];
    let (report, mut dst) = migrate_while(ns, api, &slow, TestVm::kill);
    assert!(
        report["error"]
            .as_str()
            .unwrap_or("")
            .contains("migration stream"),
        "{report}"
    );
    dst.wait_exit(CMD);
    still_running(src, api, sum);
    // (Capped at 2 MiB/s, 1 ms is less than a page's time.)
    let hopeless = [
        "--downtime-ms",
        "1",
        "--auto-converge",
        "off",
        "--timeout-s",
        "5",
        "--bandwidth",
        "2",
    ];
    let (report, mut dst) = migrate_while(ns, api, &hopeless, |_| {});
    assert!(
        report["error"]
            .as_str()
            .unwrap_or("")
            .contains("not done after 5 s"),
        "{report}"
    );
    assert_eq!(dst.wait_exit(CMD).code(), Some(1), "{}", dst.stderr());
    still_running(src, api, sum);
    let (report, mut dst) = migrate_while(ns, api, &slow, |_| {
        let (code, a) = ctl(api, &["migrate-cancel"]);
        assert_eq!(code, 0, "{a}");
    });
    assert_eq!(report["phase"], "cancelled", "{report}");
    assert_eq!(dst.wait_exit(CMD).code(), Some(1), "{}", dst.stderr());
    still_running(src, api, sum);
}

/// The real one, on the same disk image, with the disk mounted and a file
/// synced to it, and a TCP stream into the guest running across it.
fn completed_migration(ns: &NetNs, api: &Path, mut src: TestVm, image: &Path, sum: &str) {
    src.ok(
        "mount -t ext4 /dev/vda /mnt && cp /tmp/m /mnt/m && sync",
        CMD,
    );
    let sock = scratch("mig-dst.sock");
    let mut dst = destination(ns, &sock, ["tap4", "tap5"], image, BASE_MEM);
    dst.remove_on_drop(image.to_path_buf());
    // Empty until the guest arrives: it cannot be run or saved.
    let dst_api = PathBuf::from(format!("{}.api", sock.display()));
    for verb in [&["resume"][..], &["snapshot", "/tmp/tandem-mig-none.snap"]] {
        let (code, a) = ctl(&dst_api, verb);
        assert_eq!(code, 1, "{a}");
        assert!(
            a["error"]
                .as_str()
                .unwrap_or("")
                .contains("waits for an incoming migration"),
            "{a}"
        );
    }
    let blob = pseudo_random(STREAM_BYTES, 11);
    let want = hex(&Sha256::digest(&blob));
    src.ok("nc -l -p 5001 </dev/null >/tmp/in & ncpid=$!", CMD);
    let sender = ns.spawn(move || send_slowly(&blob));
    std::thread::sleep(Duration::from_secs(1));
    let (code, report) = migrate(api, &sock);
    eprintln!("migration: {report}");
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["phase"], "completed", "{report}");
    let pages = report["pages"].as_u64().unwrap_or(0);
    assert!(
        pages >= 32768,
        "all of guest RAM was sent at least once: {report}"
    );
    assert!(report["zero_pages"].as_u64().unwrap_or(0) > 0, "{report}");
    assert!(report["downtime_ms"].as_f64().is_some(), "{report}");
    let st = src.wait_exit(CMD);
    assert_eq!(st.code(), Some(0), "{}", src.stderr());
    assert!(
        src.stderr().contains("migrated to unix:"),
        "{}",
        src.stderr()
    );

    // The guest runs at the destination, as it was.
    dst.ok("true", CMD);
    assert_eq!(dst.ok("sha256sum /tmp/m", CMD), sum);
    let before = dst.ok(LAST_COUNT, CMD);
    dst.ok("sleep 1", CMD);
    let after = dst.ok(LAST_COUNT, CMD);
    assert_ne!(
        before, after,
        "the dirtying loop runs on at the destination"
    );
    dst.ok("kill %1", CMD);
    dst.ok("wait $ncpid", CMD);
    let (sent, end) = sender.join().expect("the sender");
    assert_eq!(sent, STREAM_BYTES, "the host sent the whole stream");
    let tcp = dst.ok("grep Tcp: /proc/net/snmp", CMD);
    eprintln!("stream: {end}; the guest's TCP counters:\n{tcp}");
    // The shell may first report the finished background job: take the sum.
    let got = dst.ok("ls -l /tmp/in; sha256sum /tmp/in", CMD);
    let stream_sum = got
        .split_whitespace()
        .find(|t| t.len() == 64 && t.chars().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(
        stream_sum,
        Some(want.as_str()),
        "the stream across the migration arrived whole: {got}\nstream: {end}\n{tcp}"
    );
    disk_and_network(&mut dst, ns, sum);
}

/// The disk is the destination's now: what the guest synced reads back
/// from the image (the guest's page cache dropped), and it writes; and the
/// guest answers pings through the bridge.
fn disk_and_network(dst: &mut TestVm, ns: &NetNs, sum: &str) {
    dst.ok("echo 3 > /proc/sys/vm/drop_caches", CMD);
    let on_disk = dst.ok("sha256sum /mnt/m", CMD);
    assert_eq!(on_disk.replace("/mnt/m", "/tmp/m"), sum);
    dst.ok("echo after > /mnt/after && sync && umount /mnt", CMD);
    let out = ns
        .command("ping")
        .args(["-c", "3", "-i", "0.2", "-W", "20", GUEST_IP0])
        .output()
        .expect("ping");
    assert!(out.status.success(), "ping the migrated guest: {out:?}");
}

/// Bytes of the stream sent into the guest across the migration.
const STREAM_BYTES: usize = 2 << 20;

/// Sends `blob` to the guest's port 5001 in 64 KiB pieces 100 ms apart (so
/// that the stream runs across the migration); returns the bytes sent and
/// how the connection ended.
fn send_slowly(blob: &[u8]) -> (usize, String) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut s = loop {
        match TcpStream::connect((GUEST_IP0, 5001)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => panic!("connect to the guest: {e}"),
        }
    };
    for piece in blob.chunks(64 << 10) {
        s.write_all(piece).expect("send to the guest");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Then wait for the guest to close its end: how the stream ended.
    let _ = s.shutdown(std::net::Shutdown::Write);
    let _ = s.set_read_timeout(Some(Duration::from_secs(120)));
    let mut byte = [0u8; 1];
    let end = match s.read(&mut byte) {
        Ok(0) => "closed by the guest".to_string(),
        Ok(_) => "the guest sent data".to_string(),
        Err(e) => format!("error: {e}"),
    };
    (blob.len(), end)
}

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
    let mut dst = destination(ns, &sock, ["tap2", "tap3"], &disk, BASE_MEM);
    dst.remove_on_drop(disk);
    let to = format!("unix:{}", sock.display());
    let follower = Command::new(tandem_bin())
        .args([
            "ctl",
            "--api-sock",
            api.to_str().unwrap(),
            "migrate",
            &to,
            "--json",
        ])
        .args(opts)
        .stdout(Stdio::piped())
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
/// log is off again.
fn still_running(src: &mut TestVm, api: &Path, sum: &str) {
    let (code, a) = ctl(api, &["status"]);
    assert_eq!((code, a["state"].as_str()), (0, Some("running")), "{a}");
    assert_eq!(src.ok("sha256sum /tmp/m", CMD), sum);
    let (_, a) = ctl(api, &["dirty-log", "read"]);
    assert_eq!(a["error"], "the dirty log is off (dirty_log start)", "{a}");
}

/// Writes /tmp/m (about 1 MiB of pseudo-random text, in 64 writes: each
/// syscall is costly here) and starts the dirtying loop (job 1), which
/// appends the number of each pass to /tmp/count.
fn vm_prepare(vm: &mut TestVm) {
    vm.ok(
        "awk 'BEGIN{srand(3); for(i=0;i<2048;i++) s=s sprintf(\"%08x\", rand()*2147483648); \
         for(j=0;j<64;j++) printf \"%d%s\", j, s}' > /tmp/m",
        CMD,
    );
    vm.ok(
        "awk 'BEGIN{for(;;){for(i=0;i<50000;i++)a[i]=i+n; n++; print n >> \"/tmp/count\"; fflush()}}' &",
        CMD,
    );
    vm.ok(
        "for i in 1 2 3 4 5 6 7 8 9 10; do test -s /tmp/count && break; sleep 1; done; \
         test -s /tmp/count",
        CMD,
    );
}

//! Snapshot and restore of a real guest with NICs and a disk (the run's
//! base guest, restored, see `tests/src/base.rs`):
//! a counter loop, a file in tmpfs, files on an ext4 disk (synced and only
//! in the page cache) and a TCP connection from the host survive a pause, a
//! snapshot, a SIGKILL of the VMM and a restore in a new process on the same
//! tap; the same file restores again (on a copy of the disk). Damaged,
//! truncated and foreign files, a memory mismatch and a different device
//! set are refused before anything starts. Each vCPU's CPUID and TSC
//! frequency are in the file and restored as saved; a file of format
//! version 1, and one whose TSC frequency this host cannot give, are
//! refused.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::net::{Shutdown, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use migration::vcpu::VcpuState;
use migration::{section, Manifest, SectionKind, SnapshotReader, SnapshotWriter};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tandem_tests::base::{base, DISK_ID, GUEST_IP0, HOST_IP0, MAC0, MAC1, PREFIX};
use tandem_tests::netns::NetNs;
use tandem_tests::{ctl, hex, pseudo_random, tandem_bin, tandem_output, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;

fn number(vm: &mut TestVm, cmd: &str) -> f64 {
    let out = vm.ok(cmd, CMD);
    out.split_whitespace()
        .next()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("`{cmd}`: not a number: {out}"))
}

/// The counter's value. The loop rewrites the file (truncate, then write),
/// so a read can fall between the two: the shell reads until it gets a value.
fn count(vm: &mut TestVm) -> u64 {
    number(
        vm,
        "c=; while [ -z \"$c\" ]; do read c </tmp/count; done; echo $c",
    ) as u64
}

fn uptime(vm: &mut TestVm) -> f64 {
    number(vm, "cat /proc/uptime")
}

/// The guest's sha256sum output for the tmpfs file and the two disk files.
fn sha(vm: &mut TestVm) -> String {
    let out = vm.ok("sha256sum /tmp/data /mnt/synced /mnt/cached", CMD);
    ["/tmp/data", "/mnt/synced", "/mnt/cached"]
        .map(|f| format!("{}  {f}", sum_of(&out, f)))
        .join("\n")
}

/// Checks a restored guest: shell, file, counter going on, clock.
fn check_restored(vm: &mut TestVm, at_snapshot: u64, up_snapshot: f64, data_sha: &str) {
    let c1 = count(vm);
    assert!(c1 >= at_snapshot, "counter went back: {c1} < {at_snapshot}");
    let up = uptime(vm);
    assert!(
        up >= up_snapshot && up < up_snapshot + 300.0,
        "guest uptime {up} s after restore, {up_snapshot} s before the snapshot"
    );
    assert_eq!(sha(vm), data_sha, "files changed across the restore");
    // The loop ticks about once a second of guest time.
    let deadline = Instant::now() + tandem_tests::budget(Duration::from_secs(30));
    loop {
        std::thread::sleep(Duration::from_secs(3));
        let c2 = count(vm);
        if c2 > c1 {
            eprintln!("counter after restore: {c1} -> {c2} (snapshot had >= {at_snapshot})");
            break;
        }
        assert!(Instant::now() < deadline, "counter stuck at {c1}");
    }
}

/// Runs `tandem run --restore FILE extra...` expecting a refusal.
fn refused(file: &Path, extra: &[&str], expect: &str) {
    let mut args = vec!["run", "--restore", file.to_str().unwrap()];
    args.extend_from_slice(extra);
    let start = Instant::now();
    let out = tandem_output(&args);
    check_refusal(out, start, file, extra, expect);
}

/// The same, in `ns` (for a refusal that comes after the taps are opened).
fn refused_in(ns: &NetNs, file: &Path, extra: &[&str], expect: &str) {
    let start = Instant::now();
    let out = ns
        .command(tandem_bin().to_str().unwrap())
        .args(["run", "--restore", file.to_str().unwrap()])
        .args(extra)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run tandem");
    check_refusal(out, start, file, extra, expect);
}

fn check_refusal(
    out: std::process::Output,
    start: Instant,
    file: &Path,
    extra: &[&str],
    expect: &str,
) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{file:?} {extra:?}: {err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains(expect), "expected {expect:?} in: {err}");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "refusal took {:?}",
        start.elapsed()
    );
    eprintln!("refused as expected: {}", err.trim());
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tandem-snap-{}-{name}", std::process::id()))
}

/// The disk file written without a sync: what the guest's shell produces.
fn cached_text() -> String {
    (0..200).map(|i| format!("cached line {i}\n")).collect()
}

const PART: usize = 96 * 1024;

/// The base guest's NICs on tap0 and tap1.
fn nets() -> [String; 2] {
    [
        format!("tap=tap0,mac={MAC0},rsc=off"),
        format!("tap=tap1,mac={MAC1},rsc=on"),
    ]
}

/// `tandem run --restore` in `ns` with the base guest's NICs (on tap0 and
/// tap1) and disk `disk`, synced with its shell.
fn restore_in(ns: &NetNs, file: &Path, disk: &Path, sock: Option<&Path>) -> TestVm {
    let [net0, net1] = nets();
    let disk = format!("path={}", disk.display());
    let mut args = vec![
        "--restore",
        file.to_str().unwrap(),
        "--net",
        &net0,
        "--net",
        &net1,
        "--disk",
        &disk,
    ];
    if let Some(s) = sock {
        args.extend(["--api-sock", s.to_str().unwrap()]);
    }
    let mut vm = TestVm::start_with(ns.command(tandem_bin().to_str().unwrap()), &args);
    vm.ok("true", CMD);
    vm
}

/// The checksum in `sha256sum` output for `name` (the shell may print a
/// finished job's line and a prompt first).
fn sum_of(out: &str, name: &str) -> String {
    out.lines()
        .find_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            [.., sum, file]
                if file == name
                    && sum.len() == 64
                    && sum.chars().all(|c| c.is_ascii_hexdigit()) =>
            {
                Some(sum.to_string())
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no sum for {name} in: {out}"))
}

/// Each vCPU's saved state, read with the migration crate's own reader.
fn saved_cpus(file: &Path) -> Vec<VcpuState> {
    let mut r = SnapshotReader::open(File::open(file).expect("snapshot")).expect("verified");
    let m: Manifest = r.read_state(section::MANIFEST).expect("manifest");
    (0..m.vcpus)
        .map(|i| r.read_state(&section::vcpu(i)).expect("vCPU section"))
        .collect()
}

/// Checks that every vCPU of `file` carries a CPUID of its own and a TSC
/// frequency; returns vCPU 0's frequency.
fn check_saved_cpus(file: &Path) -> u32 {
    let cpus = saved_cpus(file);
    assert!(!cpus.is_empty());
    for (i, v) in cpus.iter().enumerate() {
        let (cpuid, khz) = (&v.kvm.cpuid, v.kvm.tsc_khz);
        let leaf = |f: u32| cpuid.iter().find(|e| e.function == f && e.index == 0);
        let max_basic = leaf(0).map(|e| e.eax);
        assert!(
            max_basic >= Some(1),
            "vCPU {i}: no CPUID leaf 0 in {cpuid:?}"
        );
        let apic_id = leaf(1).map(|e| e.ebx >> 24);
        assert_eq!(apic_id, Some(i as u32), "vCPU {i}: CPUID leaf 1");
        assert!(khz > 0, "vCPU {i}: no TSC frequency");
        eprintln!("vCPU {i}: {} CPUID entries, TSC {khz} kHz", cpuid.len());
    }
    cpus[0].kvm.tsc_khz
}

/// A whole copy of snapshot `from` at `to`, vCPU 0's state changed by
/// `edit`, written by the migration crate's writer (a forged but well-formed
/// file: every section, memory included, copied as it was).
fn rewrite_vcpu0(from: &Path, to: &Path, edit: impl FnOnce(&mut VcpuState)) {
    let mut r = SnapshotReader::open(File::open(from).unwrap()).unwrap();
    let mut w = SnapshotWriter::new(BufWriter::new(File::create(to).unwrap())).unwrap();
    let mut edit = Some(edit);
    for s in r.sections().to_vec() {
        match s.kind {
            SectionKind::State if s.name == section::vcpu(0) => {
                let mut v: VcpuState = r.read_state(&s.name).unwrap();
                (edit.take().unwrap())(&mut v);
                w.write_state(&s.name, &v).unwrap();
            }
            SectionKind::State => {
                let body = r.read_state_bytes(&s.name).unwrap();
                w.write_section(&s.name, s.kind, &body).unwrap();
            }
            kind => {
                let (len, mut body) = r.section_reader(&s.name, kind).unwrap();
                w.write_section_with(&s.name, kind, len, |out| {
                    std::io::copy(&mut body, out).map(drop)
                })
                .unwrap();
            }
        }
    }
    w.finish()
        .unwrap()
        .into_inner()
        .unwrap()
        .sync_all()
        .unwrap();
}

/// Whether this host's KVM scales a guest's TSC (`KVM_CAP_TSC_CONTROL`).
fn kvm_scales_tsc() -> bool {
    use std::os::fd::AsRawFd;
    const KVM_CHECK_EXTENSION: libc::c_ulong = 0xae03;
    const KVM_CAP_TSC_CONTROL: libc::c_ulong = 60;
    let kvm = File::open("/dev/kvm").expect("/dev/kvm");
    // SAFETY: KVM_CHECK_EXTENSION takes an integer and touches no memory of
    // ours; `kvm` is an open /dev/kvm for the whole call.
    let r = unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_CHECK_EXTENSION, KVM_CAP_TSC_CONTROL) };
    r > 0
}

#[test]
fn snapshot_restore_twice_and_refusals() {
    let t0 = Instant::now();
    let ns = NetNs::new("snap");
    ns.add_tap("tap0", &format!("{HOST_IP0}/{PREFIX}"));
    ns.add_bare_tap("tap1");
    let sock = scratch("a.sock");
    let file = scratch("vm.snap");
    let disk = scratch("disk.img");
    let disk_at_snapshot = scratch("disk-at-snapshot.img");
    // The run's base guest (booted once for the whole suite) on a disk of
    // our own: an ext4 file system it has not mounted.
    let b = base();
    std::fs::copy(&b.disk, &disk).unwrap();
    let mut vm = restore_in(&ns, &b.snapshot, &disk, Some(&sock));
    eprintln!("base guest restored in {:.1} s", t0.elapsed().as_secs_f64());

    vm.ok("mkfifo /tmp/tick && exec 3<>/tmp/tick", CMD);
    vm.ok(
        "(i=0; while :; do i=$((i+1)); echo $i >/tmp/count; read -t 1 x <&3; done) &",
        CMD,
    );
    // Files with known content, written by the shell alone: one in tmpfs,
    // one on the disk and synced, one on the disk left in the page cache.
    vm.ok(
        "i=0; while [ $i -lt 300 ]; do echo \"line $i of the tandem snapshot test\"; i=$((i+1)); done >/tmp/data",
        CMD,
    );
    vm.ok(
        "mount -t ext4 /dev/vda /mnt && cp /tmp/data /mnt/synced && sync",
        CMD,
    );
    vm.ok(
        "i=0; while [ $i -lt 200 ]; do echo \"cached line $i\"; i=$((i+1)); done >/mnt/cached",
        CMD,
    );
    let data_sha = sha(&mut vm);
    assert_eq!(
        sum_of(&data_sha, "/mnt/cached"),
        hex(&Sha256::digest(cached_text().as_bytes()))
    );

    // A TCP connection from the host, open across the snapshot: the first
    // part arrives before it, the second is sent while no VM runs.
    let part1 = pseudo_random(PART, 0x5eed_0001);
    let part2 = pseudo_random(PART, 0x5eed_0002);
    let want_rx = {
        let mut h = Sha256::new();
        h.update(&part1);
        h.update(&part2);
        hex(&h.finalize())
    };
    vm.ok("nc -l -p 7000 </dev/null >/tmp/rx &", CMD);
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let sender = {
        let (p1, p2) = (part1.clone(), part2.clone());
        ns.spawn(move || {
            let deadline = Instant::now() + tandem_tests::budget(Duration::from_secs(30));
            let mut s = loop {
                match TcpStream::connect((GUEST_IP0, 7000)) {
                    Ok(s) => break s,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(500))
                    }
                    Err(e) => panic!("connect to guest: {e}"),
                }
            };
            s.write_all(&p1).expect("send part 1");
            go_rx.recv().expect("go for part 2");
            s.write_all(&p2).expect("send part 2 (across the restore)");
            s.shutdown(Shutdown::Write).expect("shutdown");
        })
    };
    let deadline = Instant::now() + tandem_tests::budget(Duration::from_secs(60));
    // The background job may not have opened /tmp/rx yet.
    while vm.ok("wc -c </tmp/rx 2>/dev/null || echo 0", CMD).trim() != PART.to_string() {
        assert!(Instant::now() < deadline, "part 1 did not arrive");
        std::thread::sleep(Duration::from_secs(1));
    }
    let before = count(&mut vm);
    let up_before = uptime(&mut vm);

    // Pause, snapshot, kill: the snapshot is the VM's last state.
    let (code, answer) = ctl(&sock, &["pause"]);
    assert_eq!(code, 0, "{answer}");
    let (code, answer) = ctl(&sock, &["snapshot", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{answer}");
    assert_eq!(answer["state"], "paused", "{answer}");
    eprintln!(
        "snapshot: {} bytes in the file, {} bytes of memory, {:.0} ms",
        answer["file_bytes"], answer["memory_bytes"], answer["ms"]
    );
    let file_len = std::fs::metadata(&file).expect("snapshot file").len();
    assert_eq!(answer["file_bytes"], file_len, "{answer}");
    let phase = |k: &str| answer[k].as_f64().unwrap_or(-1.0);
    let phases = phase("capture_ms") + phase("write_ms") + phase("sync_ms");
    assert!(
        ["capture_ms", "write_ms", "sync_ms"]
            .iter()
            .all(|k| phase(k) >= 0.0)
            && phases <= phase("ms"),
        "the phases are parts of the snapshot's time: {answer}"
    );
    assert!(
        !scratch("vm.snap.tmp").exists(),
        "temporary file left behind"
    );
    let tsc_khz = check_saved_cpus(&file);
    drop(vm); // SIGKILL
    std::fs::copy(&disk, &disk_at_snapshot).unwrap();
    go_tx.send(()).unwrap();

    // Restore on the same tap and disk: the connection goes on.
    let t1 = Instant::now();
    let sock_b = scratch("b.sock");
    let mut vm = restore_in(&ns, &file, &disk, Some(&sock_b));
    eprintln!(
        "first restore answered in {:.1} s",
        t1.elapsed().as_secs_f64()
    );
    sender.join().expect("sender");
    // nc ends at the EOF that follows part 2 (the counter loop is a job too).
    vm.ok("wait $!", tandem_tests::budget(Duration::from_secs(60)));
    let rx = vm.ok("sha256sum /tmp/rx", CMD);
    assert_eq!(
        sum_of(&rx, "/tmp/rx"),
        want_rx,
        "TCP bytes across the restore"
    );
    eprintln!(
        "TCP: {} bytes before and {} after the snapshot arrived intact",
        PART, PART
    );
    check_restored(&mut vm, before, up_before, &data_sha);
    let (code, st) = ctl(&sock_b, &["status"]);
    assert_eq!((code, &st["state"]), (0, &Value::from("running")), "{st}");
    // Snapshotting a paused VM leaves it paused.
    let file2 = scratch("vm2.snap");
    assert_eq!(ctl(&sock_b, &["pause"]).0, 0);
    let (code, answer) = ctl(&sock_b, &["snapshot", file2.to_str().unwrap()]);
    assert_eq!(
        (code, &answer["state"]),
        (0, &Value::from("paused")),
        "{answer}"
    );
    assert_eq!(ctl(&sock_b, &["status"]).1["state"], "paused");
    assert_eq!(ctl(&sock_b, &["resume"]).0, 0);
    // The restored vCPUs run with the CPUID and TSC frequency of the file.
    let cpu = |f: &Path| -> Vec<_> {
        saved_cpus(f)
            .into_iter()
            .map(|v| (v.kvm.cpuid, v.kvm.tsc_khz))
            .collect()
    };
    assert!(
        cpu(&file2) == cpu(&file),
        "a restored VM saves another CPUID or TSC frequency"
    );
    // The restored guest writes its page cache back: the file is on disk.
    vm.ok("umount /mnt", CMD);
    drop(vm);
    let out = Command::new("debugfs")
        .args(["-R", "cat /cached", disk.to_str().unwrap()])
        .output()
        .expect("debugfs");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        cached_text(),
        "the unsynced file reached the disk after restore"
    );

    // The same file again, on a copy of the disk as it was at the snapshot
    // (another path: allowed) and without naming the disk id (the
    // snapshot's is kept).
    let t2 = Instant::now();
    let mut vm = restore_in(&ns, &file, &disk_at_snapshot, None);
    eprintln!(
        "second restore answered in {:.1} s",
        t2.elapsed().as_secs_f64()
    );
    check_restored(&mut vm, before, up_before, &data_sha);
    assert_eq!(vm.ok("cat /sys/block/vda/serial", CMD), DISK_ID);
    drop(vm);

    // Files that must be refused, with nothing started.
    let bytes = std::fs::read(&file).unwrap();
    let damaged = scratch("damaged.snap");
    let mut d = bytes.clone();
    // A byte of a state section: the file's CRC covers it (damaged pages
    // are restore_map.rs's).
    let vm_section = SnapshotReader::open(File::open(&file).unwrap())
        .unwrap()
        .section(section::VM)
        .expect("vm section")
        .clone();
    d[(vm_section.offset + vm_section.len / 2) as usize] ^= 0x40;
    std::fs::write(&damaged, &d).unwrap();
    refused(&damaged, &[], "damaged");
    let truncated = scratch("truncated.snap");
    std::fs::write(&truncated, &bytes[..bytes.len() / 3]).unwrap();
    refused(&truncated, &[], "truncated");
    let foreign = scratch("foreign.snap");
    std::fs::write(&foreign, b"#!/bin/sh\necho this is not a snapshot\n").unwrap();
    refused(&foreign, &[], "not a tandem snapshot");
    let version1 = scratch("version1.snap");
    let mut v1 = bytes.clone();
    v1[8..12].copy_from_slice(&1u32.to_le_bytes());
    std::fs::write(&version1, &v1).unwrap();
    refused(
        &version1,
        &[],
        "snapshot format version 1, this tandem reads 2 and 3",
    );
    let same_disk = format!("path={}", disk_at_snapshot.display());
    let [net0, net1] = nets();
    let devices = ["--net", &net0, "--net", &net1, "--disk", &same_disk];
    let with = |extra: &[&'static str]| -> Vec<String> {
        devices
            .iter()
            .map(|s| s.to_string())
            .chain(extra.iter().map(|s| s.to_string()))
            .collect()
    };
    let refused_with = |extra: &[&'static str], expect: &str| {
        let args = with(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        refused(&file, &args, expect);
    };
    refused_with(&["--mem", "256M"], "snapshot has 128 MiB of memory");
    refused_with(&["--cpus", "2"], "snapshot has 1 vCPU");
    refused(&file, &[], "snapshot has NIC net0 on tap0; none given");
    let rsc_net = net0.replace("rsc=off", "rsc=on");
    refused(
        &file,
        &["--net", &rsc_net, "--net", &net1, "--disk", &same_disk],
        "NIC net0: snapshot has rsc=off, this VM asks for rsc=on",
    );
    let small = scratch("small.img");
    std::fs::write(&small, vec![0u8; 8 << 20]).unwrap();
    let small_disk = format!("path={}", small.display());
    refused(
        &file,
        &["--net", &net0, "--net", &net1, "--disk", &small_disk],
        "disk blk0: snapshot has a disk of 16 MiB",
    );
    let ro_disk = format!("{same_disk},readonly=on");
    refused(
        &file,
        &["--net", &net0, "--net", &net1, "--disk", &ro_disk],
        "disk blk0: snapshot has it read-write, this VM asks for read-only",
    );
    refused(&scratch("missing.snap"), &[], "cannot open snapshot");

    // A guest TSC slower than this host's: KVM runs it only with TSC
    // scaling; without, the restore is refused naming both frequencies.
    let slow = scratch("slow-tsc.snap");
    rewrite_vcpu0(&file, &slow, |v| v.kvm.tsc_khz = tsc_khz / 2);
    let slow_args = with(&[]);
    let slow_args: Vec<&str> = slow_args.iter().map(String::as_str).collect();
    if kvm_scales_tsc() {
        let mut vm = restore_in(&ns, &slow, &disk_at_snapshot, None);
        vm.ok("true", CMD);
        eprintln!("TSC scaled: the guest runs at {} kHz", tsc_khz / 2);
    } else {
        refused_in(
            &ns,
            &slow,
            &slow_args,
            &format!(
                "restoring the VM: vCPU 0: the snapshot's guest TSC runs at {} kHz, this host's at \
                 {tsc_khz} kHz, and KVM cannot scale it here",
                tsc_khz / 2
            ),
        );
    }

    for f in [
        &file,
        &file2,
        &damaged,
        &truncated,
        &foreign,
        &version1,
        &slow,
        &disk,
        &disk_at_snapshot,
        &small,
    ] {
        let _ = std::fs::remove_file(f);
    }
    eprintln!("whole test: {:.0} s", t0.elapsed().as_secs_f64());
}

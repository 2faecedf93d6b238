//! Snapshot and restore of a real console-only guest (one boot): a counter
//! loop and a file in tmpfs survive a snapshot, a SIGKILL of the VMM and a
//! restore in a new process, twice from the same file; damaged, truncated
//! and foreign files and a memory mismatch are refused before anything
//! starts.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_tests::{tandem_bin, tandem_output, TestVm};

const CMD: Duration = Duration::from_secs(180);

fn ctl(sock: &Path, verb: &[&str]) -> (i32, Value) {
    let out = Command::new(tandem_bin())
        .arg("ctl")
        .arg("--api-sock")
        .arg(sock)
        .args(verb)
        .output()
        .expect("run tandem ctl");
    let text = String::from_utf8_lossy(&out.stdout);
    let answer = serde_json::from_str(&text).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), answer)
}

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

fn sha(vm: &mut TestVm) -> String {
    vm.ok("sha256sum /tmp/data", CMD)
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
    assert_eq!(sha(vm), data_sha, "file changed across the restore");
    // The loop ticks about once a second of guest time.
    let deadline = Instant::now() + Duration::from_secs(120);
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

#[test]
fn snapshot_restore_twice_and_refusals() {
    let t0 = Instant::now();
    let sock = scratch("a.sock");
    let file = scratch("vm.snap");
    let mut vm = TestVm::boot_default(&["--api-sock", sock.to_str().unwrap()]);
    eprintln!("booted in {:.0} s", t0.elapsed().as_secs_f64());

    vm.ok("mkfifo /tmp/tick && exec 3<>/tmp/tick", CMD);
    vm.ok(
        "(i=0; while :; do i=$((i+1)); echo $i >/tmp/count; read -t 1 x <&3; done) &",
        CMD,
    );
    // A file with known content, written by the shell alone.
    vm.ok(
        "i=0; while [ $i -lt 300 ]; do echo \"line $i of the tandem snapshot test\"; i=$((i+1)); done >/tmp/data",
        CMD,
    );
    let data_sha = sha(&mut vm);
    let before = count(&mut vm);
    let up_before = uptime(&mut vm);

    let (code, answer) = ctl(&sock, &["snapshot", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{answer}");
    assert_eq!(answer["state"], "running", "{answer}");
    eprintln!(
        "snapshot: {} bytes in the file, {} bytes of memory, {:.0} ms",
        answer["file_bytes"], answer["memory_bytes"], answer["ms"]
    );
    let file_len = std::fs::metadata(&file).expect("snapshot file").len();
    assert_eq!(answer["file_bytes"], file_len, "{answer}");
    assert!(
        !scratch("vm.snap.tmp").exists(),
        "temporary file left behind"
    );
    // The source goes on after the snapshot.
    let after = count(&mut vm);
    assert!(after >= before);
    drop(vm); // SIGKILL

    let t1 = Instant::now();
    let sock_b = scratch("b.sock");
    let mut vm = TestVm::restore(&file, &["--api-sock", sock_b.to_str().unwrap()]);
    eprintln!(
        "first restore answered in {:.1} s",
        t1.elapsed().as_secs_f64()
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
    vm.ok("true", CMD);
    drop(vm);

    // The same file again: a snapshot is reusable.
    let t2 = Instant::now();
    let mut vm = TestVm::restore(&file, &[]);
    eprintln!(
        "second restore answered in {:.1} s",
        t2.elapsed().as_secs_f64()
    );
    check_restored(&mut vm, before, up_before, &data_sha);
    drop(vm);

    // Files that must be refused, with nothing started.
    let bytes = std::fs::read(&file).unwrap();
    let damaged = scratch("damaged.snap");
    let mut d = bytes.clone();
    let mid = d.len() / 2;
    d[mid] ^= 0x40;
    std::fs::write(&damaged, &d).unwrap();
    refused(&damaged, &[], "damaged");
    let truncated = scratch("truncated.snap");
    std::fs::write(&truncated, &bytes[..bytes.len() / 3]).unwrap();
    refused(&truncated, &[], "truncated");
    let foreign = scratch("foreign.snap");
    std::fs::write(&foreign, b"#!/bin/sh\necho this is not a snapshot\n").unwrap();
    refused(&foreign, &[], "not a tandem snapshot");
    refused(&file, &["--mem", "256M"], "snapshot has 128 MiB of memory");
    refused(&file, &["--cpus", "2"], "snapshot has 1 vCPU");
    refused(&scratch("missing.snap"), &[], "cannot open snapshot");

    for f in [&file, &file2, &damaged, &truncated, &foreign] {
        let _ = std::fs::remove_file(f);
    }
    eprintln!("whole test: {:.0} s", t0.elapsed().as_secs_f64());
}

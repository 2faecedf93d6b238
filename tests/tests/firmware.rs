//! `--firmware`: a VM that starts at the reset vector of an image mapped
//! read-only below 4 GiB, on a real vCPU under KVM.
//!
//! The image is made here, byte by byte: 64 KiB whose last 16 bytes (at
//! 0xFFFF_FFF0, where a reset CPU fetches first) jump to 16-bit code that
//! prints a line on COM1 and then resets the machine through the i8042
//! (or, in the second image, halts). So the test sees the real reset state
//! (real mode, CS base 0xFFFF_0000) and the read-only mapping (the code
//! reads its message through CS), with no kernel and no guest build.
//! Then: a firmware VM refuses a snapshot and a migration (its flash is
//! not part of the state yet) and runs on; bad images are one-line errors.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tandem_tests::{ctl, tandem_output, TestVm};

/// What the image prints.
const HELLO: &str = "tandem-fw: hello from the reset vector";

/// A 64 KiB image: at offset 0xFF00 the code, at 0xFFF0 the reset vector
/// (`jmp near 0xFF00`). With `reset`, the code ends with the i8042 reset
/// command (0xFE to port 0x64); without, it halts with interrupts off.
fn image(reset: bool) -> Vec<u8> {
    let mut img = vec![0u8; 64 << 10];
    let mut code: Vec<u8> = vec![
        0xba, 0xf8, 0x03, // 0xff00: mov dx, 0x3f8 (COM1)
        0xbe, 0x16, 0xff, // 0xff03: mov si, 0xff16 (the message)
        0x2e, 0xac, //       0xff06: cs lodsb (through CS: the flash)
        0x84, 0xc0, //       0xff08: test al, al
        0x74, 0x03, //       0xff0a: jz 0xff0f
        0xee, //             0xff0c: out dx, al
        0xeb, 0xf7, //       0xff0d: jmp 0xff06
    ];
    if reset {
        code.extend_from_slice(&[0xb0, 0xfe, 0xe6, 0x64]); // 0xff0f: mov al, 0xfe; out 0x64, al
    } else {
        code.extend_from_slice(&[0x90, 0x90, 0x90, 0x90]); // 0xff0f: nop x4
    }
    code.extend_from_slice(&[0xf4, 0xeb, 0xfd]); // 0xff13: hlt; jmp 0xff13
    assert_eq!(code.len(), 0x16);
    code.extend_from_slice(HELLO.as_bytes());
    code.extend_from_slice(b"\r\n\0");
    img[0xff00..0xff00 + code.len()].copy_from_slice(&code);
    // 0xfff0: jmp near 0xff00 (relative to 0xfff3).
    img[0xfff0..0xfff3].copy_from_slice(&[0xe9, 0x0d, 0xff]);
    img
}

fn scratch(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tandem-firmware-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn the_first_instruction_is_the_images_reset_vector() {
    let fw = scratch("reset.fd", &image(true));
    let mut vm = TestVm::start(&["--firmware", fw.to_str().unwrap(), "--mem", "64M"]);
    vm.wait_for(HELLO, Duration::from_secs(60));
    // Only the i8042 reset ends it: without, the code halts with
    // interrupts off, for good.
    let st = vm.wait_exit(Duration::from_secs(60));
    assert_eq!(st.code(), Some(0), "{}", vm.stderr());
}

#[test]
fn a_firmware_vm_is_not_saved_or_moved_and_runs_on() {
    let fw = scratch("halt.fd", &image(false));
    let api = std::env::temp_dir().join(format!("tandem-fw-api-{}", std::process::id()));
    let mut vm = TestVm::start(&[
        "--firmware",
        fw.to_str().unwrap(),
        "--mem",
        "64M",
        "--api-sock",
        api.to_str().unwrap(),
    ]);
    vm.wait_for(HELLO, Duration::from_secs(60));
    let snap = std::env::temp_dir().join(format!("tandem-fw-{}.snap", std::process::id()));
    let t = Instant::now();
    let (code, a) = loop {
        let (code, a) = ctl(&api, &["snapshot", snap.to_str().unwrap()]);
        // The API socket may not answer yet.
        if code != 1 || a != serde_json::Value::Null || t.elapsed() > Duration::from_secs(30) {
            break (code, a);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(code, 1, "{a}");
    assert!(
        a["error"].as_str().unwrap_or("").contains("--firmware"),
        "{a}"
    );
    assert!(!snap.exists(), "no snapshot file");
    let (code, a) = ctl(
        &api,
        &["migrate", "unix:/tmp/tandem-fw-nowhere.sock", "--json"],
    );
    assert_eq!(code, 1, "{a}");
    assert!(
        a["error"].as_str().unwrap_or("").contains("--firmware"),
        "{a}"
    );
    let (code, a) = ctl(&api, &["status"]);
    assert_eq!(code, 0, "{a}");
    assert!(vm.running(), "the VM runs on: {}", vm.stderr());
    let (code, a) = ctl(&api, &["shutdown"]);
    assert_eq!(code, 0, "{a}");
    assert_eq!(vm.wait_exit(Duration::from_secs(30)).code(), Some(0));
}

#[track_caller]
fn refused(args: &[&str], status: i32, expect: &str) {
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    let out = tandem_output(&all);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(status), "{err}");
    assert!(err.contains(expect), "expected {expect:?} in {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.stdout.is_empty(), "no guest output");
}

#[test]
fn bad_images_and_options_are_refused() {
    let empty = scratch("empty.fd", b"");
    refused(&["--firmware", empty.to_str().unwrap()], 1, "is empty");
    let odd = scratch("odd.fd", &[0x90; 100]);
    refused(
        &["--firmware", odd.to_str().unwrap()],
        1,
        "whole 4 KiB pages",
    );
    let huge = scratch("huge.fd", &vec![0u8; 17 << 20]);
    refused(
        &["--firmware", huge.to_str().unwrap()],
        1,
        "more than the 16 MiB",
    );
    let _ = std::fs::remove_file(&huge);
    refused(
        &["--firmware", "/nonexistent/OVMF.fd"],
        1,
        "/nonexistent/OVMF.fd",
    );
    let fw = scratch("ok.fd", &image(true));
    let fw = fw.to_str().unwrap();
    refused(&["--firmware", fw, "--kernel", fw], 1, "--kernel");
    refused(&["--firmware", fw, "--restore", fw], 1, "--restore");
}

//! `--firmware`: a VM that starts at the reset vector of an image mapped
//! read-only below 4 GiB, on a real vCPU under KVM.
//!
//! The images are made here, byte by byte: 64 KiB whose last 16 bytes (at
//! 0xFFFF_FFF0, where a reset CPU fetches first) jump to 16-bit code that
//! prints a line on COM1, then resets the machine through the i8042, or
//! halts, or echoes: for each byte typed on COM1 it counts one more in RAM
//! (0x500) and prints the count as a letter ("a", "b", ...). So the test
//! sees the real reset state (real mode, CS base 0xFFFF_0000) and the
//! read-only mapping (the code reads its message through CS), with no
//! kernel and no guest build.
//!
//! The echoing VM is snapshotted, restored and migrated with its image
//! given again (`--firmware`, checked by size and SHA-256): its count goes
//! on from where it was (RAM, registers and the UART came along) and the
//! image does not start over; a restore or a destination without the
//! image, or with another, is refused, the source running on. It runs as
//! a COLO pair (the secondary given the same image), its count carried by
//! checkpoints and across the primary's death. Bad images are one-line
//! errors.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tandem_tests::colo::{checkpoint_now, status, wait_checkpoints, wait_until};
use tandem_tests::{ctl, phase, process_scratch, tandem_output, TestVm};

/// What the image prints first.
const HELLO: &str = "tandem-fw: hello from the reset vector";
const WAIT: Duration = Duration::from_secs(60);

/// How an image's code ends, after its line.
#[derive(Clone, Copy)]
enum End {
    /// The i8042 reset command (0xFE to port 0x64).
    Reset,
    /// `hlt` with interrupts off, for good.
    Halt,
    /// Enables COM1's receive interrupt (interrupts stay off in the CPU)
    /// and polls COM1 for a byte; for each, one more in the byte at
    /// 0:0x500 and that count printed as a letter (1 is "a") and CR LF.
    Echo,
}

/// A 64 KiB image: at offset 0xFE00 the message, at 0xFF00 the code, at
/// 0xFFF0 the reset vector (`jmp near 0xFF00`).
fn image(end: End) -> Vec<u8> {
    let mut img = vec![0u8; 64 << 10];
    let mut code: Vec<u8> = vec![
        0xba, 0xf8, 0x03, // 0xff00: mov dx, 0x3f8 (COM1)
        0xbe, 0x00, 0xfe, // 0xff03: mov si, 0xfe00 (the message)
        0x2e, 0xac, //       0xff06: cs lodsb (through CS: the flash)
        0x84, 0xc0, //       0xff08: test al, al
        0x74, 0x03, //       0xff0a: jz 0xff0f
        0xee, //             0xff0c: out dx, al
        0xeb, 0xf7, //       0xff0d: jmp 0xff06
    ];
    match end {
        End::Reset => code.extend_from_slice(&[0xb0, 0xfe, 0xe6, 0x64]), // mov al, 0xfe; out 0x64, al
        End::Halt => code.extend_from_slice(&[0x90; 4]),
        End::Echo => code.extend_from_slice(&[
            0xba, 0xf9, 0x03, //       0xff0f: mov dx, 0x3f9 (interrupt enable)
            0xb0, 0x01, 0xee, //       0xff12: mov al, 1; out dx, al (receive: the
            //                                 VMM feeds COM1 while it is on)
            0xba, 0xfd, 0x03, //       0xff15: mov dx, 0x3fd (line status)
            0xec, //                   0xff18: in al, dx
            0xa8, 0x01, //             0xff19: test al, 1 (data ready)
            0x74, 0xfb, //             0xff1b: jz 0xff18
            0xba, 0xf8, 0x03, //       0xff1d: mov dx, 0x3f8
            0xec, //                   0xff20: in al, dx (the byte, dropped)
            0xfe, 0x06, 0x00, 0x05, // 0xff21: inc byte [0x500]
            0xa0, 0x00, 0x05, //       0xff25: mov al, [0x500]
            0x04, 0x60, //             0xff28: add al, 0x60 (1 is 'a')
            0xee, //                   0xff2a: out dx, al
            0xb0, 0x0d, 0xee, //       0xff2b: mov al, CR; out dx, al
            0xb0, 0x0a, 0xee, //       0xff2e: mov al, LF; out dx, al
            0xeb, 0xe2, //             0xff31: jmp 0xff15
        ]),
    }
    code.extend_from_slice(&[0xf4, 0xeb, 0xfd]); // hlt; jmp back to it
    img[0xff00..0xff00 + code.len()].copy_from_slice(&code);
    let msg = [HELLO.as_bytes(), b"\r\n\0"].concat();
    img[0xfe00..0xfe00 + msg.len()].copy_from_slice(&msg);
    // 0xfff0: jmp near 0xff00 (relative to 0xfff3).
    img[0xfff0..0xfff3].copy_from_slice(&[0xe9, 0x0d, 0xff]);
    img
}

fn scratch(name: &str, bytes: &[u8]) -> PathBuf {
    let p = process_scratch("firmware").join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn tmp(what: &str) -> PathBuf {
    process_scratch("firmware").join(what)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Types a byte on the echoing image's COM1 and waits for the count it
/// prints.
#[track_caller]
fn echo(vm: &mut TestVm, count: char) {
    vm.send("x");
    vm.wait_for(&format!("{count}\r\n"), WAIT);
}

#[test]
fn the_first_instruction_is_the_images_reset_vector() {
    let fw = scratch("reset.fd", &image(End::Reset));
    let mut vm = TestVm::start(&["--firmware", s(&fw), "--mem", "64M"]);
    vm.wait_for(HELLO, WAIT);
    // Only the i8042 reset ends it: without, the code halts with
    // interrupts off, for good.
    let st = vm.wait_exit(WAIT);
    assert_eq!(st.code(), Some(0), "{}", vm.stderr());
}

#[test]
fn a_firmware_vm_is_saved_restored_and_moved_with_its_image() {
    let fw = scratch("echo.fd", &image(End::Echo));
    let other = scratch("halt.fd", &image(End::Halt));
    let (api, api2, snap) = (tmp("api"), tmp("api2"), tmp("snap"));
    let mut vm = TestVm::start(&["--firmware", s(&fw), "--mem", "64M", "--api-sock", s(&api)]);
    vm.remove_on_drop(snap.clone());
    vm.wait_for(HELLO, WAIT);
    echo(&mut vm, 'a');
    echo(&mut vm, 'b');
    let (code, a) = ctl(&api, &["snapshot", s(&snap)]);
    assert_eq!(code, 0, "{a}");
    echo(&mut vm, 'c');
    vm.kill();

    refused(
        &["--restore", s(&snap)],
        1,
        "give --firmware with that image",
    );
    refused(
        &["--restore", s(&snap), "--firmware", s(&other)],
        1,
        "another image",
    );
    let mut r = TestVm::start(&[
        "--restore",
        s(&snap),
        "--firmware",
        s(&fw),
        "--api-sock",
        s(&api2),
    ]);
    // The count as it was saved, and the image did not start over.
    echo(&mut r, 'c');
    assert!(!r.console().contains("hello"), "{}", r.console());

    // A destination with another image refuses; the source runs on.
    let (sock, sock2) = (tmp("mig.sock"), tmp("mig2.sock"));
    let unix = |p: &Path| format!("unix:{}", s(p));
    // Each destination is asked for only once it listens: `migrate` at
    // once raced its bind (CI saw "cannot connect ... No such file").
    let destination = |sock: &Path, image: &Path| {
        let vm = TestVm::start(&[
            "--incoming",
            &unix(sock),
            "--firmware",
            s(image),
            "--mem",
            "64M",
        ]);
        wait_until("the destination listens", WAIT, || {
            vm.stderr().contains("waiting for a migration on")
        });
        vm
    };
    let mut bad = destination(&sock, &other);
    let (code, a) = ctl(&api2, &["migrate", &unix(&sock), "--json"]);
    assert_eq!(code, 1, "{a}");
    assert!(
        a["error"].as_str().unwrap_or("").contains("another image"),
        "{a}"
    );
    assert_eq!(bad.wait_exit(WAIT).code(), Some(1), "{}", bad.stderr());
    echo(&mut r, 'd');

    let mut dst = destination(&sock2, &fw);
    let (code, a) = ctl(&api2, &["migrate", &unix(&sock2), "--json"]);
    assert_eq!(code, 0, "{a}");
    assert_eq!(r.wait_exit(WAIT).code(), Some(0), "{}", r.stderr());
    echo(&mut dst, 'e');
    assert!(!dst.console().contains("hello"), "{}", dst.console());
    dst.kill();
}

/// `tandem run --colo secondary` listening on `addr` (the lease at
/// `lease`, the API on `api`) with `extra` options; returns once it
/// listens. Without `--mem` it takes the primary's size.
fn secondary(addr: &str, lease: &Path, api: &Path, extra: &[&str]) -> TestVm {
    let mut args = vec![
        "--colo",
        "secondary",
        "--colo-listen",
        addr,
        "--colo-lease",
        s(lease),
        "--api-sock",
        s(api),
    ];
    args.extend_from_slice(extra);
    let vm = TestVm::start(&args);
    wait_until("the secondary listens", WAIT, || {
        vm.stderr().contains("waiting for a migration on")
    });
    vm
}

/// The echoing VM as a COLO pair: the secondary given the same image (no
/// NIC, no disk: the pair needs neither). Bytes typed on the primary's
/// console reach the secondary's guest only through checkpoints (the
/// console is not mirrored): after the primary's death the secondary's
/// guest counts on from the last checkpoint's count, so its RAM,
/// registers and UART came along, and its image did not start over.
#[test]
fn a_firmware_vm_is_protected_by_a_colo_pair_and_fails_over() {
    let fw = scratch("colo-echo.fd", &image(End::Echo));
    let (api, api2) = (tmp("colo-p.api"), tmp("colo-s.api"));
    let (sock, lease) = (tmp("colo.sock"), tmp("colo.lock"));
    let addr = format!("unix:{}", s(&sock));
    let mut p = TestVm::start(&["--firmware", s(&fw), "--mem", "64M", "--api-sock", s(&api)]);
    p.wait_for(HELLO, WAIT);
    echo(&mut p, 'a');
    let mut sec = secondary(&addr, &lease, &api2, &["--firmware", s(&fw)]);
    for f in [sock.clone(), lease.clone(), alone_mark(&lease)] {
        sec.remove_on_drop(f);
    }
    let (code, a) = ctl(
        &api,
        &[
            "colo-start",
            &addr,
            "--lease",
            s(&lease),
            "--checkpoint-period-ms",
            "500",
        ],
    );
    assert_eq!(code, 0, "colo-start: {a}");
    let n = wait_checkpoints(&api, 1)["checkpoints"]["total"]
        .as_u64()
        .unwrap_or(0);
    phase(&format!("fw colo: protected, {n} checkpoint(s)"));
    // Typed between periodic checkpoints, each count followed by some.
    echo(&mut p, 'b');
    wait_checkpoints(&api, n + 2);
    echo(&mut p, 'c');
    echo(&mut p, 'd');
    // The last count committed on both sides, and nothing typed since.
    let st = checkpoint_now(&api, &api2);
    assert_eq!(st["state"], "protected", "{st}");
    phase(&format!("fw colo: counted to d, checkpointed: {st}"));
    p.kill();
    wait_until("the secondary serves", WAIT, || {
        status(&api2)["state"] == "failed_over"
    });
    echo(&mut sec, 'e');
    echo(&mut sec, 'f');
    assert!(!sec.console().contains("hello"), "{}", sec.console());
    let st = status(&api2);
    phase(&format!("fw colo: the secondary counts on: {st}"));
    sec.kill();
}

/// Secondaries of another shape than the echoing primary (1 vCPU, the
/// legacy machine, the echo image): each is refused by the initial sync's
/// manifest check before any memory moves, every difference named in the
/// one reason (on the secondary's stderr, which exits 1, and in the
/// primary's `colo-status`), and the primary's guest counts on. The same
/// whether the secondary was given `--mem` (it is built as asked and the
/// stream's check refuses it) or takes the primary's size.
#[test]
fn a_secondary_of_another_shape_is_refused_naming_every_difference() {
    let fw = scratch("shape-echo.fd", &image(End::Echo));
    let other = scratch("shape-halt.fd", &image(End::Halt));
    let api = tmp("shape-p.api");
    let mut p = TestVm::start(&[
        "--firmware",
        s(&fw),
        "--mem",
        "64M",
        "--cpus",
        "1",
        "--api-sock",
        s(&api),
    ]);
    p.wait_for(HELLO, WAIT);
    echo(&mut p, 'a');
    let disk = scratch("shape.img", &[0u8; 1 << 20]);
    let disk_arg = format!("path={}", s(&disk));
    let shape: &[&str] = &[
        "--firmware",
        s(&other),
        "--cpus",
        "2",
        "--machine",
        "pci",
        "--disk",
        &disk_arg,
    ];
    let every = [
        "1 vCPU, this VM asks for 2",
        "PCI host bridge pci0 (--machine pci)",
        "another image",
        "this VM asks for disk blk0 on",
    ];
    let with_mem = [shape, &["--mem", "64M"]].concat();
    let cases: [(&str, &[&str], &[&str]); 3] = [
        ("with --mem", &with_mem, &every),
        ("the primary's size", shape, &every),
        (
            "no --firmware",
            &["--mem", "64M"],
            &["give --firmware with that image"],
        ),
    ];
    for (n, (what, args, expect)) in cases.into_iter().enumerate() {
        let (sock, lease, api2) = (
            tmp(&format!("shape{n}.sock")),
            tmp(&format!("shape{n}.lock")),
            tmp(&format!("shape{n}-s.api")),
        );
        let addr = format!("unix:{}", s(&sock));
        let mut sec = secondary(&addr, &lease, &api2, args);
        for f in [sock, lease.clone()] {
            sec.remove_on_drop(f);
        }
        let (code, a) = ctl(&api, &["colo-start", &addr, "--lease", s(&lease)]);
        assert_eq!(code, 0, "colo-start: {a}");
        assert_eq!(sec.wait_exit(WAIT).code(), Some(1), "{}", sec.stderr());
        let mut st = serde_json::Value::Null;
        wait_until("the primary gives up the pair", WAIT, || {
            st = status(&api);
            st["state"] == "retired"
        });
        let reason = st["reason"].as_str().unwrap_or_default().to_string();
        for e in expect {
            assert!(
                reason.contains(e),
                "{what}: {e:?} not in the reason {reason:?}"
            );
            assert!(
                sec.stderr().contains(e),
                "{what}: {e:?} not in {}",
                sec.stderr()
            );
        }
        phase(&format!(
            "shape: {what}: refused: {reason}; sync {}",
            st["sync"]
        ));
        // The primary runs on: its count goes on.
        echo(&mut p, char::from(b'b' + n as u8));
    }
    p.kill();
}

/// The lease's alone mark (the primary's, once it served alone).
fn alone_mark(lease: &Path) -> PathBuf {
    let mut mark = lease.to_path_buf().into_os_string();
    mark.push(".alone");
    mark.into()
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
    let fw = scratch("ok.fd", &image(End::Reset));
    let fw = fw.to_str().unwrap();
    // A kernel for the firmware to load must be a bzImage.
    refused(&["--firmware", fw, "--kernel", fw], 1, "must be a bzImage");
    // With --restore, --firmware is taken: the file is no snapshot.
    refused(
        &["--firmware", fw, "--restore", fw],
        1,
        "not a tandem snapshot",
    );
}

/// A 64 KiB image for the platform firmware leans on: it enters 32-bit
/// protected mode, computes with the x87 (`1234 / 1000.0 * 4.0` = 4.936
/// from integers and doubles in the image: FISTP rounds it to 5, FISTTP
/// truncates it to 4, FCOMIP finds 4.0 below it and SETB gives 1) and
/// prints `x541`; then it prints fw_cfg's command-line item (what
/// `--cmdline` gives a firmware that loads `--kernel`); then it puts
/// PIIX4's PM block at 0xB000 (00:01.3's PMBA
/// and PMIOSE, through ports 0xCF8/0xCFC) and prints `T` each time the PM
/// timer has counted 1,789,772 ticks (0.5 s at 3.579545 MHz), for good.
/// Made with GNU as from the listing in the comments (offsets in the
/// image; linear = 0xFFFF_0000 + offset).
fn platform_image() -> Vec<u8> {
    let mut img = vec![0u8; 64 << 10];
    // Flat 4 GiB code (0x08) and data (0x10), their accessed bits set: the
    // CPU would otherwise write them into the read-only image (this
    // host's KVM spins on that write, as OVMF's own GDT avoids).
    let gdt: [u64; 3] = [0, 0x00cf_9b00_0000_ffff, 0x00cf_9300_0000_ffff];
    for (i, d) in gdt.iter().enumerate() {
        img[0xf000 + 8 * i..0xf008 + 8 * i].copy_from_slice(&d.to_le_bytes());
    }
    // 0xf018: the GDT's descriptor (limit, base 0xFFFF_F000).
    img[0xf018..0xf01e].copy_from_slice(&[0x17, 0x00, 0x00, 0xf0, 0xff, 0xff]);
    img[0xf020..0xf024].copy_from_slice(&1234i32.to_le_bytes());
    img[0xf028..0xf030].copy_from_slice(&1000f64.to_le_bytes());
    img[0xf030..0xf038].copy_from_slice(&4f64.to_le_bytes());
    let real: [u8; 24] = [
        0xfa, //                               f040: cli
        0x2e, 0x66, 0x0f, 0x01, 0x16, 0x18, 0xf0, // f041: lgdtl cs:[0xf018]
        0x0f, 0x20, 0xc0, //                   f048: mov eax, cr0
        0x0c, 0x01, //                         f04b: or al, 1 (PE)
        0x0f, 0x22, 0xc0, //                   f04d: mov cr0, eax
        0x66, 0xea, 0x80, 0xf0, 0xff, 0xff, 0x08, 0x00, // f050: jmp 0x08:0xfffff080
    ];
    img[0xf040..0xf058].copy_from_slice(&real);
    let protected: &[u8] = &[
        0x66, 0xb8, 0x10, 0x00, //             f080: mov ax, 0x10
        0x8e, 0xd8, 0x8e, 0xc0, 0x8e, 0xd0, // f084: mov ds/es/ss, ax
        0xbc, 0x00, 0x70, 0x00, 0x00, //       f08a: mov esp, 0x7000
        0xdb, 0xe3, //                         f08f: fninit
        0xdb, 0x05, 0x20, 0xf0, 0xff, 0xff, // f091: fild dword [0xfffff020] (the image)
        0xdc, 0x35, 0x28, 0xf0, 0xff, 0xff, // f097: fdiv qword [0xfffff028]
        0xdc, 0x0d, 0x30, 0xf0, 0xff, 0xff, // f09d: fmul qword [0xfffff030]
        0xdd, 0x1d, 0x00, 0x06, 0x00, 0x00, // f0a3: fstp qword [0x600] (RAM)
        0xdd, 0x05, 0x00, 0x06, 0x00, 0x00, // f0a9: fld qword [0x600]
        0xdb, 0x1d, 0x10, 0x06, 0x00, 0x00, // f0af: fistp dword [0x610]
        0xdd, 0x05, 0x00, 0x06, 0x00, 0x00, // f0b5: fld qword [0x600]
        0xdb, 0x0d, 0x14, 0x06, 0x00, 0x00, // f0bb: fisttp dword [0x614]
        0xdd, 0x05, 0x00, 0x06, 0x00, 0x00, // f0c1: fld qword [0x600]
        0xdd, 0x05, 0x30, 0xf0, 0xff, 0xff, // f0c7: fld qword [0xfffff030]
        0xdf, 0xf1, //                         f0cd: fcomip st, st(1)
        0xdd, 0xd8, //                         f0cf: fstp st(0)
        0x0f, 0x92, 0x05, 0x18, 0x06, 0x00, 0x00, // f0d1: setb [0x618]
        0x66, 0xba, 0xf8, 0x03, //             f0d8: mov dx, 0x3f8
        0xb0, 0x78, 0xee, //                   f0dc: mov al, 'x'; out dx, al
        0xa0, 0x10, 0x06, 0x00, 0x00, //       f0df: mov al, [0x610]
        0x04, 0x30, 0xee, //                   f0e4: add al, '0'; out dx, al
        0xa0, 0x14, 0x06, 0x00, 0x00, //       f0e7: mov al, [0x614]
        0x04, 0x30, 0xee, //                   f0ec: add al, '0'; out dx, al
        0xa0, 0x18, 0x06, 0x00, 0x00, //       f0ef: mov al, [0x618]
        0x04, 0x30, 0xee, //                   f0f4: add al, '0'; out dx, al
        0xb0, 0x0d, 0xee, 0xb0, 0x0a, 0xee, // f0f7: CR, LF
        0x66, 0xba, 0x10, 0x05, //             f0fd: mov dx, 0x510 (fw_cfg selector)
        0x66, 0xb8, 0x15, 0x00, 0x66, 0xef, // f101: out dx, 0x15 (the command line)
        0x66, 0xba, 0x11, 0x05, //             f107: mov dx, 0x511 (fw_cfg data)
        0xec, //                               f10b: in al, dx
        0x84, 0xc0, 0x74, 0x0b, //             f10c: test al, al; jz f11b
        0x66, 0xba, 0xf8, 0x03, 0xee, //       f110: out 0x3f8, al
        0x66, 0xba, 0x11, 0x05, //             f115: mov dx, 0x511
        0xeb, 0xf0, //                         f119: jmp f10b
        0x66, 0xba, 0xf8, 0x03, //             f11b: mov dx, 0x3f8
        0xb0, 0x0d, 0xee, 0xb0, 0x0a, 0xee, // f11f: CR, LF
        0x66, 0xba, 0xf8, 0x0c, //             f125: mov dx, 0xcf8
        0xb8, 0x40, 0x0b, 0x00, 0x80, 0xef, // f129: out dx, 0x80000b40 (00:01.3, PMBA)
        0x66, 0xba, 0xfc, 0x0c, //             f12f: mov dx, 0xcfc
        0xb8, 0x00, 0xb0, 0x00, 0x00, 0xef, // f133: out dx, 0xb000
        0x66, 0xba, 0xf8, 0x0c, //             f139: mov dx, 0xcf8
        0xb8, 0x80, 0x0b, 0x00, 0x80, 0xef, // f13d: out dx, 0x80000b80 (PMREGMISC)
        0x66, 0xba, 0xfc, 0x0c, //             f143: mov dx, 0xcfc
        0xb0, 0x01, 0xee, //                   f147: out dx, 1 (PMIOSE)
        0x66, 0xba, 0x08, 0xb0, //             f14a: mov dx, 0xb008 (the PM timer)
        0xed, 0x89, 0xc3, //                   f14e: in eax, dx; mov ebx, eax
        0xed, //                               f151: in eax, dx
        0x29, 0xd8, //                         f152: sub eax, ebx
        0x25, 0xff, 0xff, 0xff, 0x00, //       f154: and eax, 0xffffff
        0x3d, 0x4c, 0x4f, 0x1b, 0x00, //       f159: cmp eax, 1789772
        0x72, 0xf1, //                         f15e: jb f151
        0x66, 0xba, 0xf8, 0x03, //             f160: mov dx, 0x3f8
        0xb0, 0x54, 0xee, //                   f164: mov al, 'T'; out dx, al
        0xb0, 0x0d, 0xee, 0xb0, 0x0a, 0xee, // f167: CR, LF
        0xeb, 0xdb, //                         f16d: jmp f14a
    ];
    img[0xf080..0xf080 + protected.len()].copy_from_slice(protected);
    // 0xfff0: jmp near 0xf040 (relative to 0xfff3).
    img[0xfff0..0xfff3].copy_from_slice(&[0xe9, 0x4d, 0xf0]);
    img
}

#[test]
fn firmware_computes_with_the_x87_reads_fw_cfg_and_counts_on_the_pm_timer() {
    let fw = scratch("platform.fd", &platform_image());
    // A kernel for the firmware to load through fw_cfg: only its boot
    // header matters to tandem (it splits the setup off); this firmware
    // reads the command line item.
    let mut bz = vec![0u8; 8192];
    bz[0x1f1] = 1;
    bz[0x202..0x206].copy_from_slice(b"HdrS");
    let kernel = scratch("bzImage", &bz);
    let (api, snap) = (tmp("platform-api"), tmp("platform-snap"));
    let mut vm = TestVm::start(&[
        "--firmware",
        s(&fw),
        "--kernel",
        s(&kernel),
        "--cmdline",
        "tandem-fw-cfg-cmdline",
        "--machine",
        "pci",
        "--mem",
        "64M",
        "--api-sock",
        s(&api),
    ]);
    vm.remove_on_drop(snap.clone());
    // On this host's KVM every one of those x87 instructions is tandem's
    // to complete; elsewhere the CPU runs them. Either way: the same line.
    vm.wait_for("x541\r\n", WAIT);
    // The command line as tandem gives it: the user's, then what this
    // host's KVM needs.
    vm.wait_for("tandem-fw-cfg-cmdline", WAIT);
    vm.wait_for("\r\n", WAIT);
    let printed = std::time::Instant::now();
    vm.wait_for("T\r\n", WAIT);
    let half = printed.elapsed();
    assert!(
        half >= Duration::from_millis(350),
        "0.5 s of PM timer ticks took {half:?}"
    );
    let (code, m) = ctl(&api, &["metrics"]);
    assert_eq!(code, 0, "{m}");
    eprintln!("emulation: {}", m["metrics"]["emulation"]);
    // The PM block's place (PMBA, PMIOSE) is in the saved state: the
    // restored VM's timer answers at 0xB000, and its T's go on.
    let (code, a) = ctl(&api, &["snapshot", s(&snap)]);
    assert_eq!(code, 0, "{a}");
    vm.kill();
    let mut r = TestVm::start(&["--restore", s(&snap), "--firmware", s(&fw)]);
    r.wait_for("T\r\n", WAIT);
    r.wait_for("T\r\nT\r\n", WAIT);
    r.kill();
}

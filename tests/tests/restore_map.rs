//! Restore by mapping (`--restore-memory map`, the default) on a real
//! guest, the run's base snapshot restored: the snapshot file is mapped
//! into the VMM (seen in /proc/PID/maps) and never written, however much
//! the guest writes; data written by the guest survives a snapshot and a
//! restore by map, by copy (`--restore-memory copy`, not mapped) and from a
//! file of format version 2 (as tandem wrote before, copied). A file whose
//! pages are damaged stops the mapped VM with one line naming the damage
//! (exit status 3), and is refused before anything runs by a copy; a
//! damaged state section is refused before anything runs either way.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use migration::{section, Manifest, SectionKind, SnapshotReader, SnapshotWriter};
use sha2::{Digest, Sha256};
use tandem_tests::base::{base, device_args, scratch, HOST_IP0, PREFIX};
use tandem_tests::netns::NetNs;
use tandem_tests::{ctl, hex, tandem_bin, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
const TAPS: [&str; 2] = ["tap0", "tap1"];

fn file_sha(path: &Path) -> String {
    hex(&Sha256::digest(std::fs::read(path).expect("read the file")))
}

/// Whether the VMM maps `file` (the kernel names a file mapping's path).
fn maps(vm: &TestVm, file: &Path) -> bool {
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", vm.pid())).expect("maps");
    maps.lines().any(|l| l.ends_with(file.to_str().unwrap()))
}

/// `tandem run --restore FILE` with the base guest's devices in `ns`, on
/// the disk `disk`, and `extra`; not waited for.
fn start(ns: &NetNs, file: &Path, disk: &Path, extra: &[&str]) -> TestVm {
    let devices = device_args(TAPS, disk);
    let mut args = vec!["--restore", file.to_str().unwrap()];
    args.extend(devices.iter().map(String::as_str));
    args.extend_from_slice(extra);
    TestVm::start_with(ns.command(tandem_bin().to_str().unwrap()), &args)
}

/// The guest's data file's checksum, as `sha256sum` prints it.
fn data_sha(vm: &mut TestVm) -> String {
    let out = vm.ok("sha256sum /tmp/data", CMD);
    out.split_whitespace()
        .find(|w| w.len() == 64)
        .unwrap_or_else(|| panic!("no checksum in {out:?}"))
        .to_string()
}

/// `from` rewritten as format version 2, as tandem wrote before version 3:
/// the same states, the memory image in one section.
fn to_version_2(from: &Path, to: &Path) {
    let mut r = SnapshotReader::open(File::open(from).unwrap()).unwrap();
    let m: Manifest = r.read_state(section::MANIFEST).unwrap();
    assert!(m.mem_bytes <= 3 << 30, "one region below the MMIO gap");
    let file = File::create(to).unwrap();
    let mut w = SnapshotWriter::with_version(BufWriter::new(file), 2).unwrap();
    for s in r.sections().to_vec() {
        if s.kind == SectionKind::State {
            let body = r.read_state_bytes(&s.name).unwrap();
            w.write_section(&s.name, s.kind, &body).unwrap();
        }
    }
    let mut mem = vec![0u8; m.mem_bytes as usize];
    migration::read_memory(&mut r, section::MEMORY, &[(0, m.mem_bytes)], |gpa, b| {
        mem[gpa as usize..][..b.len()].copy_from_slice(b);
        Ok::<(), std::io::Error>(())
    })
    .unwrap();
    migration::write_memory(&mut w, section::MEMORY, [(0, &mem[..])]).unwrap();
    w.finish()
        .unwrap()
        .into_inner()
        .unwrap()
        .sync_all()
        .unwrap();
}

/// A copy of `from` at `to` with one byte of section `name` flipped.
fn damage(from: &Path, to: &Path, name: &str) {
    let r = SnapshotReader::open(File::open(from).unwrap()).unwrap();
    let s = r.section(name).expect("section").clone();
    let mut bytes = std::fs::read(from).unwrap();
    bytes[(s.offset + s.len / 2) as usize] ^= 0x40;
    std::fs::write(to, bytes).unwrap();
}

/// Runs `vm` (already started) to its end: the status and its stderr.
fn ended(mut vm: TestVm, within: Duration) -> (Option<i32>, String) {
    let st = vm.wait_exit(within);
    (st.code(), vm.stderr())
}

#[test]
fn restores_map_the_file_and_keep_it_unwritten() {
    let t0 = Instant::now();
    let ns = NetNs::new("rmap");
    ns.add_tap("tap0", &format!("{HOST_IP0}/{PREFIX}"));
    let b = base();
    let base_sha = file_sha(&b.snapshot);
    let sock = scratch("rmap.sock");
    let snap = scratch("rmap.snap");
    let v2 = scratch("rmap-v2.snap");
    let bad_pages = scratch("rmap-pages.snap");
    let bad_state = scratch("rmap-state.snap");

    // The base, mapped: the guest writes 2 MiB of its own (copies of the
    // mapped pages, never the file), in large writes: each system call
    // costs milliseconds here (and /dev/urandom runs emulated, slowly).
    let s = sock.to_str().unwrap();
    let mut vm = TestVm::restore_base(&ns, TAPS, &["--api-sock", s]);
    assert!(maps(&vm, &b.snapshot), "the base snapshot is not mapped");
    vm.ok(
        "dd if=/dev/zero bs=1M count=2 2>/dev/null | tr '\\000' x >/tmp/data",
        CMD,
    );
    let sha = data_sha(&mut vm);
    let (code, a) = ctl(&sock, &["snapshot", snap.to_str().unwrap()]);
    assert_eq!(code, 0, "{a}");
    drop(vm);
    assert_eq!(file_sha(&b.snapshot), base_sha, "the mapped file changed");
    let snap_sha = file_sha(&snap);
    let disk = b.disk_copy();

    // The new file, mapped (the default), by copy, and as version 2.
    let mut vm = start(&ns, &snap, &disk, &[]);
    assert_eq!(data_sha(&mut vm), sha);
    assert!(maps(&vm, &snap), "a restore by map does not map its file");
    vm.ok(
        "dd if=/dev/zero bs=1M count=2 2>/dev/null | tr '\\000' y >/tmp/data",
        CMD,
    );
    drop(vm);
    assert_eq!(
        file_sha(&snap),
        snap_sha,
        "the guest's writes reached the file"
    );
    let mut vm = start(&ns, &snap, &disk, &["--restore-memory", "copy"]);
    assert_eq!(data_sha(&mut vm), sha);
    assert!(!maps(&vm, &snap), "a restore by copy maps its file");
    drop(vm);
    to_version_2(&snap, &v2);
    let mut vm = start(&ns, &v2, &disk, &[]);
    assert_eq!(data_sha(&mut vm), sha);
    assert!(!maps(&vm, &v2), "a version 2 file is copied, not mapped");
    drop(vm);
    eprintln!(
        "map, copy and version 2 restores: {:.1} s",
        t0.elapsed().as_secs_f64()
    );

    // A damaged page: the mapped VM runs until its pages' CRC is checked,
    // then stops; a copy refuses it before the guest runs.
    damage(&snap, &bad_pages, "memory.pages");
    let (code, err) = ended(start(&ns, &bad_pages, &disk, &[]), CMD);
    assert_eq!(code, Some(3), "{err}");
    assert!(
        err.contains("memory pages CRC mismatch: the file is damaged")
            && err.contains("--restore-memory copy"),
        "{err}"
    );
    eprintln!("mapped, damaged: {}", err.trim());
    let (code, err) = ended(
        start(&ns, &bad_pages, &disk, &["--restore-memory", "copy"]),
        CMD,
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("the file is damaged"), "{err}");
    // A damaged state section: refused before anything runs, either way.
    damage(&snap, &bad_state, section::MANIFEST);
    for mode in ["map", "copy"] {
        let (code, err) = ended(
            start(&ns, &bad_state, &disk, &["--restore-memory", mode]),
            CMD,
        );
        assert_eq!(code, Some(1), "{mode}: {err}");
        assert!(err.contains("CRC mismatch: the file is damaged"), "{err}");
    }
    for f in [&snap, &v2, &bad_pages, &bad_state, &disk] {
        let _ = std::fs::remove_file::<&PathBuf>(f);
    }
    eprintln!("whole test: {:.0} s", t0.elapsed().as_secs_f64());
}

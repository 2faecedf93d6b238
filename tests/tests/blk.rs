//! virtio-blk on a real guest, in one boot: the guest boots from a copy of
//! the ext4 root disk image (`root=/dev/vda`, no initramfs) with a NIC
//! first (so disks follow NICs in the virtio-mmio sequence), a scratch disk
//! and a read-only disk. Through the device it reads (sha256 against the
//! host file), writes (the host file changes, nothing else), flushes,
//! discards and writes zeroes; the read-only disk refuses writes and stays
//! byte-identical; a host file shrunk under the guest gives I/O errors, not
//! a crash. It writes and syncs files on its root disk and reboots; the host
//! then finds them in the image (journal replayed by e2fsck, read with
//! debugfs) and the file system consistent. The counters say what happened.
//! Also: bad --disk options fail with one line, without a guest.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tandem_tests::netns::NetNs;
use tandem_tests::{guest_file, tandem_bin, tandem_output, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
const MIB: usize = 1 << 20;

fn data(len: usize, seed: u64) -> Vec<u8> {
    tandem_tests::pseudo_random(len, 0x9e37_79b9_7f4a_7c15 ^ seed)
}

fn sha(d: &[u8]) -> String {
    tandem_tests::hex(&Sha256::digest(d))
}

/// The sha256 a guest `sha256sum` printed (the shell may print job notices).
fn sum_in(out: &str) -> &str {
    out.split_whitespace()
        .find(|t| t.len() == 64 && t.chars().all(|c| c.is_ascii_hexdigit()))
        .unwrap_or_else(|| panic!("no sha256 in {out:?}"))
}

/// A directory of this test's files, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("tandem-blk-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }

    fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

fn metrics(path: &Path) -> serde_json::Value {
    tandem_tests::read_metrics(path)
}

/// The counter `key` of disk `i`.
fn counter(m: &serde_json::Value, i: usize, key: &str) -> u64 {
    m["blk"][i]["counters"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("no blk[{i}].{key} in {m}"))
}

fn tool(name: &str, args: &[&str]) -> std::process::Output {
    Command::new(name)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{name}: {e} (install e2fsprogs)"))
}

#[test]
fn root_disk_and_data_disks_on_a_real_guest() {
    let dir = Scratch::new("guest");
    // The cached image is the pristine copy: boot a copy of it.
    let root = dir.0.join("root.ext4");
    std::fs::copy(guest_file("rootfs.ext4"), &root).unwrap();
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o644)).unwrap();
    let original = data(8 * MIB, 1);
    let scratch = dir.file("scratch.img", &original);
    let golden_bytes = data(MIB, 2);
    let golden = dir.file("golden.img", &golden_bytes);
    let metrics_path = dir.0.join("metrics.json");
    let nonce = format!("tandem-blk-{}", std::process::id());

    let ns = NetNs::new("blk");
    ns.add_tap("tap0", "192.0.2.1/24");
    let kernel = guest_file("vmlinux");
    let disk = |p: &Path, extra: &str| format!("path={}{extra}", p.display());
    let mut vm = TestVm::start_with(
        ns.command(tandem_bin().to_str().unwrap()),
        &[
            "--kernel",
            kernel.to_str().unwrap(),
            "--mem",
            "128M",
            "--cmdline",
            "console=ttyS0 reboot=k panic=1 root=/dev/vda",
            "--net",
            "tap=tap0",
            "--disk",
            &disk(&root, ",id=rootdisk"),
            "--disk",
            &disk(&scratch, ",id=scratch"),
            "--disk",
            &disk(&golden, ",readonly=on,id=golden"),
            "--metrics",
            metrics_path.to_str().unwrap(),
        ],
    );
    vm.wait_ready();

    // Booted from the disk, without an initramfs, root writable.
    let mounts = vm.ok("grep ' / ' /proc/mounts", CMD);
    assert!(mounts.starts_with("/dev/root / ext4 rw"), "{mounts}");
    vm.ok("[ ! -e /init ]", CMD);
    // The NIC is there, and the disks come in --disk order with their
    // ids (GET_ID), sizes and read-only flags.
    vm.ok("[ -e /sys/class/net/eth0 ]", CMD);
    let disks = vm.ok(
        "for d in vda vdb vdc; do echo $d=$(cat /sys/block/$d/serial),\
         $(cat /sys/block/$d/size),$(cat /sys/block/$d/ro); done",
        CMD,
    );
    assert_eq!(
        disks.lines().collect::<Vec<_>>(),
        [
            "vda=rootdisk,131072,0",
            "vdb=scratch,16384,0",
            "vdc=golden,2048,1"
        ]
    );

    // Reads: what the guest reads through the device is the host file.
    // (O_DIRECT: no page cache; one program at a time.)
    vm.ok("dd if=/dev/vdb of=/tmp/s bs=64k iflag=direct", CMD);
    assert_eq!(sum_in(&vm.ok("sha256sum /tmp/s", CMD)), sha(&original));
    vm.ok("rm /tmp/s", CMD);
    vm.ok("dd if=/dev/vdc of=/tmp/g bs=64k iflag=direct", CMD);
    assert_eq!(sum_in(&vm.ok("sha256sum /tmp/g", CMD)), sha(&golden_bytes));

    // Writes (then a flush): the golden MiB lands at 2 MiB of the scratch
    // disk, and nothing else changes.
    vm.ok(
        "dd if=/tmp/g of=/dev/vdb bs=64k seek=32 oflag=direct conv=fsync",
        CMD,
    );
    let mut want = original.clone();
    want[2 * MIB..3 * MIB].copy_from_slice(&golden_bytes);
    assert!(read(&scratch) == want, "scratch disk after the write");

    // The read-only disk refuses writes; its file is unchanged.
    let (out, status) = vm.run("dd if=/tmp/g of=/dev/vdc bs=4k count=1 oflag=direct", CMD);
    assert_ne!(status, 0, "a write to the read-only disk succeeded: {out}");
    assert_eq!(
        sha(&read(&golden)),
        sha(&golden_bytes),
        "read-only disk changed"
    );

    // Discard: the first MiB reads back as zeroes, in the guest and on the host.
    vm.ok("blkdiscard -o 0 -l 1048576 /dev/vdb", CMD);
    vm.ok("dd if=/dev/vdb of=/tmp/z bs=64k count=16 iflag=direct", CMD);
    assert_eq!(sum_in(&vm.ok("sha256sum /tmp/z", CMD)), sha(&vec![0; MIB]));
    vm.ok("rm /tmp/z", CMD);
    want[..MIB].fill(0);
    // Write zeroes (BLKZEROOUT): the fifth MiB.
    vm.ok("blktool zeroout /dev/vdb 4194304 1048576", CMD);
    want[4 * MIB..5 * MIB].fill(0);
    assert!(read(&scratch) == want, "scratch disk after discard/zeroout");

    // Files on the root disk, synced.
    vm.ok(
        &format!("cp /tmp/g /root/persist && echo {nonce} >/root/note && sync"),
        CMD,
    );

    // The host file shrinks under the guest: reads past its end fail with
    // an I/O error in the guest; the VMM goes on.
    File::options()
        .write(true)
        .open(&scratch)
        .unwrap()
        .set_len(6 * MIB as u64)
        .unwrap();
    let (out, status) = vm.run(
        "dd if=/dev/vdb of=/dev/null bs=4k skip=1792 count=1 iflag=direct",
        CMD,
    );
    assert_ne!(status, 0, "read past the shrunk file succeeded: {out}");
    vm.ok(
        "dd if=/dev/vdb of=/dev/null bs=4k count=1 iflag=direct",
        CMD,
    );

    // Counters, once the metrics file has been rewritten.
    std::thread::sleep(Duration::from_secs(2));
    let m = metrics(&metrics_path);
    let ids: Vec<_> = (0..3).map(|i| m["blk"][i]["id"].clone()).collect();
    assert_eq!(ids, ["rootdisk", "scratch", "golden"], "{m}");
    assert_eq!(m["blk"][2]["readonly"], true, "{m}");
    assert!(
        counter(&m, 1, "reads") > 0 && counter(&m, 1, "read_bytes") >= 9 * MIB as u64,
        "{m}"
    );
    assert!(
        counter(&m, 1, "writes") > 0 && counter(&m, 1, "write_bytes") >= MIB as u64,
        "{m}"
    );
    assert!(counter(&m, 1, "flushes") > 0, "{m}");
    assert!(counter(&m, 1, "discards") > 0, "{m}");
    assert!(counter(&m, 1, "write_zeroes") > 0, "{m}");
    assert!(counter(&m, 1, "io_errors") > 0, "{m}");
    assert!(counter(&m, 2, "read_bytes") >= MIB as u64, "{m}");
    assert_eq!(counter(&m, 2, "writes"), 0, "{m}");
    for i in 0..3 {
        assert!(counter(&m, i, "get_ids") > 0, "{m}");
        assert_eq!(counter(&m, i, "malformed_chains"), 0, "{m}");
        assert_eq!(counter(&m, i, "unsupported"), 0, "{m}");
        assert_eq!(counter(&m, i, "bad_register_accesses"), 0, "{m}");
    }
    assert_eq!(counter(&m, 0, "io_errors"), 0, "{m}");
    assert!(counter(&m, 0, "flushes") > 0, "journal commits flush: {m}");

    // Reboot: tandem exits 0, and what the guest synced is in the image.
    vm.send("reboot -f\n");
    let st = vm.wait_exit(tandem_tests::budget(Duration::from_secs(40)));
    assert_eq!(st.code(), Some(0), "{}", vm.stderr());
    let image = root.to_str().unwrap();
    // The guest did not unmount: e2fsck replays the journal (exit 1, "fixed")
    // and must find nothing it cannot fix; then the image is clean.
    let fsck = tool("e2fsck", &["-fp", image]);
    assert!(
        matches!(fsck.status.code(), Some(0 | 1)),
        "e2fsck -fp: {fsck:?}"
    );
    let fsck = tool("e2fsck", &["-fn", image]);
    assert_eq!(fsck.status.code(), Some(0), "e2fsck -fn: {fsck:?}");
    let persist = tool("debugfs", &["-R", "cat /root/persist", image]);
    assert!(persist.stdout == golden_bytes, "/root/persist in the image");
    let note = tool("debugfs", &["-R", "cat /root/note", image]);
    assert_eq!(String::from_utf8_lossy(&note.stdout).trim(), nonce);
}

#[test]
fn bad_disk_options_fail_with_one_line() {
    let dir = Scratch::new("bad");
    let kernel = guest_file("vmlinux");
    let run = |disks: &[&str]| {
        let mut args = vec!["run", "--kernel", kernel.to_str().unwrap()];
        for d in disks {
            args.extend(["--disk", d]);
        }
        tandem_output(&args)
    };
    let check = |out: std::process::Output, expect: &str| {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "stderr: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        assert!(
            err.starts_with("tandem: ") && err.contains(expect),
            "{expect:?}: {err}"
        );
        assert!(out.stdout.is_empty(), "no guest");
    };
    check(run(&["disk.img"]), "expected path=FILE");
    check(
        run(&["path=a.img,readonly=yes"]),
        "readonly must be 'on' or 'off'",
    );
    check(
        run(&["path=a.img,id=a-name-longer-than-twenty"]),
        "id must be 1 to 20",
    );
    let missing = format!("path={}", dir.0.join("missing.img").display());
    check(run(&[&missing]), "No such file or directory");
    check(
        run(&[&format!("path={}", dir.0.display())]),
        "Is a directory",
    );
    check(
        run(&["path=/dev/null,readonly=on"]),
        "not a regular file or a block device",
    );
    // An image another process holds is refused, read-only included; so is
    // the same image given twice when either is writable.
    let img = dir.file("busy.img", &[0; 4096]);
    let rw = format!("path={}", img.display());
    let ro = format!("path={},readonly=on", img.display());
    let holder = File::open(&img).unwrap();
    // SAFETY: flock on a descriptor we own; no memory is passed.
    assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX) }, 0);
    check(run(&[&rw]), "is in use");
    check(run(&[&ro]), "is in use");
    drop(holder);
    check(run(&[&rw, &ro]), "is in use");
    check(run(&[&ro, &rw]), "is in use");
}

//! A PCI machine (`--machine pci`) on a real guest, in one boot: ACPI
//! tables (the guest finds the root bridge, ECAM, the RTC and fw_cfg in
//! them; configuration space reads the same through ECAM as through the
//! ports), PCI bus 0
//! with its host bridge, fw_cfg, a virtio-net NIC and a virtio-blk disk as
//! virtio-pci functions (MSI-X, the machine's default transport) beside a
//! disk on virtio-mmio (`transport=mmio`). The guest finds them, its NIC
//! answers the host through its tap and its disks read and write; the VM
//! is snapshotted and restored in a new process (a restore that asks for
//! another machine or transport is refused, naming it), then migrated to
//! a third tandem, where the NIC and disks still work (the MSI-X routes
//! and BARs are set again from the saved state).
//!
//! That VM is then protected by a COLO pair: a `--machine pci` secondary
//! with the same devices on copies of the disks (a secondary booted from
//! firmware is refused first, naming it, the primary running on). A
//! client's TCP stream runs through the pair, the guest writes files on
//! the ext4 filesystem of its virtio-pci disk across checkpoints and
//! syncs, and the primary is SIGKILLed: the secondary serves from its last
//! checkpoint (the guest answers pings on the secondary's tap, its MSI-X
//! interrupts count on, its RTC is as far ahead as the guest set it in
//! the pair, fw_cfg and the host bridge answer, the stream arrives whole,
//! the files read back),
//! and once its guest synced and unmounted, `e2fsck -fn` finds the
//! secondary's image clean and debugfs reads the files in it. Its
//! power-off, through ACPI, exits 0.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use migration::devices::DeviceState;
use migration::{section, SnapshotReader};
use sha2::{Digest, Sha256};
use tandem_tests::base::{scratch, GUEST_IP0, HOST_IP0, PREFIX};
use tandem_tests::colo::{checkpoint_now, status, wait_checkpoints, wait_until};
use tandem_tests::netns::NetNs;
use tandem_tests::rtc;
use tandem_tests::stream::{Pace, Stream};
use tandem_tests::{ctl, guest_file, phase, tandem_bin, tandem_output, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
const EXIT: Duration = tandem_tests::budget(Duration::from_secs(30));
const MAC: &str = "52:54:00:00:00:c1";
/// The PCI disk: an ext4 filesystem of [`FS_BYTES`], then pseudo-random
/// bytes up to [`DISK_BYTES`].
const DISK_BYTES: usize = 8 << 20;
const FS_BYTES: usize = 6 << 20;
/// Where the guest writes on its PCI disk (a sector number), past the
/// filesystem.
const MARK_SECTOR: u64 = 7 << 11;
const MARK: &str = "tandem-pci-mark";
/// Where a PCI machine's ECAM is (vmm/src/boot/layout.rs; README, `--machine`).
const ECAM: u64 = 0xf000_0000;

/// The command line tandem gives the default guest on this host, before
/// what the host needs is appended (README, "Using it"), with eth0's
/// address. fw_cfg's ports need no parameter: the DSDT names them.
fn cmdline() -> String {
    let base = if tandem_tests::host_is_emulated() {
        "console=ttyS0 reboot=k panic=1 quiet"
    } else {
        "console=ttyS0 reboot=k panic=1"
    };
    format!("{base} tandem.ip={GUEST_IP0}/{PREFIX}")
}

fn sha(d: &[u8]) -> String {
    tandem_tests::hex(&Sha256::digest(d))
}

/// The guest's block device whose serial is `id` (`/dev/vdX`).
fn disk_named(vm: &mut TestVm, id: &str) -> String {
    let dev = vm.ok(
        &format!("grep -l '^{id}$' /sys/block/vd*/serial | cut -d/ -f4"),
        CMD,
    );
    assert!(dev.starts_with("vd"), "no disk {id}: {dev:?}");
    format!("/dev/{dev}")
}

/// The guest's MSI-X interrupts: (PCI device number, name, count) of each
/// (the hardware number Linux shows is the function's bus/device/function
/// above bit 11, the vector below).
fn msi_counts(vm: &mut TestVm) -> Vec<(u64, String, u64)> {
    let lines = vm.ok("grep PCI-MSI /proc/interrupts", CMD);
    lines
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let counts: Vec<u64> = f[1..].iter().map_while(|t| t.parse::<u64>().ok()).collect();
            let hw = f
                .iter()
                .find_map(|t| t.strip_suffix("-edge"))
                .and_then(|t| t.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no hardware number in {l:?}"));
            let slot = (hw >> 11) >> 3;
            (slot, f.last().unwrap().to_string(), counts.iter().sum())
        })
        .collect()
}

/// The host pings the guest through its PCI NIC (rx and tx queues, each
/// with its MSI-X vector).
fn ping(ns: &NetNs) {
    let out = ns
        .command("ping")
        .args(["-c", "3", "-i", "0.2", "-W", "5", GUEST_IP0])
        .stdout(Stdio::piped())
        .output()
        .expect("ping");
    assert!(
        out.status.success(),
        "ping the guest: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// The guest's NIC and disks work: ping, the PCI disk reads as the host
/// file (sha256), the mark the guest wrote is there, the mmio disk reads.
fn devices_work(vm: &mut TestVm, ns: &NetNs, pci_sha: &str, mark: &str) {
    ping(ns);
    let dev = disk_named(vm, "pcidisk");
    let out = vm.ok(&format!("sha256sum {dev}"), CMD);
    assert!(out.starts_with(pci_sha), "{dev}: {out} (host: {pci_sha})");
    let got = vm.ok(
        &format!("dd if={dev} bs=512 skip={MARK_SECTOR} count=1 2>/dev/null | head -c 15"),
        CMD,
    );
    assert_eq!(got, mark);
    let mmio = disk_named(vm, "mmiodisk");
    let n = vm.ok(&format!("dd if={mmio} bs=4096 2>/dev/null | wc -c"), CMD);
    assert_eq!(n, (1 << 20).to_string());
}

struct Setup {
    ns: NetNs,
    pci_disk: std::path::PathBuf,
    mmio_disk: std::path::PathBuf,
}

impl Setup {
    /// The device options: the NIC on `tap`, both disks.
    fn devices(&self, tap: &str) -> Vec<String> {
        self.devices_on(tap, &self.pci_disk, &self.mmio_disk)
    }

    /// [`Setup::devices`] on other disk images.
    fn devices_on(&self, tap: &str, pci: &Path, mmio: &Path) -> Vec<String> {
        vec![
            "--net".into(),
            format!("tap={tap},mac={MAC}"),
            "--disk".into(),
            format!("path={},id=pcidisk", pci.display()),
            "--disk".into(),
            format!("path={},id=mmiodisk,transport=mmio", mmio.display()),
        ]
    }

    fn start(&self, args: &[String]) -> TestVm {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        TestVm::start_with(self.ns.command(tandem_bin().to_str().unwrap()), &args)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.pci_disk);
        let _ = std::fs::remove_file(&self.mmio_disk);
    }
}

#[test]
fn a_pci_machine_with_virtio_pci_devices_boots_restores_and_migrates() {
    let ns = NetNs::new("pci");
    ns.add_bridge("br0", &format!("{HOST_IP0}/{PREFIX}"), &["tap0", "tap1"]);
    let s = Setup {
        ns,
        pci_disk: scratch("pci-disk.img"),
        mmio_disk: scratch("mmio-disk.img"),
    };
    let mut content = tandem_tests::pseudo_random(DISK_BYTES, 0x5eed);
    content[..FS_BYTES].copy_from_slice(&ext4_image(FS_BYTES));
    std::fs::write(&s.pci_disk, &content).unwrap();
    std::fs::write(&s.mmio_disk, vec![0u8; 1 << 20]).unwrap();
    let sock = scratch("pci.sock");
    let snap = scratch("pci.snap");
    let (kernel, initrd) = (guest_file("vmlinux"), guest_file("initramfs.cpio"));
    let mut args: Vec<String> = [
        "--kernel",
        kernel.to_str().unwrap(),
        "--initrd",
        initrd.to_str().unwrap(),
        "--cpus",
        "2",
        // Not the default size: the destination below, given no --mem,
        // must take the source's.
        "--mem",
        "192M",
        "--machine",
        "pci",
        "--api-sock",
        sock.to_str().unwrap(),
        "--cmdline",
        &cmdline(),
    ]
    .map(String::from)
    .to_vec();
    args.extend(s.devices("tap0"));
    let mut vm = s.start(&args);
    vm.wait_ready();
    vm.remove_on_drop(snap.clone());
    phase("pci: booted");
    // ACPI's fixed events enable (PM1a_EN keeps its bits), PCI is found:
    // nothing at error level in the kernel's log.
    vm.assert_clean_boot();
    assert_eq!(vm.ok("nproc", CMD), "2");
    acpi(&mut vm);
    host_bridge_and_fw_cfg(&mut vm);
    // Linux's ACPI and PCI code made no access the PM1a block or the bus
    // had to refuse.
    let (code, m) = ctl(&sock, &["metrics"]);
    assert_eq!(code, 0, "{m}");
    assert_eq!(m["metrics"]["acpi_pm"]["ignored_accesses"], 0, "{m}");
    assert_eq!(m["metrics"]["pci"]["bad_accesses"], 0, "{m}");
    let found = vm.ok(
        "for d in /sys/bus/pci/devices/*; do echo ${d##*/} $(cat $d/vendor $d/device); done",
        CMD,
    );
    assert_eq!(
        found.lines().collect::<Vec<_>>(),
        [
            "0000:00:00.0 0x8086 0x1237",
            "0000:00:01.0 0x1af4 0x1041",
            "0000:00:02.0 0x1af4 0x1042",
        ],
        "{found}"
    );
    let driver = vm.ok("ls /sys/bus/pci/drivers/virtio-pci", CMD);
    assert!(driver.contains("0000:00:01.0") && driver.contains("0000:00:02.0"));

    // The guest writes a mark on its PCI disk; the host file has it.
    let dev = disk_named(&mut vm, "pcidisk");
    vm.ok(
        &format!("printf {MARK} | dd of={dev} bs=512 seek={MARK_SECTOR} conv=fsync 2>/dev/null"),
        CMD,
    );
    let at = (MARK_SECTOR * 512) as usize;
    // dd writes the mark's 15 bytes; the rest of the sector stays.
    content[at..at + MARK.len()].copy_from_slice(MARK.as_bytes());
    assert_eq!(
        std::fs::read(&s.pci_disk).unwrap()[at..at + 512],
        content[at..at + 512]
    );
    let pci_sha = sha(&content);
    devices_work(&mut vm, &s.ns, &pci_sha, MARK);
    let before = msi_counts(&mut vm);
    let names: Vec<String> = before
        .iter()
        .map(|(slot, n, _)| format!("{slot}:{}", n.split('-').nth(1).unwrap_or("")))
        .collect();
    for want in ["1:config", "1:input.0", "1:output.0", "2:config", "2:req.0"] {
        assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
    }
    assert!(net_irqs(&before) > 0, "{before:?}");
    let config = |vm: &mut TestVm| {
        vm.ok(
            "od -An -tx1 -N64 /sys/bus/pci/devices/0000:00:01.0/config",
            CMD,
        )
    };
    let config_before = config(&mut vm);

    // Snapshot, and restores that ask for another machine or transport.
    let (code, a) = ctl(&sock, &["snapshot", snap.to_str().unwrap()]);
    assert_eq!(code, 0, "{a}");
    vm.kill();
    let pm1_en = pm1_enable(&snap);
    assert_ne!(
        pm1_en & GBL_EN,
        0,
        "Linux enables the global lock's event: {pm1_en:#x}"
    );
    phase("pci: snapshot taken");
    refused(
        &snap,
        &["--machine", "legacy"],
        "snapshot has PCI host bridge pci0",
    );
    let mut mmio_net = vec!["--restore".to_string(), snap.display().to_string()];
    mmio_net.extend(s.devices("tap0"));
    mmio_net[3] = format!("tap=tap0,mac={MAC},transport=mmio");
    let mmio_net: Vec<&str> = mmio_net.iter().map(String::as_str).collect();
    refused_args(
        &mmio_net,
        "device net0: snapshot has it on PCI at 00:01.0 (transport=pci), \
         this VM puts it on virtio-mmio (transport=mmio)",
    );

    let mut restore = vec![
        "--restore".to_string(),
        snap.display().to_string(),
        "--api-sock".into(),
        sock.display().to_string(),
    ];
    restore.extend(s.devices("tap0"));
    let mut again = s.start(&restore);
    again.ok("true", CMD);
    phase("pci: restored");
    assert_eq!(config(&mut again), config_before);
    let resnap = scratch("pci-again.snap");
    let (code, a) = ctl(&sock, &["snapshot", resnap.to_str().unwrap()]);
    assert_eq!(code, 0, "{a}");
    assert_eq!(pm1_enable(&resnap), pm1_en, "PM1_EN after a restore");
    std::fs::remove_file(&resnap).unwrap();
    devices_work(&mut again, &s.ns, &pci_sha, MARK);
    let after = msi_counts(&mut again);
    assert!(
        net_irqs(&after) > net_irqs(&before),
        "{before:?} -> {after:?}"
    );

    // Migration to a third tandem (thread mode, Unix socket): the NIC
    // moves to tap1 on the same bridge, the disks are handed over. Given
    // no --mem, a destination takes the source's size and vCPU count; a
    // --cpus that differs is refused before any memory moves, naming both,
    // and the guest runs on at the source.
    let to = scratch("pci-mig.sock");
    let dest_sock = scratch("pci-dest.sock");
    let destination = |extra: &[&str]| {
        let mut dest_args = vec![
            "--incoming".to_string(),
            format!("unix:{}", to.display()),
            "--machine".into(),
            "pci".into(),
            "--api-sock".into(),
            dest_sock.display().to_string(),
        ];
        dest_args.extend(extra.iter().map(|a| a.to_string()));
        dest_args.extend(s.devices("tap1"));
        let mut dest = s.start(&dest_args);
        let t = Instant::now();
        while !dest.stderr().contains("waiting for a migration on") {
            assert!(t.elapsed() < CMD && dest.running(), "{}", dest.stderr());
            std::thread::sleep(Duration::from_millis(50));
        }
        dest
    };
    let migrate = || {
        let out =
            s.ns.command(tandem_bin().to_str().unwrap())
                .args(["ctl", "--api-sock", sock.to_str().unwrap(), "migrate"])
                .arg(format!("unix:{}", to.display()))
                .arg("--json")
                .output()
                .expect("tandem ctl migrate");
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        (out, report)
    };
    let mut wrong = destination(&["--cpus", "1"]);
    let (out, report) = migrate();
    assert_eq!(out.status.code(), Some(1), "{report}");
    let said = format!("{report} {}", String::from_utf8_lossy(&out.stderr));
    assert!(
        said.contains("the source has 2 vCPUs, this VM asks for 1"),
        "{said}"
    );
    assert_eq!(wrong.wait_exit(EXIT).code(), Some(1), "{}", wrong.stderr());
    again.ok("true", CMD);
    phase("pci: a destination with another vCPU count refused");
    let _ = std::fs::remove_file(&to);

    let mut dest = destination(&[]);
    let (out, report) = migrate();
    assert_eq!(
        (out.status.code(), report["phase"].as_str()),
        (Some(0), Some("completed")),
        "{report} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(again.wait_exit(EXIT).code(), Some(0), "the source exits 0");
    phase("pci: migrated");
    let (code, st) = ctl(&dest_sock, &["status"]);
    assert_eq!(code, 0, "{st}");
    assert_eq!(
        (st["mem_mib"].as_u64(), st["vcpus"].as_u64()),
        (Some(192), Some(2)),
        "{st}"
    );
    assert_eq!(config(&mut dest), config_before);
    devices_work(&mut dest, &s.ns, &pci_sha, MARK);

    let (mut sec, image, hash) = colo_pair(&s, &mut dest, &dest_sock);
    sec.send("poweroff -f\n");
    let st = sec.wait_exit(EXIT);
    assert_eq!(st.code(), Some(0), "guest poweroff ends tandem with 0");
    // Through ACPI (S5), not the console's power-off line.
    assert!(
        !sec.stderr().contains("made no ACPI power-off"),
        "{}",
        sec.stderr()
    );
    image_holds(&image, &hash);
    phase("pci: the secondary powered off; its image is clean and holds the files");
    let _ = std::fs::remove_file(&to);
    let _ = std::fs::remove_file(&dest_sock);
}

/// The guest's MSI-X interrupts of its NIC (00:01.0).
/// PM1_EN's global lock event bit.
const GBL_EN: u16 = 1 << 5;

/// The PM1_EN a snapshot holds (in its PCI bus's section).
fn pm1_enable(snap: &Path) -> u16 {
    let mut r = SnapshotReader::open(std::fs::File::open(snap).unwrap()).unwrap();
    match r.read_state(&section::device("pci0")).unwrap() {
        DeviceState::Pci(p) => p.pm1_enable,
        other => panic!("the PCI section holds {other:?}"),
    }
}

fn net_irqs(c: &[(u64, String, u64)]) -> u64 {
    c.iter()
        .filter(|(s, _, _)| *s == 1)
        .map(|(_, _, c)| c)
        .sum()
}

/// An ext4 filesystem of `bytes`, made on the host.
fn ext4_image(bytes: usize) -> Vec<u8> {
    let path = scratch("pci-fs.img");
    std::fs::write(&path, vec![0u8; bytes]).unwrap();
    let out = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("mkfs.ext4 ({e}): run resources/setup.sh (e2fsprogs)"));
    assert!(out.status.success(), "mkfs.ext4: {out:?}");
    let image = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    image
}

/// How far ahead of the host's clock the guest sets its RTC in the pair.
const RTC_AHEAD_S: i64 = 3600;

/// The client's stream through the pair: 2 MiB, 16 KiB every 200 ms
/// (some 26 s; the kill comes some 7 s in), from before the pair started
/// until after the failover.
const THROUGH: Pace = Pace {
    bytes: 2 << 20,
    piece: 16 << 10,
    every: Duration::from_millis(200),
};

/// The running PCI VM `primary` (its API at `api`, its NIC on tap1)
/// protected by a COLO pair whose secondary (`--machine pci`, the same
/// devices on tap0 and on copies of the disks) takes over when the
/// primary is killed. Returns the serving secondary (its guest's disk
/// unmounted), its PCI disk's image and the files' SHA-256.
fn colo_pair(s: &Setup, primary: &mut TestVm, api: &Path) -> (TestVm, PathBuf, String) {
    // Copies of the disks as they are now: the guest does not write them
    // until the pair started.
    let (pci, mmio) = (scratch("pci-disk2.img"), scratch("mmio-disk2.img"));
    std::fs::copy(&s.pci_disk, &pci).unwrap();
    std::fs::copy(&s.mmio_disk, &mmio).unwrap();
    let (lease, sec_api) = (scratch("pci-colo.lock"), scratch("pci-colo-s.api"));
    let lease_s = lease.display().to_string();
    let start = |n: u32, extra: &[&str]| {
        let sock = scratch(&format!("pci-colo{n}.sock"));
        let addr = format!("unix:{}", sock.display());
        let mut args: Vec<String> = [
            "--colo",
            "secondary",
            "--colo-listen",
            &addr,
            "--colo-lease",
            &lease_s,
            "--machine",
            "pci",
            "--api-sock",
            sec_api.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec();
        args.extend(extra.iter().map(|a| a.to_string()));
        args.extend(s.devices_on("tap0", &pci, &mmio));
        let mut vm = s.start(&args);
        vm.remove_on_drop(sock);
        wait_until("the secondary listens", CMD, || {
            vm.stderr().contains("waiting for a migration on")
        });
        let (code, a) = ctl(
            api,
            &[
                "colo-start",
                &addr,
                "--lease",
                &lease_s,
                "--checkpoint-period-ms",
                "2000",
            ],
        );
        assert_eq!(code, 0, "colo-start: {a}");
        vm
    };
    // A secondary booted from firmware is not this VM: refused before any
    // memory moves, naming it; the primary runs on.
    let junk = scratch("pci-junk.fd");
    std::fs::write(&junk, vec![0xf4u8; 64 << 10]).unwrap();
    let mut wrong = start(0, &["--firmware", junk.to_str().unwrap()]);
    wrong.remove_on_drop(junk);
    assert_eq!(wrong.wait_exit(CMD).code(), Some(1), "{}", wrong.stderr());
    let mut st = serde_json::Value::Null;
    wait_until("the primary gives up the pair", CMD, || {
        st = status(api);
        st["state"] == "retired"
    });
    let why = "the source's VM booted without firmware";
    assert!(st["reason"].as_str().unwrap_or("").contains(why), "{st}");
    assert_eq!(st["sync"]["sent_bytes"].as_u64(), Some(0), "{st}");
    primary.ok("true", CMD);
    phase("pci: a secondary booted from firmware refused");

    let stream = Stream::start(primary, &s.ns, 5001, 31, THROUGH);
    let mut sec = start(1, &[]);
    for f in [pci.clone(), mmio, lease.clone(), alone_mark(&lease)] {
        sec.remove_on_drop(f);
    }
    wait_checkpoints(api, 1);
    phase("pci: protected");
    // The RTC set ahead in the pair: only a checkpoint carries that to the
    // secondary.
    rtc::set_ahead(primary, RTC_AHEAD_S);
    let dev = disk_named(primary, "pcidisk");
    primary.ok(
        &format!(
            "mount -t ext4 {dev} /mnt && dd if=/dev/urandom of=/mnt/one bs=32768 count=2 \
             2>/dev/null && sync"
        ),
        CMD,
    );
    let sum = primary.ok("sha256sum /mnt/one", CMD);
    let hash = sum
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    checkpoint_now(api, &sec_api);
    primary.ok("cp /mnt/one /mnt/two && sync", CMD);
    let irqs = net_irqs(&msi_counts(primary));
    let st = checkpoint_now(api, &sec_api);
    phase(&format!("pci: files written across checkpoints: {st}"));
    assert!(stream.running(), "the stream runs across the failover");
    primary.kill();
    let killed = Instant::now();
    wait_until("the secondary serves", CMD, || {
        status(&sec_api)["state"] == "failed_over"
    });
    phase(&format!(
        "pci: failed over {} ms after the kill",
        killed.elapsed().as_millis()
    ));
    // Its console shows first what its guest printed from the last
    // checkpoint on: one command to get past.
    sec.number_from(100_000);
    sec.run("true", CMD);
    ping(&s.ns);
    let ahead = RTC_AHEAD_S as f64;
    rtc::assert_offset(&mut sec, ahead - 10.0, ahead, "after the failover");
    host_bridge_and_fw_cfg(&mut sec);
    let after = net_irqs(&msi_counts(&mut sec));
    assert!(
        after > irqs,
        "MSI-X interrupts of the NIC: {irqs} then {after}"
    );
    for f in ["/mnt/one", "/mnt/two"] {
        let got = sec.ok(&format!("sha256sum {f}"), CMD);
        assert!(got.starts_with(&hash), "{f} after the failover: {got}");
    }
    stream.check(&mut sec);
    sec.ok("echo served-after > /mnt/three && sync && umount /mnt", CMD);
    phase("pci: the secondary serves: pings, MSI-X, the stream and the files");
    (sec, pci, hash)
}

/// The lease's alone mark (the primary's, once it served alone).
fn alone_mark(lease: &Path) -> PathBuf {
    let mut mark = lease.to_path_buf().into_os_string();
    mark.push(".alone");
    mark.into()
}

/// The secondary's PCI disk image once its guest unmounted it: clean
/// (`e2fsck -fn`), with the files written before the failover (`hash`)
/// and after it.
fn image_holds(image: &Path, hash: &str) {
    let fs = scratch("pci-fs-check.img");
    let bytes = std::fs::read(image).unwrap();
    std::fs::write(&fs, &bytes[..FS_BYTES]).unwrap();
    let tool = |name: &str, args: &[&str]| {
        std::process::Command::new(name)
            .args(args)
            .arg(&fs)
            .output()
            .unwrap_or_else(|e| panic!("{name}: {e} (install e2fsprogs)"))
    };
    let fsck = tool("e2fsck", &["-fn"]);
    assert_eq!(fsck.status.code(), Some(0), "e2fsck -fn: {fsck:?}");
    for f in ["/one", "/two"] {
        let out = tool("debugfs", &["-R", &format!("cat {f}")]);
        let got = tandem_tests::hex(&Sha256::digest(&out.stdout));
        assert_eq!(got, hash, "{f} in the image");
    }
    let out = tool("debugfs", &["-R", "cat /three"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "served-after");
    let _ = std::fs::remove_file(&fs);
}

/// The guest found tandem's ACPI tables and the devices the DSDT names;
/// each function's first 48 bytes of configuration space read the same
/// through ECAM (busybox devmem on /dev/mem, 32 bits at a time) as through
/// sysfs (the kernel reads them through ports 0xCF8/0xCFC); an empty slot
/// reads all ones.
fn acpi(vm: &mut TestVm) {
    let tables = vm.ok("ls /sys/firmware/acpi/tables | grep -x '[A-Z]*'", CMD);
    assert_eq!(
        tables.lines().collect::<Vec<_>>(),
        ["APIC", "DSDT", "FACP", "FACS", "MCFG"],
        "{tables}"
    );
    let devices = vm.ok("ls /sys/bus/acpi/devices | tr '\\n' ' '", CMD);
    for want in ["PNP0A08:00", "PNP0C02:00", "PNP0B00:00", "QEMU0002:00"] {
        assert!(devices.contains(want), "{want} in {devices}");
    }
    let log = vm.ok("dmesg | grep -E 'MMCONFIG|HW-reduced|PCI0' | head -20", CMD);
    assert!(
        log.contains("MMCONFIG for domain 0000 [bus 00-00] at [mem 0xf0000000-0xf00fffff]"),
        "{log}"
    );
    assert!(vm.ok("ls /dev/rtc0", CMD).contains("rtc0"));
    for slot in 0..3u64 {
        let sysfs = vm.ok(
            &format!("od -An -tx4 -N48 -v /sys/bus/pci/devices/0000:00:0{slot}.0/config"),
            CMD,
        );
        let ecam = vm.ok(
            &format!(
                "for r in $(seq 0 4 44); do devmem $(({ECAM:#x} + ({slot} << 15) + r)) 32; done"
            ),
            CMD,
        );
        let ecam: Vec<String> = ecam
            .split_whitespace()
            .map(|w| {
                format!(
                    "{:08x}",
                    u32::from_str_radix(w.trim_start_matches("0x"), 16).unwrap()
                )
            })
            .collect();
        assert_eq!(
            sysfs.split_whitespace().collect::<Vec<_>>(),
            ecam,
            "00:0{slot}.0: sysfs vs ECAM"
        );
    }
    let empty = vm.ok(&format!("devmem {:#x} 32", ECAM + (9 << 15)), CMD);
    assert_eq!(empty, "0xFFFFFFFF");
}

/// The host bridge at 00:00.0 (its command register set by the guest
/// through the config ports) and fw_cfg (interface 1, an empty boot
/// order, one RAM entry of 128 MiB in etc/e820).
fn host_bridge_and_fw_cfg(vm: &mut TestVm) {
    let bridge = "/sys/bus/pci/devices/0000:00:00.0";
    let ids = vm.ok(
        &format!("cat {bridge}/vendor {bridge}/device {bridge}/class"),
        CMD,
    );
    assert_eq!(
        ids.split_whitespace().collect::<Vec<_>>(),
        ["0x8086", "0x1237", "0x060000"],
        "{ids}"
    );
    // setpci is not in busybox: dd at offset 4.
    vm.ok(
        &format!("printf '\\007' | dd of={bridge}/config bs=1 seek=4 conv=notrunc 2>/dev/null"),
        CMD,
    );
    let head = vm.ok(&format!("od -An -tx1 -N8 {bridge}/config"), CMD);
    assert_eq!(
        head.split_whitespace().collect::<Vec<_>>(),
        ["86", "80", "37", "12", "07", "00", "00", "00"],
        "{head}"
    );
    let fw = "/sys/firmware/qemu_fw_cfg";
    assert_eq!(vm.ok(&format!("cat {fw}/rev"), CMD), "1");
    let sizes = vm.ok(
        &format!("cat {fw}/by_name/bootorder/size {fw}/by_name/etc/e820/size"),
        CMD,
    );
    assert_eq!(sizes.split_whitespace().collect::<Vec<_>>(), ["0", "20"]);
    let e820 = vm.ok(&format!("od -An -tx1 -v {fw}/by_name/etc/e820/raw"), CMD);
    // One RAM entry: address 0, the guest's 192 MiB (0x0c000000), type 1.
    let want = "00 00 00 00 00 00 00 00 00 00 00 0c 00 00 00 00 01 00 00 00";
    assert_eq!(e820.split_whitespace().collect::<Vec<_>>().join(" "), want);
}

/// `tandem run --restore SNAP EXTRA` fails with one line containing `want`.
fn refused(snap: &Path, extra: &[&str], want: &str) {
    let mut args = vec!["--restore", snap.to_str().unwrap()];
    args.extend_from_slice(extra);
    refused_args(&args, want);
}

fn refused_args(args: &[&str], want: &str) {
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    let out = tandem_output(&all);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(want), "{err}");
}

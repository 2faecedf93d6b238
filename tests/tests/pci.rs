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
//! and BARs are set again from the saved state); power-off, through ACPI,
//! exits 0.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tandem_tests::base::{scratch, GUEST_IP0, HOST_IP0, PREFIX};
use tandem_tests::netns::NetNs;
use tandem_tests::{ctl, guest_file, phase, tandem_bin, tandem_output, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
const EXIT: Duration = tandem_tests::budget(Duration::from_secs(30));
const MAC: &str = "52:54:00:00:00:c1";
/// Where the guest writes on its PCI disk (a sector number).
const MARK_SECTOR: u64 = 100;
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
        vec![
            "--net".into(),
            format!("tap={tap},mac={MAC}"),
            "--disk".into(),
            format!("path={},id=pcidisk", self.pci_disk.display()),
            "--disk".into(),
            format!(
                "path={},id=mmiodisk,transport=mmio",
                self.mmio_disk.display()
            ),
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
    let content = tandem_tests::pseudo_random(8 << 20, 0x5eed);
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
    let mut content = content;
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
    let net_irqs = |c: &[(u64, String, u64)]| -> u64 {
        c.iter()
            .filter(|(s, _, _)| *s == 1)
            .map(|(_, _, c)| c)
            .sum()
    };
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
    dest.send("poweroff -f\n");
    let st = dest.wait_exit(EXIT);
    assert_eq!(st.code(), Some(0), "guest poweroff ends tandem with 0");
    // Through ACPI (S5), not the console's power-off line.
    assert!(
        !dest.stderr().contains("made no ACPI power-off"),
        "{}",
        dest.stderr()
    );
    let _ = std::fs::remove_file(&to);
    let _ = std::fs::remove_file(&dest_sock);
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

//! Boots real guests under KVM and checks them through the serial console.
//! Each test is one boot (half a minute to a minute here): checks share it.
//! One boots a PCI machine (`--machine pci`) and restores it once.

use std::time::Duration;

use tandem_tests::base::scratch;
use tandem_tests::{ctl, guest_file, tail, tandem_output, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
const EXIT: Duration = tandem_tests::budget(Duration::from_secs(30));

/// The command line tandem gives the default guest on this host, before
/// what the host needs is appended (README, "Using it").
fn boot_cmdline() -> &'static str {
    if tandem_tests::host_is_emulated() {
        "console=ttyS0 reboot=k panic=1 quiet"
    } else {
        "console=ttyS0 reboot=k panic=1"
    }
}

#[test]
fn default_guest_on_one_vcpu_runs_commands_and_reboots() {
    // No --kernel: the default guest from target/guest.
    let mut vm = TestVm::start(&["--cpus", "1"]);
    vm.wait_ready();

    let release = vm.ok("uname -r", CMD);
    assert!(release.starts_with("6.1."), "uname -r said {release:?}");
    assert_eq!(vm.ok("nproc", CMD), "1");
    assert_eq!(vm.ok("echo $((6 * 7))", CMD), "42");
    let (out, status) = vm.run("false", CMD);
    assert_eq!(
        (out.as_str(), status),
        ("", 1),
        "exit status reaches the shell"
    );

    // 100 programs started one after another, each a fresh exec.
    let count = vm.ok(
        "i=0; while [ $i -lt 100 ] && /bin/true; do i=$((i+1)); done; echo $i",
        tandem_tests::budget(Duration::from_secs(120)),
    );
    assert_eq!(count, "100");

    // Pipelines: data flows through two and three real processes.
    assert_eq!(vm.ok("echo hello tandem | tr a-z A-Z", CMD), "HELLO TANDEM");
    assert_eq!(vm.ok("seq 1 50 | grep 3 | wc -l", CMD), "14");
    // On this host the kernel's command line gives every process glibc's
    // SSE2 string functions (README, known issues: AVX upper halves do not
    // survive a task switch under a noxsave kernel; the snapshot test's
    // sha256sum lines caught it).
    if tandem_tests::host_is_emulated() {
        let tunables = vm.ok("echo $GLIBC_TUNABLES", CMD);
        assert!(
            tunables.starts_with("glibc.cpu.hwcaps=-AVX,-AVX2,"),
            "GLIBC_TUNABLES in the guest: {tunables:?}"
        );
    }
    let listed = vm.ok("ls /proc | grep -c '^[0-9]'", CMD);
    assert!(listed.parse::<u32>().unwrap() > 1, "processes: {listed}");

    vm.send("reboot -f\n");
    let st = vm.wait_exit(EXIT);
    assert_eq!(st.code(), Some(0), "guest reboot ends tandem with 0");
}

/// Two vCPUs on a PCI machine: the guest kernel finds the host bridge at
/// 00:00.0 through ports 0xCF8/0xCFC and sets its command register, and
/// reads fw_cfg (told its ports on the command line, as there is no ACPI
/// to name it): its signature, and the memory map and boot order files;
/// the VM is snapshotted and restored in a new process (machine from the
/// file; `--machine legacy` refused), where the bridge's configuration
/// space, read live, is as the guest left it; power-off exits 0.
#[test]
fn two_vcpus_on_a_pci_machine_boot_restore_and_poweroff_exits_zero() {
    let sock = scratch("boot-pci.sock");
    let snap = scratch("boot-pci.snap");
    let s = sock.to_str().unwrap();
    let cmdline = format!("{} qemu_fw_cfg.ioport=2@0x510:0:1", boot_cmdline());
    let mut vm = TestVm::boot_default(&[
        "--cpus",
        "2",
        "--machine",
        "pci",
        "--api-sock",
        s,
        "--cmdline",
        &cmdline,
    ]);
    vm.remove_on_drop(snap.clone());
    assert_eq!(vm.ok("nproc", CMD), "2");
    let online = vm.ok("cat /sys/devices/system/cpu/online", CMD);
    assert_eq!(online, "0-1");
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
    assert_eq!(vm.ok("ls /sys/bus/pci/devices | wc -l", CMD), "1");
    // The guest enables memory and I/O decoding and bus mastering
    // through the config ports (setpci is not in busybox: dd at offset 4).
    vm.ok(
        &format!("printf '\\007' | dd of={bridge}/config bs=1 seek=4 conv=notrunc 2>/dev/null"),
        CMD,
    );
    let config = |vm: &mut TestVm| vm.ok(&format!("od -An -tx1 -N8 {bridge}/config"), CMD);
    let before = config(&mut vm);
    assert_eq!(
        before.split_whitespace().collect::<Vec<_>>(),
        ["86", "80", "37", "12", "07", "00", "00", "00"],
        "{before}"
    );

    // fw_cfg, through Linux's qemu_fw_cfg driver: interface 1 (no DMA),
    // an empty boot order, and one RAM entry of 128 MiB in etc/e820.
    let fw = "/sys/firmware/qemu_fw_cfg";
    assert_eq!(vm.ok(&format!("cat {fw}/rev"), CMD), "1");
    let sizes = vm.ok(
        &format!("cat {fw}/by_name/bootorder/size {fw}/by_name/etc/e820/size"),
        CMD,
    );
    assert_eq!(sizes.split_whitespace().collect::<Vec<_>>(), ["0", "20"]);
    let e820 = vm.ok(&format!("od -An -tx1 -v {fw}/by_name/etc/e820/raw"), CMD);
    let want = "00 00 00 00 00 00 00 00 00 00 00 08 00 00 00 00 01 00 00 00";
    assert_eq!(e820.split_whitespace().collect::<Vec<_>>().join(" "), want);

    let (code, a) = ctl(&sock, &["snapshot", snap.to_str().unwrap()]);
    assert_eq!(code, 0, "{a}");
    vm.kill();
    let out = tandem_output(&[
        "run",
        "--restore",
        snap.to_str().unwrap(),
        "--machine",
        "legacy",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("snapshot has PCI host bridge pci0 (--machine pci); none given"),
        "{err}"
    );
    let mut again = TestVm::restore(&snap, &[]);
    assert_eq!(config(&mut again), before);
    assert_eq!(again.ok("cat /sys/devices/system/cpu/online", CMD), "0-1");
    again.send("poweroff -f\n");
    let st = again.wait_exit(EXIT);
    assert_eq!(st.code(), Some(0), "guest poweroff ends tandem with 0");
}

#[test]
fn bzimage_boots_from_a_pipe_and_eof_does_not_stop_the_guest() {
    // The README's example: all input is in the pipe before the guest boots,
    // and stdin reaches EOF at once. Nothing may be lost.
    let kernel = guest_file("bzImage");
    let initrd = guest_file("initramfs.cpio");
    let mut vm = TestVm::start(&[
        "--kernel",
        kernel.to_str().unwrap(),
        "--initrd",
        initrd.to_str().unwrap(),
    ]);
    vm.send("uname -r\necho sum=$((40+2))\nreboot -f\n");
    vm.close_stdin();
    let st = vm.wait_exit(tandem_tests::BOOT_TIMEOUT);
    let console = vm.console();
    assert_eq!(
        st.code(),
        Some(0),
        "console:\n{}\nstderr:\n{}",
        tail(&console, 3000),
        vm.stderr()
    );
    assert!(
        console.lines().any(|l| l.starts_with("6.1.")),
        "kernel version printed:\n{}",
        tail(&console, 2000)
    );
    assert!(console.contains("sum=42"), "{}", tail(&console, 2000));
    assert!(console.contains("tandem-guest: ready"));
}

#[test]
fn guest_panic_ends_tandem_with_an_error() {
    // init exits at once: the kernel panics ("Attempted to kill init").
    let kernel = guest_file("vmlinux");
    let initrd = guest_file("initramfs.cpio");
    let mut vm = TestVm::start(&[
        "--kernel",
        kernel.to_str().unwrap(),
        "--initrd",
        initrd.to_str().unwrap(),
        "--cmdline",
        "console=ttyS0 rdinit=/bin/false",
    ]);
    let st = vm.wait_exit(tandem_tests::BOOT_TIMEOUT);
    assert_eq!(st.code(), Some(2), "stderr: {}", vm.stderr());
    let err = vm.stderr();
    assert!(
        err.contains("the guest kernel panicked") && err.contains("Attempted to kill init"),
        "stderr: {err}"
    );
}

//! Boots real guests under KVM and checks them through the serial console.
//! Each test is one boot (half a minute to a minute here): checks share it.
//! (The PCI machine's boot is in pci.rs.)

use std::time::Duration;

use tandem_tests::{guest_file, tail, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
const EXIT: Duration = tandem_tests::budget(Duration::from_secs(30));

#[test]
fn default_guest_on_one_vcpu_runs_commands_and_reboots() {
    // No --kernel: the default guest from target/guest.
    let mut vm = TestVm::start(&["--cpus", "1"]);
    vm.wait_ready();
    // The legacy machine tells its kernel it has no ACPI and no PCI: no
    // "ACPI BIOS Error", no "PCI: Fatal", nothing else at error level.
    vm.assert_clean_boot();

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

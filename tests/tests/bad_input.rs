//! Bad input: each case gets a one-line error and exit status 1, never a
//! panic or a backtrace, and never a guest.

use std::path::PathBuf;
use std::process::Command;

use tandem_tests::{guest_file, process_scratch, tandem_bin, tandem_output};

fn scratch(name: &str, bytes: &[u8]) -> PathBuf {
    let p = process_scratch("bad-input").join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[track_caller]
fn assert_one_line_error(out: &std::process::Output, expect: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("tandem: "), "{err}");
    assert!(err.contains(expect), "expected {expect:?} in {err}");
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "no guest output expected");
}

fn run(args: &[&str]) -> std::process::Output {
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    tandem_output(&all)
}

fn kernel() -> String {
    guest_file("vmlinux").to_string_lossy().into_owned()
}

#[test]
fn kernel_missing_unreadable_or_garbage() {
    let out = run(&["--kernel", "/nonexistent/vmlinux"]);
    assert_one_line_error(&out, "cannot open kernel /nonexistent/vmlinux");
    let dir = std::env::temp_dir();
    let out = run(&["--kernel", dir.to_str().unwrap()]);
    assert_one_line_error(&out, "kernel");
    let garbage = scratch("garbage-kernel", &[0x5a; 8192]);
    let out = run(&["--kernel", garbage.to_str().unwrap()]);
    assert_one_line_error(&out, "neither an ELF vmlinux nor a bzImage");
    let short = scratch("short-kernel", b"\x7fELF");
    let out = run(&["--kernel", short.to_str().unwrap()]);
    assert_one_line_error(&out, "cannot load kernel");
    let empty = scratch("empty-kernel", b"");
    let out = run(&["--kernel", empty.to_str().unwrap()]);
    assert_one_line_error(&out, "kernel");
}

#[test]
fn initrd_missing_unreadable_empty_or_garbage() {
    let k = kernel();
    let out = run(&["--kernel", &k, "--initrd", "/nonexistent/initrd"]);
    assert_one_line_error(&out, "cannot open initrd /nonexistent/initrd");
    let dir = std::env::temp_dir();
    let out = run(&["--kernel", &k, "--initrd", dir.to_str().unwrap()]);
    assert_one_line_error(&out, "initrd");
    let empty = scratch("empty-initrd", b"");
    let out = run(&["--kernel", &k, "--initrd", empty.to_str().unwrap()]);
    assert_one_line_error(&out, "is empty");
    let garbage = scratch("garbage-initrd", &[0x5a; 4096]);
    let out = run(&["--kernel", &k, "--initrd", garbage.to_str().unwrap()]);
    assert_one_line_error(&out, "not an initramfs");
    let huge = scratch("huge-initrd", b"070701");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&huge)
        .unwrap()
        .set_len(200 << 20)
        .unwrap();
    let out = run(&[
        "--kernel",
        &k,
        "--initrd",
        huge.to_str().unwrap(),
        "--mem",
        "64M",
    ]);
    assert_one_line_error(&out, "does not fit");
}

#[test]
fn memory_sizes() {
    let k = kernel();
    for (mem, expect) in [
        ("0", "greater than 0"),
        ("abc", "is not a number"),
        ("12Q", "is not a number"),
        ("1M", "below the minimum"),
        ("100T", "more than this host has"),
    ] {
        let out = run(&["--kernel", &k, "--mem", mem]);
        assert_one_line_error(&out, expect);
    }
}

#[test]
fn cpu_counts() {
    let k = kernel();
    for (cpus, expect) in [
        ("0", "at least 1"),
        ("33", "above the limit of 32"),
        ("x", "is not a number"),
    ] {
        let out = run(&["--kernel", &k, "--cpus", cpus]);
        assert_one_line_error(&out, expect);
    }
}

#[test]
fn command_line_over_the_boot_protocol_limit() {
    let k = kernel();
    let long = format!("console=ttyS0 {}", "x".repeat(3000));
    let out = run(&["--kernel", &k, "--cmdline", &long]);
    assert_one_line_error(&out, "the boot protocol allows at most 2047");
}

#[test]
fn unknown_option() {
    let out = run(&["--bogus"]);
    assert_one_line_error(&out, "--bogus");
}

#[test]
fn no_kvm_device() {
    // A private mount namespace whose /dev is an empty tmpfs.
    let out = Command::new("unshare")
        .args([
            "--mount",
            "sh",
            "-c",
            "mount -t tmpfs tmpfs /dev && exec \"$0\" run --kernel \"$1\"",
        ])
        .arg(tandem_bin())
        .arg(kernel())
        .output()
        .expect("unshare");
    assert_one_line_error(&out, "cannot open /dev/kvm: no such device");
}

#[test]
fn no_permission_on_kvm_device() {
    // As an unprivileged user (nobody), /dev/kvm (root-only here) refuses.
    let meta = std::fs::metadata("/dev/kvm").expect("/dev/kvm exists");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        meta.permissions().mode() & 0o006,
        0,
        "test needs /dev/kvm closed to others"
    );
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(tandem_bin())
        .args(["run", "--kernel"])
        .arg(kernel())
        .output()
        .expect("setpriv");
    assert_one_line_error(&out, "permission denied");
}

#[test]
fn config_files() {
    // An unknown key, in either format, is named with the file.
    let json = scratch("bad.json", br#"{"cpus": 1, "bogus": true}"#);
    let out = run(&["--config", json.to_str().unwrap()]);
    assert_one_line_error(
        &out,
        &format!("--config {}: bogus: unknown field `bogus`", json.display()),
    );
    let toml = scratch(
        "bad.toml",
        b"mem = \"128M\"\n\n[[net]]\ntap = \"t0\"\nmtu = 9000\n",
    );
    let out = run(&["--config", toml.to_str().unwrap()]);
    assert_one_line_error(
        &out,
        "net[0].mtu: unknown field `mtu`, expected one of `tap`, `mac`, `sndbuf`, `rsc`, `rsc_interval_us` at line 5 column 1",
    );
    // A bad value or type names the key.
    let cpus = scratch("cpus.toml", b"cpus = \"two\"\n");
    let out = run(&["--config", cpus.to_str().unwrap()]);
    assert_one_line_error(&out, "cpus: invalid type: string \"two\"");
    let out = run(&["--config", "/nonexistent/vm.toml"]);
    assert_one_line_error(&out, "--config /nonexistent/vm.toml: No such file");
    // The file's values reach the VM's checks; the command line's win.
    let big = scratch("big.json", br#"{"mem": "100T"}"#);
    let out = run(&["--kernel", &kernel(), "--config", big.to_str().unwrap()]);
    assert_one_line_error(&out, "more than this host has");
    let k = scratch("kernel.toml", b"kernel = \"/nonexistent/from-file\"\n");
    let out = run(&["--config", k.to_str().unwrap()]);
    assert_one_line_error(&out, "cannot open kernel /nonexistent/from-file");
    let out = run(&[
        "--config",
        k.to_str().unwrap(),
        "--kernel",
        "/nonexistent/from-cli",
    ]);
    assert_one_line_error(&out, "cannot open kernel /nonexistent/from-cli");
    // A restore in the file takes no boot option.
    let r = scratch("restore.toml", b"restore = \"/nonexistent/snap\"\n");
    let out = run(&["--config", r.to_str().unwrap(), "--kernel", &kernel()]);
    assert_one_line_error(
        &out,
        "--kernel is for booting and cannot be used with 'restore'",
    );
}

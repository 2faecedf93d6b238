//! `tandem run --config FILE` on a real guest: the run's base snapshot
//! restored with every option from a TOML file (the snapshot, memory, vCPUs,
//! both NICs as tables, the disk as an option string, an API socket), one
//! of them overridden on the command line; the guest must answer on its
//! console and through the command line's socket, with the NICs it had.
//! A JSON file whose memory differs from the snapshot's is refused, so the
//! file's values are what the restore checks.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;
use tandem_tests::base::{base, DISK_ID, MAC0, MAC1};
use tandem_tests::netns::NetNs;
use tandem_tests::{ctl, tandem_bin, tandem_output, TestVm, CMD_TIMEOUT};

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tandem-config-{}-{name}", std::process::id()))
}

#[test]
fn restore_the_base_from_a_config_file() {
    let b = base();
    let disk = scratch("disk.img");
    std::fs::copy(&b.disk, &disk).expect("copy the base disk");
    let file_sock = scratch("file.sock");
    let cli_sock = scratch("cli.sock");
    let toml = scratch("vm.toml");
    std::fs::write(
        &toml,
        format!(
            r#"# The base guest, as tests/src/base.rs restores it.
restore = "{snap}"
mem = "128M"
cpus = 1
api_sock = "{file_sock}"
disk = ["path={disk},id={DISK_ID}"]

[[net]]
tap = "tap0"
mac = "{MAC0}"
rsc = false

[[net]]
tap = "tap1"
mac = "{MAC1}"
rsc = true
"#,
            snap = b.snapshot.display(),
            file_sock = file_sock.display(),
            disk = disk.display(),
        ),
    )
    .unwrap();

    let ns = NetNs::new("cfg");
    ns.add_bare_tap("tap0");
    ns.add_bare_tap("tap1");
    let mut vm = TestVm::start_with(
        ns.command(tandem_bin().to_str().unwrap()),
        &[
            "--config",
            toml.to_str().unwrap(),
            "--api-sock",
            cli_sock.to_str().unwrap(),
        ],
    );
    vm.remove_on_drop(disk.clone());
    vm.remove_on_drop(toml.clone());
    assert_eq!(vm.ok("echo restored-$((6*7))", CMD_TIMEOUT), "restored-42");
    // The NICs of the file, in its order.
    assert_eq!(vm.ok("cat /sys/class/net/eth0/address", CMD_TIMEOUT), MAC0);
    assert_eq!(vm.ok("cat /sys/class/net/eth1/address", CMD_TIMEOUT), MAC1);
    // The command line's socket, not the file's.
    let (code, st) = ctl(&cli_sock, &["status"]);
    assert_eq!((code, &st["state"]), (0, &Value::from("running")), "{st}");
    assert_eq!(
        (&st["vcpus"], &st["mem_mib"]),
        (&Value::from(1), &Value::from(128)),
        "{st}"
    );
    assert!(!file_sock.exists(), "the file's api_sock was used");
    let (code, a) = ctl(&cli_sock, &["shutdown"]);
    assert_eq!(code, 0, "{a}");
    let st = vm.wait_exit(tandem_tests::budget(Duration::from_secs(20)));
    assert_eq!(st.code(), Some(0), "{}", vm.stderr());

    // The file's memory is the one checked against the snapshot.
    let json = scratch("vm.json");
    std::fs::write(
        &json,
        format!(
            r#"{{"restore": "{}", "mem": "256M", "net": ["tap=tap0,mac={MAC0}"]}}"#,
            b.snapshot.display()
        ),
    )
    .unwrap();
    let out = tandem_output(&["run", "--config", json.to_str().unwrap()]);
    let _ = std::fs::remove_file(&json);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("snapshot has 128 MiB of memory"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

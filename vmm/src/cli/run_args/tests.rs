//! `--config` files: both formats, every error naming the file and the key,
//! and the merge with the command line.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{CommandFactory, Parser};

use super::file::{parse, Format};
use super::{RunArgs, RunArgsError};
use crate::config::{DiskSpec, NetSpec, DEFAULT_RSC_INTERVAL};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    run: RunArgs,
}

fn cli(args: &[&str]) -> RunArgs {
    Cli::try_parse_from(std::iter::once("tandem").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
        .run
}

fn toml(text: &str) -> Result<RunArgs, RunArgsError> {
    parse(Path::new("vm.toml"), text)
}

fn json(text: &str) -> Result<RunArgs, RunArgsError> {
    parse(Path::new("vm.json"), text)
}

/// The error's message, checked to be one line that names the file.
#[track_caller]
fn message(r: Result<RunArgs, RunArgsError>, file: &str) -> String {
    let e = r.expect_err("an error").to_string();
    assert!(e.starts_with(&format!("--config {file}: ")), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");
    e
}

const TOML: &str = r#"
# A VM with two NICs and a disk.
kernel = "/guest/vmlinux"
initrd = "/guest/initramfs.cpio"
cmdline = "console=ttyS0 quiet"
mem = "512M"
cpus = 2
api_sock = "/tmp/vm.sock"
metrics = "/tmp/vm.json"
disk = ["path=/data/a.img,readonly=on,id=a", { path = "/data/b,c.img" }]
guest_profile = "/tmp/p.folded"
guest_profile_hz = 250

[[net]]
tap = "tap0"
mac = "52:54:00:00:00:a1"
rsc = true
rsc_interval_us = 50
sndbuf = "64K"

[[net]]
tap = "tap1"
sndbuf = 8192
"#;

const JSON: &str = r#"{
  "kernel": "/guest/vmlinux",
  "initrd": "/guest/initramfs.cpio",
  "cmdline": "console=ttyS0 quiet",
  "mem": 512,
  "cpus": 2,
  "api_sock": "/tmp/vm.sock",
  "metrics": "/tmp/vm.json",
  "net": [
    "tap=tap0,mac=52:54:00:00:00:a1,rsc=on,rsc_interval_us=50,sndbuf=64K",
    {"tap": "tap1", "sndbuf": "8K"}
  ],
  "disk": [{"path": "/data/a.img", "readonly": true, "id": "a"}, {"path": "/data/b,c.img"}],
  "guest_profile": "/tmp/p.folded",
  "guest_profile_hz": 250
}"#;

fn expected() -> RunArgs {
    RunArgs {
        kernel: Some("/guest/vmlinux".into()),
        initrd: Some("/guest/initramfs.cpio".into()),
        cmdline: Some("console=ttyS0 quiet".into()),
        mem: Some(512 << 20),
        cpus: Some(2),
        api_sock: Some("/tmp/vm.sock".into()),
        metrics: Some("/tmp/vm.json".into()),
        nets: vec![
            NetSpec {
                tap: "tap0".into(),
                mac: Some([0x52, 0x54, 0, 0, 0, 0xa1]),
                sndbuf: Some(64 << 10),
                rsc: true,
                rsc_interval: Duration::from_micros(50),
                transport: None,
            },
            NetSpec {
                tap: "tap1".into(),
                mac: None,
                sndbuf: Some(8192),
                rsc: false,
                rsc_interval: DEFAULT_RSC_INTERVAL,
                transport: None,
            },
        ],
        disks: vec![
            DiskSpec {
                path: "/data/a.img".into(),
                readonly: true,
                id: Some("a".into()),
                transport: None,
            },
            // A table can name a path with a comma, which an option cannot.
            DiskSpec {
                path: "/data/b,c.img".into(),
                readonly: false,
                id: None,
                transport: None,
            },
        ],
        guest_profile: Some("/tmp/p.folded".into()),
        guest_profile_hz: Some(250),
        ..RunArgs::default()
    }
}

#[test]
fn toml_and_json_give_the_same_options() {
    assert_eq!(toml(TOML).unwrap(), expected());
    assert_eq!(json(JSON).unwrap(), expected());
    // The list entries' two forms are interchangeable.
    let strings = json(
        r#"{"disk": ["path=/data/a.img,readonly=on,id=a"],
            "net": [{"tap": "tap0", "mac": "52:54:00:00:00:a1", "rsc": true,
                     "rsc_interval_us": 50, "sndbuf": 65536}]}"#,
    )
    .unwrap();
    assert_eq!(strings.nets[0], expected().nets[0]);
    assert_eq!(strings.disks[0], expected().disks[0]);
    // An empty file sets nothing.
    assert_eq!(toml("").unwrap(), RunArgs::default());
    assert_eq!(json(" {}\n").unwrap(), RunArgs::default());
}

#[test]
fn format_by_extension_else_by_content() {
    let of = |p: &str, t: &str| Format::of(Path::new(p), t);
    assert_eq!(of("vm.json", "cpus = 1"), Format::Json);
    assert_eq!(of("vm.JSON", ""), Format::Json);
    assert_eq!(of("vm.toml", "{}"), Format::Toml);
    assert_eq!(of("vm.conf", "\n  {\"cpus\": 1}"), Format::Json);
    assert_eq!(of("vm", "cpus = 1"), Format::Toml);
    assert_eq!(
        parse(Path::new("vm"), r#" {"cpus": 3} "#).unwrap().cpus,
        Some(3)
    );
    assert_eq!(
        parse(Path::new("vm.cfg"), "cpus = 3").unwrap().cpus,
        Some(3)
    );
}

#[test]
fn an_unknown_key_is_an_error_naming_it() {
    let e = message(toml("cpus = 1\nbogus = 2\n"), "vm.toml");
    assert!(
        e.contains("unknown field `bogus`, expected one of `kernel`"),
        "{e}"
    );
    assert!(e.ends_with("at line 2 column 1"), "{e}");
    let e = message(json(r#"{"cpus": 1, "bogus": 2}"#), "vm.json");
    assert!(
        e.contains("unknown field `bogus`, expected one of `kernel`"),
        "{e}"
    );
    assert!(e.contains("line 1 column 19"), "{e}");
    // Inside a table: the path to it.
    let e = message(toml("[[net]]\ntap = \"t\"\nbogus = 1\n"), "vm.toml");
    assert!(
        e.starts_with(
            "--config vm.toml: net[0].bogus: unknown field `bogus`, expected one of `tap`, `mac`"
        ),
        "{e}"
    );
    let e = message(
        json(r#"{"disk": [{"path": "a"}, {"path": "b", "ro": true}]}"#),
        "vm.json",
    );
    assert!(e.contains("disk[1].ro: unknown field `ro`"), "{e}");
    // The command line's own switches are not keys; the command line's
    // spelling of a key is not either.
    for key in ["config", "print_cmdline", "api-sock", "nets", "disks"] {
        let e = message(json(&format!(r#"{{"{key}": "x"}}"#)), "vm.json");
        assert!(e.contains(&format!("unknown field `{key}`")), "{e}");
    }
}

/// Every long option of `tandem run` but `--config` and `--print-cmdline`
/// is a key of the file, spelt with `_` for `-`.
#[test]
fn every_long_option_is_a_key() {
    let cmd = Cli::command();
    let longs: Vec<&str> = cmd.get_arguments().filter_map(|a| a.get_long()).collect();
    assert!(longs.len() >= 14, "{longs:?}");
    for long in longs {
        let key = long.replace('-', "_");
        let r = json(&format!(r#"{{"{key}": null}}"#));
        let unknown = matches!(&r, Err(e) if e.to_string().contains("unknown field"));
        assert_eq!(
            unknown,
            ["config", "print_cmdline"].contains(&key.as_str()),
            "--{long}: {r:?}"
        );
    }
}

#[test]
fn bad_values_name_the_key() {
    for (text, expect) in [
        ("cpus = \"two\"", "cpus: invalid type: string \"two\", expected u64 at line 1 column 8"),
        ("cpus = 33", "cpus: vCPU count 33 is above the limit of 32"),
        ("cpus = 0", "cpus: vCPU count must be at least 1"),
        ("cpus = -1", "cpus: invalid value: integer `-1`"),
        ("mem = true", "mem: invalid type: boolean `true`, expected a string such as \"512M\" or a whole number"),
        ("mem = \"1M\"", "mem: memory size 1M is below the minimum of 16M"),
        ("mem = \"lots\"", "mem: memory size 'lots' is not a number"),
        ("mem = -512", "mem: invalid value: integer `-512`"),
        ("kernel = 1", "kernel: invalid type: integer `1`"),
        ("net = \"tap=t\"", "net: invalid type: string \"tap=t\", expected a sequence"),
        ("net = [1]", "net[0]: invalid type: integer `1`, expected an option string"),
        ("net = [\"tap=a\", \"tap0\"]", "net[1]: --net 'tap0': expected tap=NAME"),
        ("net = [{ tap = \"t\", rsc = \"on\" }]", "net[0].rsc: invalid type: string \"on\", expected a boolean"),
        ("net = [{ rsc = true }]", "net[0]: missing field `tap`"),
        ("net = [{ tap = \"t\", sndbuf = 1 }]", "net[0]: --net 'tap=t,sndbuf=1': sndbuf '1' is not a size"),
        ("net = [{ tap = \"t\", mac = \"52:54\" }]", "net[0]: --net 'tap=t,mac=52:54': '52:54' is not a MAC address"),
        ("net = [{ tap = \"t\", rsc_interval_us = 0 }]", "rsc_interval_us '0' is not a number of microseconds"),
        ("disk = [{ path = \"a\", readonly = \"on\" }]", "disk[0].readonly: invalid type: string \"on\", expected a boolean"),
        ("disk = [{ path = \"a\", id = \"a b\" }]", "disk[0]: --disk 'path=a,id=a b': id must be 1 to 20"),
        ("disk = [{ path = \"\" }]", "disk[0]: --disk 'path=': expected path=FILE"),
        ("disk = [\"ro.img\"]", "disk[0]: --disk 'ro.img': expected path=FILE"),
        ("guest_profile_hz = 0", "guest_profile_hz: sampling rate must be 1 to 10000 Hz, not 0"),
        ("cpus = 1\ncpus = 2", "duplicate key at line 2 column 1"),
        ("cpus = ", "line 1 column"),
    ] {
        let e = message(toml(text), "vm.toml");
        assert!(e.contains(expect), "{text:?}: {e}");
    }
    for (text, expect) in [
        (
            r#"{"cpus": "two"}"#,
            "cpus: invalid type: string \"two\", expected u64 at line 1 column 14",
        ),
        (r#"{"mem": 1.5}"#, "mem: invalid type: floating point `1.5`"),
        (
            r#"{"net": [{"tap": "t", "rsc": 1}]}"#,
            "net[0].rsc: invalid type: integer `1`, expected a boolean",
        ),
        (r#"{"cpus": 1, "cpus": 2}"#, "duplicate field `cpus`"),
        (
            r#"{"cpus": 1} {"cpus": 2}"#,
            "trailing characters at line 1 column 13",
        ),
        (r#"{"cpus": 1"#, "EOF while parsing an object"),
        (r#"["cpus"]"#, "the JSON text is not an object"),
        ("", "the JSON text is not an object"),
    ] {
        let e = message(json(text), "vm.json");
        assert!(e.contains(expect), "{text:?}: {e}");
    }
}

#[test]
fn the_command_line_wins_over_the_file() {
    let path = Path::new("vm.toml");
    let file = expected();
    // Nothing on the command line: the file's options.
    let m = cli(&[]).over(file.clone(), path).unwrap();
    assert_eq!(m, file);
    // Each option given wins; the others stay the file's.
    let m = cli(&[
        "--kernel",
        "/k",
        "--mem",
        "1G",
        "--cpus",
        "4",
        "--api-sock",
        "/s",
        "--net",
        "tap=x",
    ])
    .over(file.clone(), path)
    .unwrap();
    assert_eq!(m.kernel, Some(PathBuf::from("/k")));
    assert_eq!(m.mem, Some(1 << 30));
    assert_eq!(m.cpus, Some(4));
    assert_eq!(m.api_sock, Some(PathBuf::from("/s")));
    // A list on the command line replaces the file's whole list.
    assert_eq!(m.nets.len(), 1);
    assert_eq!(m.nets[0].tap, "x");
    assert_eq!(m.disks, file.disks);
    assert_eq!(m.initrd, file.initrd);
    assert_eq!(m.cmdline, file.cmdline);
    assert_eq!(m.guest_profile_hz, Some(250));
    let m = cli(&["--guest-profile-hz", "10", "--disk", "path=z"])
        .over(file.clone(), path)
        .unwrap();
    assert_eq!(m.guest_profile_hz, Some(10));
    assert_eq!(m.disks.len(), 1);
    assert_eq!(m.nets, file.nets);
    // A required setting may come from either side.
    assert_eq!(
        cli(&["--kernel", "/k"])
            .over(RunArgs::default(), path)
            .unwrap()
            .kernel,
        Some(PathBuf::from("/k"))
    );
}

#[test]
fn restore_and_the_files_boot_keys() {
    let path = Path::new("vm.toml");
    // --restore given here: the file's boot keys are ignored, the rest used.
    let m = cli(&["--restore", "/snap"]).over(expected(), path).unwrap();
    assert_eq!(m.restore, Some(PathBuf::from("/snap")));
    assert_eq!((m.kernel, m.initrd, m.cmdline), (None, None, None));
    assert_eq!((m.mem, m.cpus, m.nets.len()), (Some(512 << 20), Some(2), 2));
    // A restore in the file takes no boot key, from either side.
    let restoring = toml("restore = \"/snap\"\nmem = \"128M\"").unwrap();
    let m = cli(&[]).over(restoring.clone(), path).unwrap();
    assert_eq!(m.restore, Some(PathBuf::from("/snap")));
    let mut both = restoring.clone();
    both.initrd = Some("/i".into());
    let e = cli(&[]).over(both, path).unwrap_err().to_string();
    assert!(
        e.starts_with("--config vm.toml: 'initrd' is for booting"),
        "{e}"
    );
    for (args, option) in [
        (&["--kernel", "/k"][..], "--kernel"),
        (&["--cmdline", "x"], "--cmdline"),
        (&["--print-cmdline"], "--print-cmdline"),
    ] {
        let e = cli(args)
            .over(restoring.clone(), path)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            format!(
                "{option} is for booting and cannot be used with 'restore' from --config vm.toml"
            )
        );
    }
    // On the command line alone, clap refuses the mix.
    assert!(Cli::try_parse_from(["tandem", "--restore", "/s", "--kernel", "/k"]).is_err());
}

#[test]
fn resolve_reads_the_file_and_checks_the_result() {
    let dir = std::env::temp_dir().join(format!("tandem-run-args-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("vm.toml");
    std::fs::write(&f, "cpus = 3\nguest_profile_hz = 100\n").unwrap();
    let fs = f.to_str().unwrap();
    // The rate without a profile to use it, from either side.
    let e = cli(&["--config", fs]).resolve().unwrap_err();
    assert!(matches!(e, RunArgsError::HzWithoutProfile), "{e}");
    let m = cli(&["--config", fs, "--guest-profile", "/p"])
        .resolve()
        .unwrap();
    assert_eq!((m.cpus, m.guest_profile_hz), (Some(3), Some(100)));
    assert!(matches!(
        cli(&["--guest-profile-hz", "5"]).resolve(),
        Err(RunArgsError::HzWithoutProfile)
    ));
    // The default rate when none is given.
    let m = cli(&["--guest-profile", "/p"]).resolve().unwrap();
    assert_eq!(m.profile(None).unwrap().hz, crate::profile::DEFAULT_HZ);
    // A missing or oversized file, or a directory.
    let e = cli(&["--config", "/nonexistent/vm.toml"])
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("--config /nonexistent/vm.toml: No such file"),
        "{e}"
    );
    let big = dir.join("big.toml");
    std::fs::write(&big, vec![b'#'; (super::file::MAX_FILE + 1) as usize]).unwrap();
    let e = cli(&["--config", big.to_str().unwrap()])
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(e.ends_with("larger than 1048576 bytes"), "{e}");
    let e = cli(&["--config", "/dev/zero"])
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(e.contains("larger than"), "{e}");
    let e = cli(&["--config", dir.to_str().unwrap()])
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(e.contains("directory"), "{e}");
    let bin = dir.join("bin.json");
    std::fs::write(&bin, b"{\"cpus\": \xff}").unwrap();
    let e = cli(&["--config", bin.to_str().unwrap()])
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(e.contains("UTF-8"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// docs/cli.md's two example files parse, to the same options.
#[test]
fn the_documented_examples() {
    let page = include_str!("../../../../docs/cli.md");
    let section = page
        .split("\n## Config file\n")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("a Config file section");
    let block = |lang: &str| {
        section
            .split(&format!("```{lang}\n"))
            .nth(1)
            .and_then(|b| b.split("```").next())
            .unwrap_or_else(|| panic!("a {lang} example"))
    };
    let t = toml(block("toml")).unwrap();
    assert_eq!(t, json(block("json")).unwrap());
    assert_eq!((t.mem, t.cpus, t.nets.len()), (Some(512 << 20), Some(2), 1));
    assert!(t.nets[0].rsc);
    assert_eq!(t.disks[0].id.as_deref(), Some("data"));
}

#[test]
fn firmware_takes_a_kernel_to_load_and_may_be_a_colo_secondary() {
    // From a file too, where clap's conflicts cannot see it.
    let fw = toml("firmware = \"/usr/share/ovmf/OVMF.fd\"").unwrap();
    assert_eq!(fw.firmware, Some(PathBuf::from("/usr/share/ovmf/OVMF.fd")));
    let path = Path::new("vm.toml");
    let checked = |args: &[&str]| cli(args).over(fw.clone(), path).unwrap().check_firmware();
    assert!(checked(&[]).is_ok());
    // A kernel for the firmware to load, with its initrd and command line.
    assert!(checked(&["--kernel", "/k", "--initrd", "/i", "--cmdline", "x"]).is_ok());
    for (args, option) in [
        (&["--initrd", "/i"][..], "--initrd"),
        (&["--cmdline", "x"], "--cmdline"),
    ] {
        let e = checked(args).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("--firmware with {option} needs --kernel")),
            "{e}"
        );
    }
    let e = checked(&["--print-cmdline"]).unwrap_err().to_string();
    assert!(e.contains("not with --print-cmdline"), "{e}");
    // A COLO secondary takes it (its image is checked against the
    // primary's as an incoming migration's is).
    let c = cli(&["--colo", "secondary", "--colo-listen", "unix:/tmp/x"])
        .over(fw.clone(), path)
        .unwrap();
    assert!(c.check_firmware().is_ok());
    // An incoming migration and a restore take the file's firmware: their
    // VM needs the image it booted from.
    let m = cli(&["--incoming", "unix:/tmp/x"])
        .over(fw.clone(), path)
        .unwrap();
    assert!(m.check_firmware().is_ok());
    let m = cli(&["--restore", "/snap"]).over(fw, path).unwrap();
    assert_eq!(m.firmware, Some(PathBuf::from("/usr/share/ovmf/OVMF.fd")));
    assert!(m.check_firmware().is_ok());
    // On the command line, clap refuses --print-cmdline with it.
    let args = ["tandem", "--firmware", "/f", "--print-cmdline"];
    assert!(Cli::try_parse_from(args).is_err());
    let args = ["tandem", "--firmware", "/f", "--kernel", "/k"];
    assert!(Cli::try_parse_from(args).is_ok());
    let args = ["tandem", "--firmware", "/f", "--restore", "/s"];
    assert!(Cli::try_parse_from(args).is_ok());
}

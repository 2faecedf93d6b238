//! The guest profiler on a real guest (the run's base snapshot, restored):
//! while the guest copies /dev/zero to /dev/null with dd (a loop that spends
//! its time in the kernel, clearing dd's buffer), a profile must name the
//! kernel's clearing function at the top and show it called from the
//! `read` system call through frame-pointer call chains (the clearing
//! function is a frameless leaf, so its caller `read_zero` is skipped, as
//! in any frame-pointer unwinder). Once through the
//! control API (`ctl profile-start` / `profile-stop`), once for a whole run
//! (`run --guest-profile`, table on stderr at exit).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use tandem_tests::netns::NetNs;
use tandem_tests::{ctl, guest_file, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
/// The busy loop: one read of /dev/zero is one 1 MiB clear in the kernel.
/// Started in a subshell, so that it is no job of the console shell (whose
/// job notices would mix into command output); ended with [`STOP_DD`].
const DD: &str = "(dd if=/dev/zero of=/dev/null bs=1M count=100000000 2>/dev/null &)";
const STOP_DD: &str = "killall dd";
/// How long each profile samples.
const WINDOW: Duration = Duration::from_secs(10);

/// The names the kernel's user-memory clearing goes by (the variant
/// depends on the CPU features the guest sees).
fn is_clear_user(f: &str) -> bool {
    f.contains("clear_user")
}

fn scratch(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tandem-{what}-{}", std::process::id()))
}

/// Checks a folded-stacks file: `frame;frame;... COUNT` lines; the most
/// frequent stack goes from the read system call into a clear_user
/// function, and at least `1/share` of all samples do (a third for a
/// window in which only dd ran; for a whole run, whose restore, commands
/// and shutdown take longer on a loaded host, a tenth).
fn check_folded(path: &Path, share: u64) {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("folded stacks {}: {e}", path.display()));
    let (mut all, mut through) = (0u64, 0u64);
    let mut top: Option<(u64, bool)> = None;
    for line in text.lines() {
        let (stack, n) = line.rsplit_once(' ').expect("`stack count` line");
        let n: u64 = n.parse().unwrap_or_else(|_| panic!("count in {line:?}"));
        assert!(!stack.is_empty() && !stack.contains(' '), "{line:?}");
        all += n;
        let frames: Vec<&str> = stack.split(';').collect();
        let read_clear = frames
            .iter()
            .position(|f| *f == "ksys_read")
            .is_some_and(|at| frames[at..].iter().any(|f| is_clear_user(f)));
        if read_clear {
            through += n;
        }
        if top.is_none_or(|(m, _)| n > m) {
            top = Some((n, read_clear));
        }
    }
    let most = || text.lines().take(20).collect::<Vec<_>>().join("\n");
    assert!(all > 0, "no samples in {}", path.display());
    assert!(
        top.is_some_and(|(_, read_clear)| read_clear),
        "the most frequent stack is not ksys_read -> clear_user:\n{}",
        most()
    );
    assert!(
        through * share > all,
        "only {through} of {all} samples went ksys_read -> clear_user; the most frequent:\n{}",
        most()
    );
}

/// Checks the API's (or the exit's) table: the top function clears user
/// memory and holds a good share of the samples.
fn check_top(top: &Value, samples: u64) {
    let rows = top.as_array().expect("top rows");
    assert!(!rows.is_empty() && rows.len() <= 30, "{top}");
    let first = rows[0]["function"].as_str().unwrap_or("");
    assert!(is_clear_user(first), "top function is {first:?}: {top}");
    let share = rows[0]["self_pct"].as_f64().unwrap_or(0.0);
    assert!(share > 30.0, "{first} has only {share:.1}% of {samples}");
}

/// The base guest restored in `ns` with its control API on
/// `sock`, the default guest's vmlinux as symbols, and `extra` arguments.
fn restore(ns: &NetNs, sock: &Path, extra: &[&str]) -> TestVm {
    let vmlinux = guest_file("vmlinux");
    ns.add_bare_tap("tap0");
    ns.add_bare_tap("tap1");
    let mut args = vec![
        "--api-sock",
        sock.to_str().unwrap(),
        "--guest-symbols",
        vmlinux.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    TestVm::restore_base(ns, ["tap0", "tap1"], &args)
}

#[test]
fn profile_of_a_kernel_busy_loop_through_the_api() {
    let sock = scratch("profile.sock");
    let folded = scratch("profile.folded");
    let ns = NetNs::new("prof");
    let mut vm = restore(&ns, &sock, &[]);
    // Nothing to stop yet; a rate out of range is refused.
    let (code, a) = ctl(&sock, &["profile-stop", folded.to_str().unwrap()]);
    assert_eq!(code, 1, "{a}");
    let (code, a) = ctl(&sock, &["profile-start", "--hz", "0"]);
    assert_eq!(code, 1, "{a}");

    vm.ok(DD, CMD);
    let (code, a) = ctl(&sock, &["profile-start", "--hz", "500"]);
    assert_eq!(code, 0, "{a}");
    let (code, again) = ctl(&sock, &["profile-start"]);
    assert_eq!(code, 1, "a second profile-start must fail: {again}");
    std::thread::sleep(WINDOW);
    let (code, p) = ctl(&sock, &["profile-stop", "--json", folded.to_str().unwrap()]);
    assert_eq!(code, 0, "{p}\n{}", vm.stderr());
    eprintln!("{}", p["table"].as_str().unwrap_or(""));
    let samples = p["samples"].as_u64().unwrap_or(0);
    // 500 Hz for 10 s is 5000 asked; a loaded host delivers fewer.
    assert!(samples >= 1000, "{samples} samples: {p}");
    assert_eq!(p["failed_samples"], 0, "{p}");
    assert!(
        p["sample_cost_us"].as_f64().unwrap_or(0.0) > 0.0,
        "sample cost: {p}"
    );
    check_top(&p["top"], samples);
    check_folded(&folded, 3);
    // The guest goes on.
    vm.ok(STOP_DD, CMD);
    assert_eq!(vm.ok("echo still-here", CMD), "still-here");
    let _ = std::fs::remove_file(&folded);
}

#[test]
fn whole_run_profile_prints_its_table_at_exit() {
    let sock = scratch("runprof.sock");
    let folded = scratch("runprof.folded");
    let ns = NetNs::new("runprof");
    let mut vm = restore(
        &ns,
        &sock,
        &[
            "--guest-profile",
            folded.to_str().unwrap(),
            "--guest-profile-hz",
            "250",
        ],
    );
    // The run's profile is running: another one cannot start.
    let (code, a) = ctl(&sock, &["profile-start"]);
    assert_eq!(code, 1, "{a}");
    vm.ok(DD, CMD);
    std::thread::sleep(WINDOW);
    vm.ok(STOP_DD, CMD);
    let (code, a) = ctl(&sock, &["shutdown"]);
    assert_eq!(code, 0, "{a}");
    let st = vm.wait_exit(tandem_tests::budget(Duration::from_secs(20)));
    assert_eq!(st.code(), Some(0), "{}", vm.stderr());
    let err = vm.stderr();
    assert!(err.contains("guest profile: "), "{err}");
    let table = err.split("guest profile: ").nth(1).unwrap_or("");
    let top_row = table
        .lines()
        .find(|l| l.trim_start().starts_with("1 "))
        .unwrap_or_else(|| panic!("no table on stderr: {err}"));
    assert!(
        top_row.split_whitespace().last().is_some_and(is_clear_user),
        "top row {top_row:?} in\n{err}"
    );
    check_folded(&folded, 10);
    let _ = std::fs::remove_file(&folded);
}

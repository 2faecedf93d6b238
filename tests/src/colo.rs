//! What the COLO tests share: a secondary started, a side's
//! `colo-status`, waits on it, and a checkpoint asked for and committed on
//! both sides.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::base::{device_args, BASE_MEM};
use crate::netns::NetNs;
use crate::{ctl, tandem_bin, TestVm, CMD_TIMEOUT as CMD};

/// `tandem run --colo secondary` in `ns` with the base guest's devices on
/// `taps` and `image` (removed with it), listening on `addr`, with `extra`
/// arguments (`--cpus 2`); returns once it listens.
pub fn secondary(
    ns: &NetNs,
    taps: [&str; 2],
    (addr, lease, api): (&str, &Path, &Path),
    image: PathBuf,
    extra: &[&str],
) -> TestVm {
    let mut args: Vec<String> = vec![
        "--colo".into(),
        "secondary".into(),
        "--colo-listen".into(),
        addr.into(),
        "--colo-lease".into(),
        lease.display().to_string(),
        "--mem".into(),
        BASE_MEM.into(),
        "--api-sock".into(),
        api.display().to_string(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    args.extend(device_args(taps, &image));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut vm = TestVm::start_with(ns.command(tandem_bin().to_str().unwrap()), &args);
    vm.remove_on_drop(image);
    wait_until("the secondary listens", CMD, || {
        vm.stderr().contains("waiting for a migration on")
    });
    vm
}

/// A side's `colo-status` (its `colo` object).
pub fn status(api: &Path) -> serde_json::Value {
    let (code, a) = ctl(api, &["colo-status"]);
    assert_eq!(code, 0, "colo-status: {a}");
    a["colo"].clone()
}

/// Polls `done` every 50 ms until it holds; fails after `limit`.
pub fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A checkpoint now on the pair of these API sockets, committed on both
/// sides; the primary's status then.
pub fn checkpoint_now(primary: &Path, secondary: &Path) -> serde_json::Value {
    let seen = status(primary)["checkpoints"]["total"]
        .as_u64()
        .unwrap_or(0);
    let (code, a) = ctl(primary, &["colo-checkpoint"]);
    assert_eq!(code, 0, "colo-checkpoint: {a}");
    let s = wait_checkpoints(primary, seen + 1);
    let epoch = s["epoch"].as_u64().unwrap_or(0);
    wait_until("the secondary committed it", CMD, || {
        status(secondary)["epoch"].as_u64() >= Some(epoch)
    });
    s
}

pub fn wait_checkpoints(primary: &Path, n: u64) -> serde_json::Value {
    let mut last = serde_json::Value::Null;
    wait_until(&format!("{n} checkpoints"), CMD, || {
        last = status(primary);
        assert_ne!(last["state"], "retired", "the pair did not start: {last}");
        last["state"] == "protected" && last["checkpoints"]["total"].as_u64() >= Some(n)
    });
    last
}

//! What the COLO tests share: a side's `colo-status`, waits on it, and a
//! checkpoint asked for and committed on both sides.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::{ctl, CMD_TIMEOUT as CMD};

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

//! A migration's settings and where it is: what `migrate-status` answers
//! and the end report prints.
//!
//! Written by the migration thread, read by the VMM thread under one short
//! lock. Pure data.

use serde::{Deserialize, Serialize};

use crate::streams::endpoint::Endpoint;

/// Default downtime budget, ms.
pub const DEFAULT_DOWNTIME_MS: u64 = 300;
/// Default time limit, s.
pub const DEFAULT_TIMEOUT_S: u64 = 600;

fn default_downtime() -> u64 {
    DEFAULT_DOWNTIME_MS
}
fn default_timeout() -> u64 {
    DEFAULT_TIMEOUT_S
}
fn default_true() -> bool {
    true
}
fn default_connections() -> u16 {
    1
}

/// How to migrate (the `migrate` verb's fields but the address).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    /// The longest the guest may stay paused at the switch-over, ms.
    #[serde(default = "default_downtime")]
    pub downtime_ms: u64,
    /// Send at most this many MiB/s (none: as fast as the stream goes).
    #[serde(default)]
    pub bandwidth_mib: Option<u64>,
    /// Throttle the vCPUs step by step when the guest dirties memory faster
    /// than it is sent.
    #[serde(default = "default_true")]
    pub auto_converge: bool,
    /// Give up (the guest runs on here) after this many seconds.
    #[serde(default = "default_timeout")]
    pub timeout_s: u64,
    /// Where the migration runs: its own thread, or inline in the device
    /// loop (to measure the difference).
    #[serde(default)]
    pub mode: Mode,
    /// Start KVM's dirty log with every page dirty where KVM offers it
    /// (`KVM_DIRTY_LOG_INITIALLY_SET`): no stall to write-protect all of
    /// memory at the start; each chunk is protected as round 0 copies it.
    /// Off: all protected at once (to measure the difference).
    #[serde(default = "default_true")]
    pub initially_set: bool,
    /// Streams the pages go over (1 to 16), each sent by its own thread:
    /// runs of pages dealt round-robin, the stop-and-copy's too.
    #[serde(default = "default_connections")]
    pub connections: u16,
    /// Switch to post-copy when the pre-copy rounds stop shrinking the
    /// dirty set (or after `postcopy_after_rounds`): the destination runs
    /// the guest and fetches what it lacks on demand.
    #[serde(default)]
    pub postcopy: bool,
    /// With `postcopy`: switch after this many rounds at the latest
    /// (round 0 included).
    #[serde(default)]
    pub postcopy_after_rounds: Option<u32>,
}

/// Where the migration's work runs (see `migrate::inline`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The dedicated migration thread, beside the device loop.
    #[default]
    Thread,
    /// In slices from the device thread's event loop, between device
    /// events (how QEMU's I/O thread did it).
    Inline,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Thread => "thread",
            Mode::Inline => "inline",
        })
    }
}

impl Default for Params {
    fn default() -> Params {
        Params {
            downtime_ms: DEFAULT_DOWNTIME_MS,
            bandwidth_mib: None,
            auto_converge: true,
            timeout_s: DEFAULT_TIMEOUT_S,
            mode: Mode::Thread,
            initially_set: true,
            connections: 1,
            postcopy: false,
            postcopy_after_rounds: None,
        }
    }
}

impl Params {
    /// Checks the values a user gave.
    pub fn check(&self) -> Result<(), String> {
        if self.downtime_ms == 0 {
            return Err("downtime_ms must be at least 1".into());
        }
        if self.bandwidth_mib == Some(0) {
            return Err("bandwidth_mib must be at least 1".into());
        }
        if self.timeout_s == 0 {
            return Err("timeout_s must be at least 1".into());
        }
        let most = migration::protocol::streams::MAX_STREAMS;
        if !(1..=most).contains(&self.connections) {
            return Err(format!("connections must be 1 to {most}"));
        }
        if self.postcopy_after_rounds.is_some() && !self.postcopy {
            return Err("postcopy_after_rounds needs postcopy".into());
        }
        if self.postcopy_after_rounds == Some(0) {
            return Err("postcopy_after_rounds must be at least 1".into());
        }
        if self.postcopy && self.mode == Mode::Inline {
            return Err("postcopy needs mode thread".into());
        }
        if self.connections > 1 && self.mode == Mode::Inline {
            return Err(
                "connections above 1 need mode thread (inline, the device loop sends alone)".into(),
            );
        }
        Ok(())
    }
}

/// Where a migration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    Setup,
    PreCopy,
    StopAndCopy,
    /// The destination runs the guest and fetches its missing pages.
    PostCopy,
    Completed,
    Failed,
    Cancelled,
}

impl Phase {
    /// Whether the migration has ended.
    pub fn ended(self) -> bool {
        matches!(self, Phase::Completed | Phase::Failed | Phase::Cancelled)
    }
}

/// The stop-and-copy's steps, ms each: pausing the VM, the last dirty
/// pages, capturing and encoding the state, flushing and releasing the
/// disks, and the state sent until the destination said it holds the
/// guest. (`Go`, sent after, is part of the downtime, not of these.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct DowntimeParts {
    pub pause_ms: f64,
    pub pages_ms: f64,
    pub state_ms: f64,
    pub disks_ms: f64,
    pub handover_ms: f64,
}

/// A migration's progress, and at its end its report.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub to: String,
    pub phase: Phase,
    pub params: Params,
    /// The round under way (0: all of memory).
    pub round: u32,
    /// Pages sent in each finished round, the stop-and-copy last.
    pub rounds: Vec<u64>,
    /// Dirty bytes at the last look.
    pub remaining_bytes: u64,
    /// The last estimate of the stop-and-copy's time, ms.
    pub expected_downtime_ms: f64,
    /// Bytes written to the stream (memory batches).
    pub sent_bytes: u64,
    /// Pages sent, data and zero.
    pub pages: u64,
    /// Of those, zero pages (sent as markers).
    pub zero_pages: u64,
    pub send_rate_mib: f64,
    pub dirty_rate_mib: f64,
    /// The vCPU throttle reached, percent.
    pub throttle: u8,
    /// Connect and handshake, ms.
    pub setup_ms: f64,
    /// Starting KVM's dirty log, ms (all of memory write-protected, unless
    /// `log_all_dirty`).
    pub log_start_ms: f64,
    /// The log started all dirty (`KVM_DIRTY_LOG_INITIALLY_SET`): memory
    /// was write-protected chunk by chunk in round 0, not at the start.
    pub log_all_dirty: bool,
    /// Source paused to the destination holding the guest, ms.
    pub downtime_ms: Option<f64>,
    /// Where the downtime went.
    pub downtime_parts: Option<DowntimeParts>,
    pub total_ms: f64,
    pub error: Option<String>,
    /// Post-copy, once switched to.
    pub postcopy: Option<PostcopyReport>,
    /// The migration failed after the switch to post-copy: neither side
    /// holds the whole guest (this VMM ends).
    pub lost: bool,
}

/// A post-copy: what the destination lacked at the switch, how it came,
/// and what its guest waited.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PostcopyReport {
    /// The pre-copy round at whose look it switched.
    pub switched_at_round: u32,
    /// Pages the destination lacked at the switch.
    pub needed_pages: u64,
    /// Of those, sent so far.
    pub sent_pages: u64,
    /// Sent because the destination's guest faulted on them.
    pub requested_pages: u64,
    /// Faults that waited for the link (the destination's count).
    pub faults: u64,
    /// A fault's wait at the destination, ms: median, 99th percentile,
    /// largest.
    pub fault_p50_ms: f64,
    pub fault_p99_ms: f64,
    pub fault_max_ms: f64,
    /// From `Go` to the destination holding every page, ms.
    pub fetch_ms: f64,
    /// The source kept the guest's memory until then (always: it is the
    /// only other copy).
    pub source_kept_memory: bool,
}

impl Status {
    pub fn new(to: &Endpoint, params: &Params) -> Status {
        Status {
            to: to.to_string(),
            phase: Phase::Setup,
            params: params.clone(),
            round: 0,
            rounds: Vec::new(),
            remaining_bytes: 0,
            expected_downtime_ms: 0.0,
            sent_bytes: 0,
            pages: 0,
            zero_pages: 0,
            send_rate_mib: 0.0,
            dirty_rate_mib: 0.0,
            throttle: 0,
            setup_ms: 0.0,
            log_start_ms: 0.0,
            log_all_dirty: false,
            downtime_ms: None,
            downtime_parts: None,
            total_ms: 0.0,
            error: None,
            postcopy: None,
            lost: false,
        }
    }

    /// Whether the downtime seen went over the budget.
    pub fn over_budget(&self) -> bool {
        self.downtime_ms
            .is_some_and(|d| d > self.params.downtime_ms as f64)
    }
}

//! COLO, the vmm's side: a primary/secondary pair on one stream (the
//! migration's, which carries the initial sync and then the pair's
//! heartbeats and checkpoints; `migration::protocol`, COLO sequence).
//!
//! - [`primary`]: the `colo` thread of the VM that serves, started by the
//!   `colo_start` API verb: the lease, the pair, then the survivor.
//! - [`pair`]: one pair from the primary's side (initial sync, heartbeats,
//!   checkpoints), run by the primary and by a re-protected survivor.
//! - [`survivor`]: a side that serves alone once its pair ended.
//! - [`secondary`]: what `tandem run --colo secondary` runs after the
//!   initial sync on its `incoming` thread: answers heartbeats, applies
//!   whole checkpoints, takes over when the primary is lost.
//! - [`dirty`]: dirty bitmaps and page spans, both ways.
//! - [`disks`]: both sides' disk images checked equal at the start.
//! - [`forward`] and [`replica`]: the disks' replication, the primary's
//!   guest writes forwarded as they happen, the secondary's journal and
//!   overlay.
//! - [`incoming`]: one checkpoint as the secondary reads it (checked, held
//!   whole), short of KVM.
//! - [`proxy`] and [`link`]: each side's network proxy thread (mirror,
//!   compare, release; the secondary's loop in `proxy_secondary.rs`) and
//!   the frames on the link between them; [`tap_out`]: a tap and the
//!   frames waiting for room in it; [`stages`]: the proxies' stage
//!   histograms.
//!
//! The pure parts (failover state machine, checkpoint scheduling, the
//! lease) are the `replication` crate's; this module carries out their
//! decisions on a VM. Who may serve is the lease's decision
//! ([`replication::arbiter::LockFileLease`] on one host, an etcd lease
//! across hosts; [`arbiter`]), never a guess.

pub mod arbiter;
pub mod channels;
pub mod dirty;
pub mod disks;
pub mod forward;
pub mod incoming;
pub mod link;
pub mod pair;
pub mod primary;
pub mod proxy;
pub mod replica;
pub mod secondary;
pub mod stages;
pub mod survivor;
pub mod tap_out;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use migration::protocol::ProtocolError;
use replication::failover::{Role, State};

use crate::migrate::MigrateError;
use crate::streams::Endpoint;

/// Checkpoint pauses kept in the report.
pub const RECENT: usize = 1024;
/// Default period between checkpoints (QEMU's: 20 s).
pub const DEFAULT_PERIOD_MS: u64 = 20_000;
pub const DEFAULT_HEARTBEAT_MS: u32 = 100;
pub const DEFAULT_HEARTBEAT_TIMEOUT_MS: u32 = 1000;

/// Why a COLO side failed.
#[derive(Debug, thiserror::Error)]
pub enum ColoError {
    #[error(transparent)]
    Migrate(#[from] MigrateError),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error("replication stream: {0}")]
    Stream(#[source] std::io::Error),
    #[error(transparent)]
    Vm(#[from] crate::vm::VmOpError),
    #[error(transparent)]
    Memory(#[from] crate::vstate::memory::MemoryError),
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    #[error("encoding the VM's state: {0}")]
    Encode(#[from] crate::snapshot::SaveError),
    #[error(transparent)]
    Arbiter(#[from] replication::arbiter::ArbiterError),
    #[error(transparent)]
    Failover(#[from] replication::failover::FailoverError),
    #[error("a checkpoint of {pages} pages is more than the guest's {limit}")]
    TooBig { pages: u64, limit: u64 },
    /// A message the COLO sequence does not expect there.
    #[error("unexpected {got} {place}")]
    Unexpected {
        got: &'static str,
        place: &'static str,
    },
    /// A message the sequence needs did not come (`Protect`, `Dirty`, ...).
    #[error("no {0}")]
    Missing(&'static str),
    #[error("a checkpoint without state")]
    NoState,
    /// A connection, a file or a disk that could not be used.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} panicked")]
    Panicked(&'static str),
    #[error(transparent)]
    Compare(#[from] replication::compare::CompareError),
    /// A NIC that could not move onto the proxy's backend.
    #[error("{0}")]
    NicSwap(String),
    #[error("no Committed before this side's output gate closed")]
    GateClosed,
    /// A frame on the network link that is not one.
    #[error("network link: {0}")]
    Link(String),
    /// The two sides' disk images differ (what the secondary found).
    #[error("{0}")]
    DisksDiffer(String),
    #[error("a write to disk {0}, not replicated here")]
    NotReplicated(u32),
    #[error("disk {disk}: {source}")]
    Journal {
        disk: u64,
        #[source]
        source: replication::journal::JournalError,
    },
}

impl ColoError {
    /// [`ColoError::Io`] about `what`.
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ColoError {
        let what = what.into();
        move |source| ColoError::Io { what, source }
    }
}

/// What `colo_start` (and `colo_reprotect`) asks for: the pair's peer
/// and its parameters (reached through `Deref`, `params.heartbeat_ms`).
/// The arbiter is given apart: a survivor keeps its own.
#[derive(Debug, Clone)]
pub struct Params {
    pub to: Endpoint,
    pub pair: PairParams,
}

impl std::ops::Deref for Params {
    type Target = PairParams;

    fn deref(&self) -> &PairParams {
        &self.pair
    }
}

/// A pair's timing, compare queue and page channels, written once: the
/// API's `colo_start` and `colo_reprotect` take them flattened (each field
/// optional, these defaults), and `tandem ctl colo-*` builds the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct PairParams {
    /// A checkpoint this often, ms.
    #[serde(default = "pair_default::period")]
    pub checkpoint_period_ms: u64,
    /// A heartbeat this often, ms.
    #[serde(default = "pair_default::heartbeat")]
    pub heartbeat_ms: u32,
    /// The peer is lost after this long without a heartbeat, ms.
    #[serde(default = "pair_default::heartbeat_timeout")]
    pub heartbeat_timeout_ms: u32,
    /// A primary frame waits this long for its match, then a checkpoint.
    #[serde(default = "pair_default::compare_timeout")]
    pub compare_timeout_ms: u64,
    /// Frames each side of the compare holds, at most.
    #[serde(default = "pair_default::max_queue")]
    pub max_queue: usize,
    /// What a full compare queue does.
    #[serde(default)]
    pub queue_full: QueueFullPolicy,
    /// Connections a checkpoint's pages go over (1: the stream itself).
    #[serde(default = "pair_default::channels")]
    pub channels: u16,
}

impl Default for PairParams {
    fn default() -> Self {
        PairParams {
            checkpoint_period_ms: DEFAULT_PERIOD_MS,
            heartbeat_ms: DEFAULT_HEARTBEAT_MS,
            heartbeat_timeout_ms: DEFAULT_HEARTBEAT_TIMEOUT_MS,
            compare_timeout_ms: DEFAULT_COMPARE_TIMEOUT_MS,
            max_queue: DEFAULT_MAX_QUEUE,
            queue_full: QueueFullPolicy::default(),
            channels: 1,
        }
    }
}

/// [`PairParams`]' defaults as serde wants them (functions).
mod pair_default {
    pub fn period() -> u64 {
        super::DEFAULT_PERIOD_MS
    }
    pub fn heartbeat() -> u32 {
        super::DEFAULT_HEARTBEAT_MS
    }
    pub fn heartbeat_timeout() -> u32 {
        super::DEFAULT_HEARTBEAT_TIMEOUT_MS
    }
    pub fn compare_timeout() -> u64 {
        super::DEFAULT_COMPARE_TIMEOUT_MS
    }
    pub fn max_queue() -> usize {
        super::DEFAULT_MAX_QUEUE
    }
    pub fn channels() -> u16 {
        1
    }
}

/// What a full compare queue does (`--colo-queue-full`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueFullPolicy {
    /// Drop the frame and count it (the measured better).
    #[default]
    Drop,
    /// Drop it and take a checkpoint (only to measure the difference).
    Checkpoint,
}

pub const DEFAULT_COMPARE_TIMEOUT_MS: u64 = 3000;
pub const DEFAULT_MAX_QUEUE: usize = 1024;

/// Where default leases live: a directory of their own (sticky and open
/// to every user, like /tmp), so that Landlock can give a VM this
/// directory rather than all of /tmp.
pub const LEASE_DIR: &str = "/tmp/tandem-colo";

/// Makes [`LEASE_DIR`] (mode 1777) unless it exists, and says so when an
/// existing one is not a directory owned by root or this user with the
/// sticky bit (another user could then remove or replace the leases in
/// it). A failure to make it is left to the lease's own open, which names
/// the path.
pub fn make_lease_dir() {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let made = std::fs::DirBuilder::new().mode(0o1777).create(LEASE_DIR);
    if made.is_ok() {
        // The umask took bits from the mode given to mkdir.
        let _ = std::fs::set_permissions(LEASE_DIR, std::fs::Permissions::from_mode(0o1777));
        return;
    }
    let Ok(m) = std::fs::symlink_metadata(LEASE_DIR) else {
        return;
    };
    // SAFETY: geteuid has no arguments and cannot fail.
    let me = unsafe { libc::geteuid() };
    let owned = m.uid() == 0 || m.uid() == me;
    if !m.is_dir() || !owned || m.mode() & 0o1000 == 0 {
        log::warn!(
            "{LEASE_DIR} (default COLO leases) is not a sticky directory owned by root or \
             this user: another user could remove or replace leases there; give \
             --colo-lease (and colo-start's lease) elsewhere"
        );
    }
}

/// The one-host lease both sides of a pair on `addr` find without being
/// told: a file in [`LEASE_DIR`] named after the secondary's address.
pub fn default_lease(addr: &Endpoint) -> PathBuf {
    let name: String = addr
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    Path::new(LEASE_DIR).join(format!("{name}.lock"))
}

/// One side's report (`colo_status`).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub role: Role,
    pub state: State,
    pub peer: String,
    /// The arbiter, as given.
    pub arbiter: String,
    /// The pair's streams: "tls" or "plain".
    pub transport: &'static str,
    /// The arbiter now: kind, holder, TTL left (after the pair started).
    pub lease: Option<replication::arbiter::ArbiterInfo>,
    /// The last committed checkpoint.
    pub epoch: u64,
    pub last_heartbeat_age_ms: Option<u64>,
    /// Why the last failover, go-alone, retirement or fence happened; or
    /// why the pair could not start.
    pub reason: Option<String>,
    pub heartbeat_ms: u32,
    pub heartbeat_timeout_ms: u32,
    pub checkpoint_period_ms: Option<u64>,
    /// Page channels of its checkpoints (1: the stream).
    pub channels: u16,
    /// The primary's checkpoints (by reason, pause, bytes).
    pub checkpoints: Option<replication::schedule::Stats>,
    /// The pauses of the last [`RECENT`] checkpoints, ms, oldest first
    /// (for percentiles).
    pub recent_pauses_ms: std::collections::VecDeque<f64>,
    /// Pages the secondary asked for at checkpoints (what its guest wrote).
    pub secondary_pages: u64,
    /// The initial sync (a migration that keeps the guest here).
    pub sync: Option<crate::migrate::Status>,
    /// Pages the secondary received in checkpoints, and checkpoints it
    /// dropped because they did not arrive whole.
    pub applied_pages: u64,
    pub dropped_checkpoints: u64,
    /// The primary's compare: matched, mismatched, timed out, dropped at
    /// a full queue, passed through.
    pub compare: Option<replication::compare::Counters>,
    /// The network proxy's frames.
    pub proxy: Option<proxy::ProxyCounters>,
    /// The primary's compare: how long frames were held, by what
    /// released them (match, checkpoint and the checkpoint's reason).
    pub holds: Option<replication::compare::Holds>,
    /// Where frames spend their time in this side's proxy.
    pub stages: Option<stages::Stages>,
    /// The primary's: where its checkpoints' pauses went.
    pub pause_stages: Option<pair::PauseStages>,
    /// The primary's disk writes forwarded to the secondary, bytes.
    pub disk_bytes_forwarded: u64,
    /// The secondary's writable disks: journal and overlay.
    pub disks: Vec<replication::journal::DiskStats>,
}

impl Report {
    /// A side's report before its pair started.
    fn new(role: Role, peer: String, arbiter: String, transport: &'static str) -> Report {
        Report {
            role,
            state: State::Syncing,
            peer,
            arbiter,
            transport,
            lease: None,
            epoch: 0,
            last_heartbeat_age_ms: None,
            reason: None,
            heartbeat_ms: 0,
            heartbeat_timeout_ms: 0,
            checkpoint_period_ms: None,
            channels: 1,
            checkpoints: None,
            recent_pauses_ms: Default::default(),
            secondary_pages: 0,
            sync: None,
            applied_pages: 0,
            dropped_checkpoints: 0,
            compare: None,
            holds: None,
            stages: None,
            pause_stages: None,
            proxy: None,
            disk_bytes_forwarded: 0,
            disks: Vec::new(),
        }
    }
}

/// A side as the API sees it: its report, and the operator's requests.
/// The COLO side a VM is in, if any. Held by the layer that runs the VM
/// (`vm_loop`, the control adapter), never by the VM core; cheap to clone.
#[derive(Clone, Default)]
pub struct Slot(Arc<Mutex<Option<Arc<Side>>>>);

impl Slot {
    /// The side, if the VM is in a pair (or was).
    pub fn get(&self) -> Option<Arc<Side>> {
        devices::sync::lock(&self.0).clone()
    }

    /// Makes `side` the VM's side of a COLO pair.
    pub fn set(&self, side: Arc<Side>) {
        *devices::sync::lock(&self.0) = Some(side);
    }

    /// Adds the side's report (as `colo_status` gives it) to the VM's
    /// metrics, under `colo`.
    pub fn add_report(&self, metrics: &mut serde_json::Value) {
        if let (Some(side), Some(o)) = (self.get(), metrics.as_object_mut()) {
            let report = serde_json::to_value(side.report()).unwrap_or_default();
            o.insert("colo".into(), report);
        }
    }
}

pub struct Side {
    report: Mutex<Report>,
    failover: AtomicBool,
    checkpoint: AtomicBool,
    stop: AtomicBool,
    heartbeat_at: Mutex<Option<Instant>>,
    /// Checkpoints the compare asked for.
    requests: Mutex<Vec<replication::schedule::Reason>>,
    /// A re-protect asked for (`colo_reprotect`), not yet taken.
    reprotect: Mutex<Option<Params>>,
    /// Set (and `wake` notified) when any of the above is asked: the
    /// side's thread waits on it instead of sleeping a turn.
    woken: Mutex<bool>,
    wake: Condvar,
}

impl Side {
    fn new(report: Report) -> Side {
        Side {
            report: Mutex::new(report),
            failover: AtomicBool::new(false),
            checkpoint: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            heartbeat_at: Mutex::new(None),
            requests: Mutex::new(Vec::new()),
            reprotect: Mutex::new(None),
            woken: Mutex::new(false),
            wake: Condvar::new(),
        }
    }

    /// `colo_reprotect`: the side's thread starts a new pair with a new
    /// secondary at its next turn (if it still serves alone then).
    pub fn request_reprotect(&self, params: Params) {
        *devices::sync::lock(&self.reprotect) = Some(params);
    }

    fn take_reprotect(&self) -> Option<Params> {
        devices::sync::lock(&self.reprotect).take()
    }

    /// A new pair from this side, as its primary: a fresh report (the
    /// arbiter's name kept).
    fn renew(&self, params: &Params) {
        self.update(|r| {
            let arbiter = std::mem::take(&mut r.arbiter);
            let transport = r.transport;
            *r = Report {
                channels: params.channels,
                heartbeat_ms: params.heartbeat_ms,
                heartbeat_timeout_ms: params.heartbeat_timeout_ms,
                checkpoint_period_ms: Some(params.checkpoint_period_ms),
                ..Report::new(Role::Primary, params.to.to_string(), arbiter, transport)
            };
        });
    }

    /// The report now.
    pub fn report(&self) -> Report {
        let mut r = devices::sync::lock(&self.report).clone();
        r.last_heartbeat_age_ms = devices::sync::lock(&self.heartbeat_at)
            .map(|t| u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX));
        r
    }

    fn update(&self, f: impl FnOnce(&mut Report)) {
        f(&mut devices::sync::lock(&self.report));
    }

    /// When the peer was last heard from.
    fn heard_at(&self) -> Option<Instant> {
        *devices::sync::lock(&self.heartbeat_at)
    }

    fn heard(&self, at: Instant) {
        *devices::sync::lock(&self.heartbeat_at) = Some(at);
    }

    /// `colo_failover`: the side's thread acts on it at its next turn.
    pub fn force_failover(&self) {
        self.failover.store(true, Ordering::SeqCst);
        self.poke();
    }

    /// A checkpoint now (the primary's thread, at its next turn).
    pub fn checkpoint_now(&self) {
        self.checkpoint.store(true, Ordering::SeqCst);
        self.poke();
    }

    /// A checkpoint the compare asks for.
    pub fn request(&self, reason: replication::schedule::Reason) {
        devices::sync::lock(&self.requests).push(reason);
        self.poke();
    }

    /// Wakes the side's thread if it waits in [`Side::wait`].
    fn poke(&self) {
        *devices::sync::lock(&self.woken) = true;
        self.wake.notify_all();
    }

    /// Waits until something is asked of the side's thread (a checkpoint,
    /// a failover, its end) or `most` passed.
    fn wait(&self, most: Duration) {
        let mut woken = devices::sync::lock(&self.woken);
        if !*woken {
            woken = match self.wake.wait_timeout(woken, most) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        *woken = false;
    }

    fn requested(&self) -> Vec<replication::schedule::Reason> {
        std::mem::take(&mut *devices::sync::lock(&self.requests))
    }

    /// Ends the side's thread (the VMM is ending).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.poke();
    }

    fn take(flag: &AtomicBool) -> bool {
        flag.swap(false, Ordering::SeqCst)
    }
}

/// Checks a pair's timing: a heartbeat of at least 10 ms, a timeout above
/// it, a period of at least 100 ms.
pub fn check_timing(period_ms: u64, heartbeat_ms: u32, timeout_ms: u32) -> Result<(), String> {
    if heartbeat_ms < 10 {
        return Err(format!("a heartbeat every {heartbeat_ms} ms: 10 at least"));
    }
    if timeout_ms <= heartbeat_ms.saturating_mul(2) {
        return Err(format!(
            "a heartbeat timeout of {timeout_ms} ms must be over twice the interval ({heartbeat_ms} ms)"
        ));
    }
    if period_ms < 100 {
        return Err(format!("a checkpoint every {period_ms} ms: 100 at least"));
    }
    Ok(())
}

/// The heartbeat timing of `p`, as the replication crate takes it.
fn failover_config(heartbeat_ms: u32, timeout_ms: u32) -> replication::failover::Config {
    replication::failover::Config {
        interval: Duration::from_millis(u64::from(heartbeat_ms)),
        timeout: Duration::from_millis(u64::from(timeout_ms)),
    }
}

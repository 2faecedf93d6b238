//! One COLO pair with this VM as its primary ([`protect`]), run on the
//! primary's thread ("colo", the `primary` module) and again by a survivor
//! that is protected anew (the `survivor` module): syncs the secondary (a
//! migration that keeps the guest here), then heartbeats and checkpoints
//! until the pair ends.
//!
//! Its guest's disk writes go to the secondary as they happen (a share at
//! each turn, [`super::forward`]), and a checkpoint is taken when they
//! fill an eighth of the secondary's journal.
//!
//! A checkpoint: its guest's dirty pages go ahead while both guests run
//! (the secondary holds them) → `Checkpoint e` → the secondary pauses and
//! answers with the pages its guest wrote → this VM pauses → its last disk
//! writes, the pages its guest wrote since, and the secondary's not sent
//! ahead go out, then the vCPU and device state, then `Commit` → the
//! secondary applies it all and answers `Committed` → this VM resumes. The
//! secondary thus becomes an exact copy with no second copy of guest
//! memory on its side (design.md §6, Memory on the secondary). The pause
//! is measured from this VM's pause to its resume.
//!
//! Never does: release the lease while this VM may serve; go on alone
//! without recording it in the lease first (the failover state machine's
//! rule); resume a paused guest that the user paused before the pair
//! started. It takes no lock a vCPU or the device thread takes, except
//! through the VM's own pause, capture and resume.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use migration::protocol::colo::{check_spans, Timing};
use migration::protocol::{self, Command, Message};
use replication::arbiter::Arbiter;
use replication::failover::{Action, Failover, State};
use replication::schedule::{self, Reason, Scheduler};

use super::arbiter::Fence;
use super::forward::Forwarder;
use super::proxy::{Cmd, Proxy};
use super::{dirty, failover_config, ColoError, Params, QueueFullPolicy, Side};
use crate::boot::layout;
use crate::migrate::VmLink;
use crate::streams::endpoint::Conn;
use crate::vstate::memory::DirtyBitmap;
use devices::virtio::net::datagram::{Datagram, Peer};
use devices::virtio::net::NetBackend;
use replication::compare::{Compare, CompareConfig, QueueFull};
use replication::histogram::Histogram;

/// How long the primary waits for `Committed`: the secondary writes the
/// pages and applies the state first.
const COMMIT_WAIT: Duration = Duration::from_secs(10);
/// How long a NIC's backend swap and a proxy's command may take.
const PROXY_WAIT: Duration = Duration::from_secs(5);
/// How long the primary waits for the secondary's answer to its disks.
const SUMS_WAIT: Duration = Duration::from_secs(120);
/// How soon disk writes the guest made are forwarded (a share each turn;
/// a checkpoint sends the rest). Heartbeats, checkpoints and the
/// compare's requests wake the thread on their own.
const DISK_TURN: Duration = Duration::from_millis(10);
/// Disk writes forwarded at one turn, at most (the rest at the next).
const TURN_DISK_BYTES: u64 = 4 << 20;

/// What a pair that ran leaves to its survivor.
pub struct Ended {
    pub fo: Failover,
    pub fence: Fence,
    pub proxy: Proxy,
}

/// One pair with this VM as its primary, until it ends: the lease taken
/// (or, for a `survivor` that serves under it already, kept whatever
/// happens), the secondary synced, then heartbeats and checkpoints. A pair
/// that does not start leaves the guest running here as before it (dirty
/// log off; the lease free unless a survivor's).
pub fn protect(
    vm: &VmLink,
    params: &Params,
    side_arc: &Arc<Side>,
    lease: &mut dyn Arbiter,
    survivor: bool,
) -> Result<Ended, ColoError> {
    let side = &**side_arc;
    let config = failover_config(params.heartbeat_ms, params.heartbeat_timeout_ms);
    let fo = Failover::primary(config, Instant::now(), lease)?;
    let give_up = |lease: &mut dyn Arbiter| {
        if !survivor {
            lease.release();
        }
    };
    // Before the disks are hashed: nothing the guest writes from now on
    // is missed.
    let forward = match Forwarder::start(vm) {
        Ok(f) => f,
        Err(e) => {
            give_up(lease);
            return Err(e);
        }
    };
    let fence = Fence::new(lease.gate());
    let synced = sync(vm, params, side).and_then(|c| {
        let proxy = start_proxy(vm, params, side_arc.clone(), fence.clone());
        let channels = proxy.as_ref().ok().map(|_| {
            super::channels::open(vm.transport(), &params.to, params.channels, COMMIT_WAIT)
        });
        match (proxy, channels) {
            (Ok(p), Some(Ok(ch))) => Ok((c, p, ch)),
            (Err(e), _) | (Ok(_), Some(Err(e))) => {
                c.shutdown();
                Err(e)
            }
            (Ok(_), None) => Err(ColoError::Missing("page channels")),
        }
    });
    let (mut conn, proxy, channels) = match synced {
        Ok(c) => c,
        Err(e) => {
            if let Err(d) = vm.ram().stop_dirty_log() {
                log::warn!("COLO: dirty log not stopped: {d}");
            }
            give_up(lease);
            return Err(e);
        }
    };
    let to = &params.to;
    eprintln!("tandem: COLO: the secondary at {to} holds a copy; protecting");
    let mut pair = Pair {
        vm,
        side,
        fo,
        lease,
        fence,
        sched: Scheduler::new(
            schedule::Config {
                period: Duration::from_millis(params.checkpoint_period_ms),
                min_gap: Duration::ZERO,
            },
            Instant::now(),
        ),
        layout: layout::ram_ranges(vm.manifest().mem_bytes),
        timeout: Duration::from_millis(u64::from(params.heartbeat_timeout_ms)),
        forward: Some(forward),
        proxy,
        channels,
        pause_stages: PauseStages::default(),
    };
    // The first checkpoint at once: the secondary is protected from it on.
    pair.sched.request(Reason::Demand, Instant::now());
    pair.serve(&mut conn);
    let Pair {
        fo, fence, proxy, ..
    } = pair;
    Ok(Ended { fo, fence, proxy })
}

/// The initial sync; then the pair's timing and the disks' sums go to
/// the secondary, which checks them against its own images.
fn sync(vm: &VmLink, params: &Params, side: &Side) -> Result<Conn, ColoError> {
    let sums = super::disks::sums(vm.manifest())?;
    let mparams = crate::migrate::Params {
        downtime_ms: 300,
        bandwidth_mib: None,
        auto_converge: true,
        timeout_s: 600,
        mode: crate::migrate::Mode::Thread,
        initially_set: true,
        connections: 1,
        postcopy: false,
        postcopy_after_rounds: None,
    };
    let status = Mutex::new(crate::migrate::Status::new(&params.to, &mparams));
    let synced =
        crate::migrate::source::sync_keeping(vm, &params.to, &mparams, &status, &side.stop);
    side.update(|r| r.sync = Some(devices::sync::lock(&status).clone()));
    let mut conn = synced?;
    conn.set_timeouts(Duration::from_millis(u64::from(
        params.heartbeat_timeout_ms,
    )))
    .map_err(ColoError::Stream)?;
    let timing = Timing {
        heartbeat_ms: params.heartbeat_ms,
        timeout_ms: params.heartbeat_timeout_ms,
        channels: params.channels,
    };
    protocol::write_message(&mut conn, &Message::Protect(timing))?;
    protocol::write_message(&mut conn, &Message::Disks(sums))?;
    // The secondary hashes its images meanwhile.
    conn.set_timeouts(SUMS_WAIT).map_err(ColoError::Stream)?;
    protocol::expect(&mut conn, Command::Accept)?;
    conn.set_timeouts(Duration::from_millis(u64::from(
        params.heartbeat_timeout_ms,
    )))
    .map_err(ColoError::Stream)?;
    Ok(conn)
}

pub(super) fn not_started(side: &Side, e: ColoError) {
    log::error!("COLO: the pair did not start: {e}");
    side.update(|r| {
        r.state = State::Retired;
        r.reason = Some(format!("the pair did not start: {e}"));
    });
}

struct Pair<'a> {
    vm: &'a VmLink,
    side: &'a Side,
    fo: Failover,
    lease: &'a mut dyn Arbiter,
    /// What the proxy's output passes.
    fence: Fence,
    sched: Scheduler,
    layout: Vec<(u64, u64)>,
    timeout: Duration,
    /// The guest's disk writes on their way (`None` once the pair ended).
    forward: Option<Forwarder>,
    proxy: Proxy,
    /// The page channels (none: the pages go on the stream).
    channels: Vec<Conn>,
    pause_stages: PauseStages,
}

impl Pair<'_> {
    /// Heartbeats and checkpoints while the pair is formed.
    fn serve(&mut self, conn: &mut Conn) {
        loop {
            if Side::take(&self.side.stop) {
                // The VMM ends: so does the pair (the secondary sees it).
                conn.shutdown();
                self.side.stop();
                return;
            }
            let now = Instant::now();
            let mut actions = self.fo.tick(now, self.lease);
            if Side::take(&self.side.failover) {
                match self.fo.force_failover(self.lease) {
                    Ok(a) => actions.extend(a),
                    Err(e) => log::warn!("COLO: failover not forced: {e}"),
                }
            }
            if Side::take(&self.side.checkpoint) {
                self.sched.request(Reason::Demand, now);
            }
            for r in self.side.requested() {
                self.sched.request(r, now);
            }
            if let Some(f) = self.forward.as_mut() {
                match f.send(conn, TURN_DISK_BYTES) {
                    Ok(_) if f.due() => self.sched.request(Reason::Disk, now),
                    Ok(_) => {}
                    Err(e) => {
                        log::warn!("COLO: forwarding disk writes: {e}");
                        actions.extend(self.fo.connection_lost(self.lease));
                    }
                }
            }
            if !actions.is_empty() {
                self.act(conn, actions);
            }
            let paired = matches!(self.fo.state(), State::Syncing | State::Protected);
            if paired && self.sched.due(Instant::now()).is_some() {
                self.checkpoint(conn);
            }
            self.report();
            if !matches!(self.fo.state(), State::Syncing | State::Protected) {
                return;
            }
            self.side.wait(self.next_turn(Instant::now()));
        }
    }

    /// How long the thread may wait for something to be asked of it: until
    /// the next heartbeat or checkpoint is due, or a turn while disk
    /// writes wait to be forwarded.
    fn next_turn(&self, now: Instant) -> Duration {
        let mut most = self.fo.next_tick(now).min(self.sched.next_deadline(now));
        if self.forward.as_ref().is_some_and(Forwarder::pending) {
            most = most.min(DISK_TURN);
        }
        most
    }

    /// Carries out the failover state machine's decisions.
    fn act(&mut self, conn: &mut Conn, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::SendHeartbeat => match heartbeat(conn) {
                    Ok(sent) => {
                        self.fence.peer_answered(sent, self.timeout);
                        let now = Instant::now();
                        self.fo.heartbeat_received(now);
                        self.side.heard(now);
                    }
                    Err(e) => {
                        log::warn!("COLO: heartbeat: {e}");
                        let more = self.fo.connection_lost(self.lease);
                        self.act(conn, more);
                    }
                },
                Action::StopReplication => {
                    self.fence.peer_gone();
                    conn.shutdown();
                    self.forward = None;
                    if let Err(e) = self.vm.ram().stop_dirty_log() {
                        log::warn!("COLO: dirty log not stopped: {e}");
                    }
                }
                Action::GoAlone => {
                    if !self.proxy.call(Cmd::Alone, PROXY_WAIT) {
                        log::error!("COLO: the network proxy did not go alone");
                    }
                    eprintln!(
                        "tandem: COLO: the secondary is lost; the guest runs on here alone ({})",
                        self.fo.status(Instant::now()).reason.unwrap_or_default()
                    )
                }
                Action::Fence => {
                    self.fence.shut();
                    let why = self.fo.status(Instant::now()).reason.unwrap_or_default();
                    eprintln!("tandem: COLO: fenced, the guest is paused: {why}");
                    if let Err(e) = self.vm.pause() {
                        log::error!("COLO: cannot pause the fenced guest: {e}");
                    }
                }
                Action::TakeOver | Action::Retire(_) => {}
            }
        }
    }

    /// One checkpoint, counted; a failed one ends the pair.
    fn checkpoint(&mut self, conn: &mut Conn) {
        let epoch = self.fo.epoch() + 1;
        let Ok(why) = self.sched.started(Instant::now()) else {
            return;
        };
        let proxy = &self.proxy;
        let on_commit = || {
            if !proxy.call(Cmd::Committed(epoch, Some(why)), PROXY_WAIT) {
                log::error!("COLO: the network proxy did not take checkpoint {epoch}");
            }
        };
        let Some(forward) = self.forward.as_mut() else {
            return;
        };
        let to = Target {
            conn,
            channels: &mut self.channels,
            forward,
            layout: &self.layout,
            timeout: self.timeout,
            fence: &self.fence,
        };
        let sent = Instant::now();
        match checkpoint(self.vm, to, epoch, &on_commit) {
            Ok(done) => {
                self.fence.peer_answered(sent, self.timeout);
                forward.committed();
                let _ = self.sched.finished(Instant::now(), done.pause, done.bytes);
                self.pause_stages.record(&done.parts);
                let stages = self.pause_stages.clone();
                self.side.update(|r| {
                    r.pause_stages = Some(stages);
                    r.secondary_pages += done.theirs;
                    if r.recent_pauses_ms.len() == super::RECENT {
                        r.recent_pauses_ms.pop_front();
                    }
                    r.recent_pauses_ms
                        .push_back(done.pause.as_secs_f64() * 1000.0);
                });
                if let Err(e) = self.fo.checkpoint_committed(epoch) {
                    log::error!("COLO: checkpoint {epoch}: {e}");
                }
                if epoch == 1 {
                    // A new pair: an older pair's mark no longer applies.
                    if let Err(e) = self.lease.clear_alone() {
                        log::warn!("COLO: the old alone mark stays: {e}");
                    }
                }
                let now = Instant::now();
                self.fo.heartbeat_received(now);
                self.side.heard(now);
            }
            Err(e) => {
                let _ = self.sched.abandoned(Instant::now());
                log::warn!("COLO: checkpoint {epoch} failed: {e}");
                let more = self.fo.connection_lost(self.lease);
                self.act(conn, more);
            }
        }
    }

    fn report(&self) {
        let s = self.fo.status(Instant::now());
        let stats = self.sched.stats();
        let lease = self.lease.describe();
        self.side.update(|r| {
            r.lease = Some(lease);
            r.state = s.state;
            r.epoch = s.epoch;
            r.reason = s.reason;
            r.checkpoints = Some(stats);
            r.disk_bytes_forwarded = self.forward.as_ref().map_or(0, Forwarder::total);
        });
    }
}

/// The network link to the secondary and the proxy on it: each NIC moves
/// from its tap to a datagram backend whose other end the proxy holds,
/// with the tap (put back if a later NIC cannot move).
fn start_proxy(
    vm: &VmLink,
    params: &Params,
    side: Arc<Side>,
    fence: Fence,
) -> Result<Proxy, ColoError> {
    let mut link = vm
        .transport()
        .connect(&params.to, PROXY_WAIT)
        .map_err(ColoError::io(format!("network link to {}", params.to)))?;
    protocol::write_message(
        &mut link,
        &Message::Hello {
            version: protocol::VERSION,
        },
    )?;
    let cfg = CompareConfig {
        compare_timeout: Duration::from_millis(params.compare_timeout_ms),
        max_queue: params.max_queue,
        queue_full: match params.queue_full {
            QueueFullPolicy::Drop => QueueFull::Drop,
            QueueFullPolicy::Checkpoint => QueueFull::Checkpoint,
        },
        ..CompareConfig::default()
    };
    let compare = Compare::new(cfg)?;
    let mut nics: Vec<(Box<dyn NetBackend>, Peer, usize)> = Vec::new();
    let slots = vm.virtio();
    for (n, slot) in slots.iter().enumerate() {
        let Some(tap) = slot.tap() else { continue };
        let (backend, other) = Datagram::pair(tap).map_err(ColoError::Stream)?;
        match slot.swap_backend(Box::new(backend), PROXY_WAIT) {
            Some(Ok(old)) => nics.push((old, other, n)),
            Some(Err(e)) => {
                for (old, _, k) in nics {
                    let _ = slots[k].swap_backend(old, PROXY_WAIT);
                }
                return Err(ColoError::NicSwap(e));
            }
            None => {}
        }
    }
    let nics = nics.into_iter().map(|(t, o, _)| (t, o)).collect();
    Proxy::primary(nics, link, compare, side, fence).map_err(ColoError::Stream)
}

/// Asks the secondary for a heartbeat and waits for it (the stream's read
/// timeout is the heartbeat timeout); returns when it was sent.
fn heartbeat(conn: &mut Conn) -> Result<Instant, ColoError> {
    let sent = Instant::now();
    protocol::write_message(conn, &Message::Heartbeat)?;
    protocol::expect(conn, Command::Heartbeat)?;
    Ok(sent)
}

/// How often a wait for `Committed` looks at the output gate.
const GATE_LOOK: Duration = Duration::from_millis(50);

/// Waits (at most [`COMMIT_WAIT`]) until the secondary's answer starts to
/// arrive; gives up as soon as this side's output gate closes: the lease
/// not renewed and the peer not heard in time, the side must fence now,
/// not when the wait ends (a cut link otherwise held it here 10 s).
fn await_answer(conn: &Conn, fence: &Fence) -> Result<(), ColoError> {
    let end = Instant::now() + COMMIT_WAIT;
    while !conn.readable_within(GATE_LOOK).map_err(ColoError::Stream)? {
        if !fence.open() {
            return Err(ColoError::GateClosed);
        }
        if Instant::now() >= end {
            return Err(ColoError::Stream(std::io::ErrorKind::TimedOut.into()));
        }
    }
    Ok(())
}

/// What one checkpoint took.
struct Done {
    pause: Duration,
    bytes: u64,
    /// Pages the secondary asked for.
    theirs: u64,
    /// Where the pause went.
    parts: PauseParts,
}

/// Where a checkpoint's pause goes, each checkpoint's share in a
/// histogram (`colo-status`'s `pause_stages`): stopping the vCPUs and the
/// device thread, reading the dirty log and sending the pages, capturing
/// and sending the state, the secondary applying it all until it answers
/// `Committed`, and resuming.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PauseStages {
    /// Before the pause, both guests running: the pages sent ahead.
    pub precopy: Histogram,
    pub stop: Histogram,
    pub pages: Histogram,
    pub state: Histogram,
    pub commit: Histogram,
    pub resume: Histogram,
}

/// One checkpoint's share of each stage.
#[derive(Default)]
struct PauseParts {
    precopy: Duration,
    stop: Duration,
    pages: Duration,
    state: Duration,
    commit: Duration,
    resume: Duration,
}

impl PauseStages {
    fn record(&mut self, p: &PauseParts) {
        self.precopy.record(p.precopy);
        self.stop.record(p.stop);
        self.pages.record(p.pages);
        self.state.record(p.state);
        self.commit.record(p.commit);
        self.resume.record(p.resume);
    }
}

/// Where a checkpoint goes, and what it carries besides memory and state.
struct Target<'a> {
    conn: &'a mut Conn,
    /// The page channels, if any.
    channels: &'a mut [Conn],
    forward: &'a mut Forwarder,
    /// This VM's memory regions (the secondary's spans are checked).
    layout: &'a [(u64, u64)],
    /// The stream's timeout after the checkpoint (the heartbeat's).
    timeout: Duration,
    /// This side's output gate: once it closes, the commit is not waited
    /// for (the side must fence instead).
    fence: &'a Fence,
}

/// One checkpoint (see the module doc); the guest is resumed whatever
/// happens (unless the user had paused it).
fn checkpoint(
    vm: &VmLink,
    to: Target<'_>,
    epoch: u64,
    on_commit: &dyn Fn(),
) -> Result<Done, ColoError> {
    let conn = to.conn;
    // Both guests running: the pages written since the last checkpoint go
    // ahead (the secondary holds them), so that the pause sends only those
    // written since.
    let t = Instant::now();
    let ram = vm.ram();
    let ahead = ram.dirty_pages()?;
    let ahead_bytes = super::channels::send_pages(ram, conn, &ahead)?;
    let precopy = t.elapsed();
    protocol::write_message(conn, &Message::Checkpoint { epoch })?;
    let Message::Dirty(spans) = protocol::expect(conn, Command::Dirty)? else {
        return Err(ColoError::Missing("Dirty"));
    };
    check_spans(&spans, to.layout)?;
    let t0 = Instant::now();
    let was_paused = vm.is_paused();
    if !was_paused {
        vm.pause()?;
    }
    let mut parts = PauseParts {
        precopy,
        stop: t0.elapsed(),
        ..PauseParts::default()
    };
    // Paused, the device thread parked: every write is complete.
    let sent = to.forward.send(conn, u64::MAX).and_then(|disk| {
        let link = (&mut *to.channels, to.timeout, to.fence);
        send_checkpoint(vm, conn, link, (&spans, &ahead), &mut parts)
            .map(|(b, t)| (b + disk + ahead_bytes, t))
    });
    if sent.is_ok() {
        // Both guests paused: the proxy settles the frames of before.
        on_commit();
    }
    let t1 = Instant::now();
    let resumed = if was_paused { Ok(()) } else { vm.resume() };
    parts.resume = t1.elapsed();
    let pause = t0.elapsed();
    let (bytes, theirs) = sent?;
    resumed?;
    Ok(Done {
        pause,
        bytes,
        theirs,
        parts,
    })
}

/// With the guest paused: the pages, the state, the commit. The pages are
/// those this guest wrote since `ahead` was read, and those the
/// secondary's wrote (`spans`) but for the ones sent ahead (the secondary
/// holds this guest's copy of those already).
fn send_checkpoint(
    vm: &VmLink,
    conn: &mut Conn,
    (channels, timeout, fence): (&mut [Conn], Duration, &Fence),
    (spans, ahead): (&[migration::protocol::colo::Span], &[DirtyBitmap]),
    parts: &mut PauseParts,
) -> Result<(u64, u64), ColoError> {
    let t = Instant::now();
    let ram = vm.ram();
    let mut pages = ram.dirty_pages()?;
    let theirs = dirty::mark_except(&mut pages, spans, ahead);
    let page_bytes = if channels.is_empty() {
        super::channels::send_pages(ram, conn, &pages)?
    } else {
        super::channels::send(ram, channels, &pages)?
    };
    parts.pages = t.elapsed();
    let t = Instant::now();
    let state = vm.capture_state()?;
    let image = crate::snapshot::state_image(&state)?;
    let bytes = page_bytes + image.len() as u64;
    protocol::write_message(conn, &Message::State(image))?;
    protocol::write_message(conn, &Message::Commit)?;
    parts.state = t.elapsed();
    let t = Instant::now();
    await_answer(conn, fence)?;
    conn.set_timeouts(COMMIT_WAIT).map_err(ColoError::Stream)?;
    let committed = protocol::expect(conn, Command::Committed);
    conn.set_timeouts(timeout).map_err(ColoError::Stream)?;
    parts.commit = t.elapsed();
    committed?;
    Ok((bytes, theirs))
}

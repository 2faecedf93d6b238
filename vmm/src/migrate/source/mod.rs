//! The migration thread: sends a running VM to a destination (pre-copy
//! rounds, then stop-and-copy) and reports how it went.
//!
//! Runs on its own thread, started by the `migrate` API verb, one at a time.
//! It owns the *migration dirty bitmap*: each round it harvests KVM's dirty
//! log OR the pages device emulation wrote into its own copy, and clears
//! exactly those pages in KVM's log (`KVM_CLEAR_DIRTY_LOG`) just before it
//! copies them. During the pre-copy rounds it takes no lock a vCPU or the
//! device thread takes and never waits on them: guest memory is read through
//! vm-memory's accessors while the guest runs. Only the final stop-and-copy
//! pauses the VM. It reports through [`Status`] (read by `migrate-status`)
//! and, when it ends, to the VMM thread through an eventfd ([`Ended`]):
//! that thread then ends the VM (the guest is the destination's) or says
//! on its terminal that the guest runs on here.
//!
//! Never does: resume the guest after `Go` was sent (exactly one side runs
//! it), or leave dirty logging or a throttle on after a failure.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use migration::protocol::{self, Command, Message};

use super::inline::Slicer;
use super::lanes::{self, Work};
use super::pages::{self, Sent, Share, Stop};
use super::status::{DowntimeParts, Mode, Params, Phase, Status};
use super::MigrateError;
use crate::streams::endpoint::{Conn, Endpoint};
use vmm_sys_util::eventfd::EventFd;

use super::VmLink;

mod switch;

/// Auto-converge: first throttle, step, and ceiling (QEMU's defaults).
const THROTTLE_FIRST: u8 = 20;
const THROTTLE_STEP: u8 = 10;
const THROTTLE_MAX: u8 = 99;
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a failed migration's `Abandon` may take to go out.
const ABANDON_WAIT: Duration = Duration::from_secs(1);
/// At most this many pre-copy rounds after the dirty set first fits the
/// downtime budget (each one halves it at least).
const MAX_SHRINK_ROUNDS: u32 = 5;
/// A dirty set this small goes into the stop-and-copy as it is.
const SMALL_SET_BYTES: u64 = 1 << 20;
/// How long a completed migration waits for its report to be read.
const COLLECT_WAIT: Duration = Duration::from_secs(2);

/// The migration thread's word to the VMM thread: an eventfd written when
/// a migration ends, and its last status.
pub struct Ended {
    evt: EventFd,
    last: Mutex<Option<Status>>,
}

impl Ended {
    pub fn new() -> std::io::Result<Ended> {
        Ok(Ended {
            evt: EventFd::new(libc::EFD_NONBLOCK)?,
            last: Mutex::new(None),
        })
    }

    fn tell(&self, status: Status) {
        *devices::sync::lock(&self.last) = Some(status);
        if let Err(e) = self.evt.write(1) {
            log::error!("cannot wake the VMM thread: {e}");
        }
    }

    /// The eventfd the VMM thread's loop watches.
    pub fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.evt.as_raw_fd()
    }

    /// On the VMM thread, once the eventfd fired: how the migration ended.
    pub fn take(&self) -> Option<Status> {
        let _ = self.evt.read();
        devices::sync::lock(&self.last).take()
    }
}

/// A migration under way (or ended): its status and how to cancel it.
pub struct Migration {
    status: Arc<Mutex<Status>>,
    cancel: Arc<AtomicBool>,
    /// Set by `migrate-postcopy`: switch at the next look.
    switch: Arc<AtomicBool>,
    /// Set once a completed status has been read (by `migrate-status`):
    /// the source VMM exits only then, or after [`COLLECT_WAIT`].
    collected: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Migration {
    /// Starts the migration thread for `vm` to `to`; it tells `ended`
    /// when it ends.
    pub fn start(
        vm: VmLink,
        to: Endpoint,
        params: Params,
        ended: Arc<Ended>,
    ) -> std::io::Result<Migration> {
        let status = Arc::new(Mutex::new(Status::new(&to, &params)));
        let cancel = Arc::new(AtomicBool::new(false));
        let switch = Arc::new(AtomicBool::new(false));
        let collected = Arc::new(AtomicBool::new(false));
        let (st, c, got) = (status.clone(), cancel.clone(), collected.clone());
        let sw = switch.clone();
        let thread = std::thread::Builder::new()
            .name("migration".into())
            .spawn(move || {
                crate::sandbox::confine(crate::sandbox::Kind::Stream);
                migrate(&vm, &to, &params, &st, (&c, &sw));
                let last = devices::sync::lock(&st).clone();
                // This VMM ends after either: its report is read first.
                if last.phase == Phase::Completed || last.lost {
                    // Let a follower read the report before this VMM ends.
                    let t = Instant::now();
                    while !got.load(Ordering::SeqCst) && t.elapsed() < COLLECT_WAIT {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                ended.tell(last);
            })?;
        Ok(Migration {
            status,
            cancel,
            switch,
            collected,
            thread: Some(thread),
        })
    }

    /// Where it is.
    pub fn status(&self) -> Status {
        let s = devices::sync::lock(&self.status).clone();
        if s.phase == Phase::Completed || s.lost {
            self.collected.store(true, Ordering::SeqCst);
        }
        s
    }

    /// Whether the thread is still at work.
    pub fn active(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Asks the thread to give up (before `Go`; after it, too late).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// Asks the thread to switch to post-copy at its next look at the
    /// dirty log (`migrate-postcopy`).
    pub fn switch_to_postcopy(&self) {
        self.switch.store(true, Ordering::SeqCst);
    }
}

impl Drop for Migration {
    fn drop(&mut self) {
        self.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread's body: runs the migration and records its end.
fn migrate(
    vm: &VmLink,
    to: &Endpoint,
    params: &Params,
    status: &Mutex<Status>,
    (cancel, switch): (&AtomicBool, &AtomicBool),
) {
    let started = Instant::now();
    let turns = vm.device_turns();
    let free = || vm.is_paused();
    let slicer = match params.mode {
        Mode::Thread => Slicer::thread(),
        Mode::Inline => Slicer::inline(&turns, &free),
    };
    let mut run = Run::new(vm, params, status, cancel, &slicer, false);
    run.switch = Some(switch);
    run.started = started;
    match run.go(to) {
        Ok(_) => {
            let downtime = run.downtime.or_else(|| run.paused_at.map(|t| t.elapsed()));
            run.update(|s| {
                s.total_ms = started.elapsed().as_secs_f64() * 1000.0;
                s.phase = Phase::Completed;
                s.downtime_ms = downtime.map(|d| d.as_secs_f64() * 1000.0);
            });
            log::info!("migration to {to} completed; the guest runs there");
        }
        Err(e) => {
            let cancelled = matches!(e, MigrateError::Cancelled);
            // After the switch the VMM thread ends this VM and says why.
            let lost = run.switched;
            if !lost {
                log::error!("migration to {to} failed: {e}; the guest runs here");
            }
            let back = run.roll_back();
            run.update(|s| {
                s.total_ms = started.elapsed().as_secs_f64() * 1000.0;
                s.lost = lost;
                s.phase = if cancelled {
                    Phase::Cancelled
                } else {
                    Phase::Failed
                };
                s.error = Some(match back {
                    Ok(()) => e.to_string(),
                    Err(b) => format!("{e}; then: {b}"),
                });
            });
        }
    }
}

/// COLO's initial sync to a secondary (`tandem run --colo secondary`): a
/// whole migration up to `Go`, on the calling thread, except that the
/// guest is resumed here after it and keeps its disks, and the dirty log
/// stays on (cleared at the stop-and-copy: it holds what the guest wrote
/// since). Returns the stream, for the pair's heartbeats and checkpoints.
/// On a failure the guest runs on here as after a failed migration.
pub fn sync_keeping(
    vm: &VmLink,
    to: &Endpoint,
    params: &Params,
    status: &Mutex<Status>,
    cancel: &AtomicBool,
) -> Result<Conn, MigrateError> {
    let slicer = Slicer::thread();
    let mut run = Run::new(vm, params, status, cancel, &slicer, true);
    let done = run.go(to);
    let ended = run.started.elapsed().as_secs_f64() * 1000.0;
    match done {
        Ok(conn) => {
            let downtime = run.paused_at.map(|t| t.elapsed().as_secs_f64() * 1000.0);
            run.update(|s| {
                s.total_ms = ended;
                s.phase = Phase::Completed;
                s.downtime_ms = downtime;
            });
            Ok(conn)
        }
        Err(e) => {
            let back = run.roll_back();
            run.update(|s| {
                s.total_ms = ended;
                s.phase = Phase::Failed;
                s.error = Some(e.to_string());
            });
            back?;
            Err(e)
        }
    }
}

struct Run<'a> {
    vm: &'a VmLink,
    params: &'a Params,
    status: &'a Mutex<Status>,
    cancel: &'a AtomicBool,
    /// Where the work may stop for the device loop (`--mode inline`).
    slicer: &'a Slicer<'a>,
    started: Instant,
    sent: Sent,
    throttle: u8,
    /// When the stop-and-copy paused the VM.
    paused_at: Option<Instant>,
    /// Whether the disks' locks were released for the destination.
    released_disks: bool,
    /// COLO's initial sync: the guest stays and runs here after `Go`.
    keep: bool,
    /// Set by `migrate-postcopy` (none: COLO's initial sync, never).
    switch: Option<&'a AtomicBool>,
    /// Switched to post-copy: the guest ran at the destination since.
    switched: bool,
    /// The downtime, when it ended before the migration did (post-copy).
    downtime: Option<Duration>,
}

impl<'a> Run<'a> {
    /// A run that starts now; `keep`: COLO's initial sync.
    fn new(
        vm: &'a VmLink,
        params: &'a Params,
        status: &'a Mutex<Status>,
        cancel: &'a AtomicBool,
        slicer: &'a Slicer<'a>,
        keep: bool,
    ) -> Run<'a> {
        Run {
            vm,
            params,
            status,
            cancel,
            slicer,
            started: Instant::now(),
            sent: Sent::default(),
            throttle: 0,
            paused_at: None,
            released_disks: false,
            keep,
            switch: None,
            switched: false,
            downtime: None,
        }
    }

    fn update(&self, f: impl FnOnce(&mut Status)) {
        f(&mut devices::sync::lock(self.status));
    }

    fn check_going(&self) -> Result<(), MigrateError> {
        pre_copy_stop(self, &|_| {}).check()
    }

    /// The whole migration, up to and including `Go`; returns the stream
    /// (COLO's goes on).
    fn go(&mut self, to: &Endpoint) -> Result<Conn, MigrateError> {
        let mut conn = self
            .vm
            .transport()
            .connect(to, IO_TIMEOUT)
            .map_err(|e| MigrateError::Connect(to.to_string(), e))?;
        conn.set_timeouts(IO_TIMEOUT)
            .map_err(MigrateError::Stream)?;
        protocol::write_message(
            &mut conn,
            &Message::Hello {
                version: protocol::VERSION,
            },
        )?;
        protocol::write_message(&mut conn, &Message::Config(self.vm.manifest().clone()))?;
        protocol::expect(&mut conn, Command::Accept)?;
        match self.transfer(to, &mut conn) {
            Ok(()) => Ok(conn),
            Err(e) => {
                // Tell the destination why, where the stream still takes
                // it (a short wait: it may be what failed).
                let _ = conn.set_timeouts(ABANDON_WAIT);
                let _ = protocol::write_message(&mut conn, &Message::Abandon(e.to_string()));
                Err(e)
            }
        }
    }

    /// Everything after the handshake, up to and including `Go`.
    fn transfer(&mut self, to: &Endpoint, conn: &mut Conn) -> Result<(), MigrateError> {
        let n = self.params.connections;
        let mut others = lanes::open(self.vm.transport(), to, conn, n, IO_TIMEOUT)?;
        self.update(|s| {
            s.setup_ms = self.started.elapsed().as_secs_f64() * 1000.0;
            s.phase = Phase::PreCopy;
        });
        let ram = self.vm.ram();
        let t = Instant::now();
        let all_dirty = if self.params.initially_set {
            ram.start_dirty_log_all_dirty()?
        } else {
            ram.start_dirty_log().map(|()| false)?
        };
        self.update(|s| {
            s.log_start_ms = t.elapsed().as_secs_f64() * 1000.0;
            s.log_all_dirty = all_dirty;
        });
        self.send_round(conn, &mut others, Work::All, false)?;
        self.round_done(0);
        match self.precopy(conn, &mut others)? {
            End::Copy(pending) => self.stop_and_copy(conn, &mut others, pending)?,
            End::Postcopy(pending) => return self.postcopy(conn, &mut others, pending),
        }
        protocol::write_message(conn, &Message::Go)?;
        if self.keep && self.paused_at.is_some() {
            self.vm.resume()?;
        }
        Ok(())
    }

    /// One round's pages: on the one stream (sliced in `--mode inline`),
    /// or spread over the streams, each its share on its own thread. The
    /// stop-and-copy's (`last`) is neither capped, cut short nor sliced
    /// (QEMU too flushes its last round regardless of its rate limit; the
    /// estimate that chose the moment used the capped rate, so the
    /// downtime only gets shorter).
    fn send_round(
        &mut self,
        conn: &mut Conn,
        others: &mut [Conn],
        work: Work,
        last: bool,
    ) -> Result<(), MigrateError> {
        let progress = progress_to(self.status);
        let uncapped = Params {
            bandwidth_mib: None,
            ..self.params.clone()
        };
        let params = if last { &uncapped } else { self.params };
        let until = (!last).then(|| deadline(self));
        let ram = self.vm.ram();
        if others.is_empty() {
            let unsliced = Slicer::thread();
            let stop = Stop {
                cancel: self.cancel,
                others_failed: None,
                progress: &progress,
                until,
                slicer: if last { &unsliced } else { self.slicer },
            };
            let (whole, sent) = (Share::WHOLE, &mut self.sent);
            return match work {
                Work::All => pages::send_all(ram, conn, params, whole, sent, &stop),
                Work::Dirty(d) => pages::send_dirty(ram, conn, d, params, whole, sent, &stop),
            };
        }
        let round = lanes::Round {
            ram,
            params,
            cancel: self.cancel,
            until,
            progress: &progress,
            commit: last,
        };
        lanes::send(&round, conn, others, work, &mut self.sent)
    }

    /// Rounds while the last dirty set would take longer than the downtime
    /// budget to send, and then while they still shrink the set (see
    /// [`stop_and_copy_now`]); returns the set left for the stop-and-copy.
    ///
    /// At each look (a harvest of the dirty log) the window since the last
    /// look gives the guest's dirty rate and what was sent meanwhile; from
    /// the second look on, auto-converge takes a throttle step (one per
    /// whole second of the window) when the guest dirtied more than half of
    /// what was sent in that window (see [`next_throttle`]).
    fn precopy(&mut self, conn: &mut Conn, others: &mut [Conn]) -> Result<End, MigrateError> {
        let ram = self.vm.ram();
        let mut round = 1;
        let (mut last_look, mut sent_at_look) = (self.started, self.sent.bytes());
        let (mut last_set, mut shrink_rounds) = (None, 0);
        loop {
            self.check_going()?;
            self.slicer.point();
            let dirty = ram.dirty_pages()?;
            let bytes: u64 = dirty.iter().map(|d| d.count()).sum::<u64>() * protocol::PAGE_SIZE;
            let rate = self.sent.rate(self.started);
            let estimate_ms = if rate > 0.0 {
                bytes as f64 / rate * 1000.0
            } else {
                f64::INFINITY
            };
            // What the guest dirtied, and what went out, since the last look.
            let window = last_look.elapsed().as_secs_f64().max(1e-3);
            let dirty_rate = bytes as f64 / window;
            let sent_rate = (self.sent.bytes() - sent_at_look) as f64 / window;
            (last_look, sent_at_look) = (Instant::now(), self.sent.bytes());
            self.update(|s| {
                s.remaining_bytes = bytes;
                s.expected_downtime_ms = estimate_ms;
                s.dirty_rate_mib = dirty_rate / f64::from(1 << 20);
            });
            // Not converging ends at the time limit (check_going), never in
            // a stop-and-copy over the budget.
            let within = estimate_ms <= self.params.downtime_ms as f64;
            if stop_and_copy_now(within, bytes, last_set, shrink_rounds) {
                return Ok(End::Copy(dirty));
            }
            if self.postcopy_now(round, bytes, last_set) {
                return Ok(End::Postcopy(dirty));
            }
            if within {
                shrink_rounds += 1;
            } else if round > 1 {
                self.converge(dirty_rate, sent_rate, window)?;
            }
            last_set = Some(bytes);
            self.send_round(conn, others, Work::Dirty(&dirty), false)?;
            self.round_done(round);
            round += 1;
        }
    }

    /// Auto-converge: throttle steps when [`next_throttle`] says so.
    fn converge(
        &mut self,
        dirty_rate: f64,
        sent_rate: f64,
        window_s: f64,
    ) -> Result<(), MigrateError> {
        if !self.params.auto_converge {
            return Ok(());
        }
        let Some(t) = next_throttle(self.throttle, dirty_rate, sent_rate, window_s) else {
            return Ok(());
        };
        self.throttle = t;
        self.vm.throttle(t)?;
        self.update(|s| s.throttle = t);
        Ok(())
    }

    fn round_done(&self, round: u32) {
        let (pages, bytes, zero) = (self.sent.pages(), self.sent.bytes(), self.sent.zero_pages());
        let rate = self.sent.rate(self.started) / f64::from(1 << 20);
        self.update(|s| {
            s.round = round;
            s.rounds.push(pages - s.rounds.iter().sum::<u64>());
            s.sent_bytes = bytes;
            s.pages = pages;
            s.zero_pages = zero;
            s.send_rate_mib = rate;
        });
    }

    /// Pauses the VM, sends the last dirty pages and the state, and waits
    /// for the destination to say it holds the guest.
    fn stop_and_copy(
        &mut self,
        conn: &mut Conn,
        others: &mut [Conn],
        pending: Vec<crate::vstate::memory::DirtyBitmap>,
    ) -> Result<(), MigrateError> {
        let mut parts = DowntimeParts::default();
        let mut laps = Laps(Instant::now());
        let last = self.pause_for_switch(&pending, &mut parts, &mut laps)?;
        // The cap protects the network while the guest runs; with the guest
        // paused the last pages go as fast as the streams take them.
        self.send_round(conn, others, Work::Dirty(&last), true)?;
        laps.lap(&mut parts.pages_ms);
        self.hand_over(conn, &mut parts, &mut laps)?;
        let round = devices::sync::lock(self.status).round + 1;
        self.round_done(round);
        self.update(|s| s.downtime_parts = Some(parts));
        Ok(())
    }

    /// The switch-over's start (stop-and-copy or post-copy): the disks
    /// flushed while the guest runs, the guest paused (its time into
    /// `parts`), and the last dirty set: KVM's log OR `pending`.
    fn pause_for_switch(
        &mut self,
        pending: &[crate::vstate::memory::DirtyBitmap],
        parts: &mut DowntimeParts,
        laps: &mut Laps,
    ) -> Result<Vec<crate::vstate::memory::DirtyBitmap>, MigrateError> {
        self.check_going()?;
        // The device loop must reach its gate.
        self.slicer.release();
        // While the guest runs: the flush in the downtime is then short.
        self.vm.flush_disks()?;
        self.update(|s| s.phase = Phase::StopAndCopy);
        laps.0 = Instant::now();
        // A VM the user had paused stays as it is (and is not resumed on
        // failure).
        if !self.vm.is_paused() {
            self.paused_at = Some(Instant::now());
            self.vm.pause()?;
        }
        laps.lap(&mut parts.pause_ms);
        let mut last = self.vm.ram().dirty_pages()?;
        for (l, p) in last.iter_mut().zip(pending) {
            crate::vstate::memory::or_into(&mut l.bits, &p.bits);
        }
        Ok(last)
    }

    /// The switch-over's end, the guest paused and its pages sent: the
    /// state goes, the disks' locks are let go (the destination takes
    /// them when the state arrives: one VM at a time holds an image; a
    /// COLO primary keeps them), and the destination says it is `Ready`.
    /// Each step's time into `parts`.
    fn hand_over(
        &mut self,
        conn: &mut Conn,
        parts: &mut DowntimeParts,
        laps: &mut Laps,
    ) -> Result<(), MigrateError> {
        let image = crate::snapshot::state_image(&self.vm.capture_state()?)?;
        laps.lap(&mut parts.state_ms);
        if !self.keep {
            self.vm.hold_disk_locks(false)?;
            self.released_disks = true;
        }
        laps.lap(&mut parts.disks_ms);
        protocol::write_message(conn, &Message::State(image))?;
        protocol::expect(conn, Command::Ready)?;
        laps.lap(&mut parts.handover_ms);
        Ok(())
    }

    /// After a failure: the guest runs here again, as before (unless it
    /// switched to post-copy: then it ran there since, and stays paused).
    fn roll_back(&mut self) -> Result<(), MigrateError> {
        self.slicer.release();
        if self.switched {
            return Ok(());
        }
        let ram = self.vm.ram();
        let log = ram.stop_dirty_log();
        let throttle = if self.throttle > 0 {
            self.vm.throttle(0)
        } else {
            Ok(())
        };
        // The destination that took the locks has given them up (it
        // refused, or its process ended).
        let disks = if self.released_disks {
            self.vm.hold_disk_locks(true)
        } else {
            Ok(())
        };
        if self.paused_at.is_some() && self.vm.is_paused() {
            self.vm.resume()?;
        }
        disks?;
        log?;
        throttle?;
        Ok(())
    }
}

/// Times the downtime's steps, one after the other.
struct Laps(Instant);

impl Laps {
    /// The time since the last lap, ms, into `into`.
    fn lap(&mut self, into: &mut f64) {
        *into = self.0.elapsed().as_secs_f64() * 1000.0;
        self.0 = Instant::now();
    }
}

/// How the pre-copy ended: the last dirty set goes in a stop-and-copy,
/// or the destination fetches it in post-copy.
enum End {
    Copy(Vec<crate::vstate::memory::DirtyBitmap>),
    Postcopy(Vec<crate::vstate::memory::DirtyBitmap>),
}

/// The throttle after a look at which, over the `window_s` seconds since
/// the last look, the guest dirtied `dirty_rate` bytes/s while `sent_rate`
/// bytes/s went out: when dirtying outpaced half of sending, one step up
/// (QEMU's defaults: 20 %, then +10 %, at most 99 %) for each whole second
/// of the window (at least one), else `None` (the throttle stays).
///
/// QEMU steps once per pass over memory. On a slow link a pass takes many
/// seconds, and a guest that outpaced it for all of them would otherwise
/// reach a throttle that can converge only after many such passes (512 MiB
/// dirtying at 16 MiB/s: 70 % after 120 s, not converged).
fn next_throttle(current: u8, dirty_rate: f64, sent_rate: f64, window_s: f64) -> Option<u8> {
    if dirty_rate <= sent_rate * 0.5 || current >= THROTTLE_MAX {
        return None;
    }
    // At most as many steps as it takes from none to the ceiling.
    let steps = window_s.floor().clamp(1.0, 10.0) as u8;
    let mut t = current;
    for _ in 0..steps {
        t = match t {
            0 => THROTTLE_FIRST,
            t => t.saturating_add(THROTTLE_STEP).min(THROTTLE_MAX),
        };
    }
    Some(t)
}

/// Whether the pre-copy ends now, at a look that found `bytes` dirty
/// (`within`: they fit the downtime budget at the measured send rate),
/// after `shrink_rounds` rounds sent within the budget, the last of them
/// sending `last_set` bytes.
///
/// The budget is a ceiling, not a target: the guest stops for the whole
/// downtime on top of whatever it was doing, so a set that fits is sent
/// while the guest runs for as long as each such round at least halves it
/// (a guest dirtying under half the send rate), up to
/// [`MAX_SHRINK_ROUNDS`], unless it is already [`SMALL_SET_BYTES`] or less.
fn stop_and_copy_now(within: bool, bytes: u64, last_set: Option<u64>, shrink_rounds: u32) -> bool {
    if !within {
        return false;
    }
    if bytes <= SMALL_SET_BYTES || shrink_rounds >= MAX_SHRINK_ROUNDS {
        return true;
    }
    match last_set {
        Some(last) if shrink_rounds > 0 => bytes.saturating_mul(2) > last,
        _ => false,
    }
}

/// The pre-copy's time limit, and its value in seconds.
fn deadline(run: &Run) -> (Instant, u64) {
    let limit = Duration::from_secs(run.params.timeout_s);
    (run.started + limit, run.params.timeout_s)
}

/// Cancel, time limit and slices, for the pre-copy.
fn pre_copy_stop<'s>(run: &Run<'s>, progress: &'s dyn Fn(&Sent)) -> Stop<'s> {
    Stop {
        cancel: run.cancel,
        others_failed: None,
        progress,
        until: Some(deadline(run)),
        slicer: run.slicer,
    }
}

/// What has been sent, into the status (after each batch).
fn progress_to(status: &Mutex<Status>) -> impl Fn(&Sent) + '_ {
    move |sent: &Sent| {
        let mut s = devices::sync::lock(status);
        s.sent_bytes = sent.bytes();
        s.pages = sent.pages();
        s.zero_pages = sent.zero_pages();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: f64 = (1 << 20) as f64;

    #[test]
    fn a_set_within_the_budget_is_shrunk_while_rounds_halve_it() {
        const MIB: u64 = 1 << 20;
        // Over the budget: always another round.
        assert!(!stop_and_copy_now(false, MIB / 2, None, 0));
        assert!(!stop_and_copy_now(false, 40 * MIB, Some(80 * MIB), 9));
        // A small set goes at once (an idle guest).
        assert!(stop_and_copy_now(true, MIB, None, 0));
        // The first fit: one more round.
        assert!(!stop_and_copy_now(true, 40 * MIB, Some(120 * MIB), 0));
        // It halved: again; it did not: stop.
        assert!(!stop_and_copy_now(true, 15 * MIB, Some(40 * MIB), 1));
        assert!(!stop_and_copy_now(true, 20 * MIB, Some(40 * MIB), 1));
        assert!(stop_and_copy_now(true, 21 * MIB, Some(40 * MIB), 1));
        // Never more than MAX_SHRINK_ROUNDS of them.
        assert!(stop_and_copy_now(
            true,
            2 * MIB,
            Some(8 * MIB),
            MAX_SHRINK_ROUNDS
        ));
    }

    #[test]
    fn the_throttle_steps_only_when_dirtying_outpaces_half_the_sending() {
        // 52 MiB/s dirtied while 128 MiB/s went out: more than half? no.
        assert_eq!(next_throttle(0, 52.0 * MIB, 128.0 * MIB, 0.5), None);
        assert_eq!(next_throttle(0, 64.0 * MIB, 128.0 * MIB, 0.5), None);
        assert_eq!(next_throttle(0, 65.0 * MIB, 128.0 * MIB, 0.5), Some(20));
        assert_eq!(next_throttle(20, 200.0 * MIB, 128.0 * MIB, 0.5), Some(30));
        assert_eq!(next_throttle(90, 200.0 * MIB, 128.0 * MIB, 0.5), Some(99));
        assert_eq!(next_throttle(99, 200.0 * MIB, 128.0 * MIB, 0.5), None);
        // Nothing went out in the window (a stalled stream): any dirtying
        // outpaces it.
        assert_eq!(next_throttle(0, 1.0, 0.0, 0.5), Some(20));
        assert_eq!(next_throttle(0, 0.0, 0.0, 0.5), None);
    }

    #[test]
    fn a_long_window_takes_a_step_per_second() {
        // A look 1.9 s after the last: one step; 3.2 s: three.
        assert_eq!(next_throttle(0, 16.0 * MIB, 16.0 * MIB, 1.9), Some(20));
        assert_eq!(next_throttle(20, 16.0 * MIB, 16.0 * MIB, 3.2), Some(50));
        // A 16 s pass on a slow link: to the ceiling, never past it.
        assert_eq!(next_throttle(0, 16.0 * MIB, 16.0 * MIB, 16.0), Some(99));
        assert_eq!(next_throttle(70, 16.0 * MIB, 16.0 * MIB, 60.0), Some(99));
        // Not outpacing: no step however long the window.
        assert_eq!(next_throttle(20, 4.0 * MIB, 16.0 * MIB, 16.0), None);
    }
}

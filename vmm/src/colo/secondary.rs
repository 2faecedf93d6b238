//! The COLO secondary (`tandem run --colo secondary --colo-listen ADDR`):
//! after the initial sync (an incoming migration), it runs on the
//! `incoming` thread: answers heartbeats, applies whole checkpoints, and
//! when the primary is lost takes over under the lease, or retires.
//!
//! Its guest runs from the last checkpoint with its NICs detached (it
//! neither reads nor writes its taps) and its writable disks replicas
//! ([`super::replica`]): the primary's forwarded writes are journaled as
//! they come and applied at each commit, its own guest's writes live in an
//! overlay until then. The pages the primary sends ahead of a checkpoint
//! while both guests run are held with it. A checkpoint is buffered whole, each
//! batch checked against this VM's layout and the total bounded by its
//! memory size, and applied only at `Commit`; one that does not arrive
//! whole is dropped, and the guest goes on from its own state (the pages it
//! wrote stay owed to the next checkpoint). At takeover its disks' overlays
//! go into their images (the journal since the last commit is dropped),
//! its taps are attached and its MAC announced.
//!
//! Never does: serve (attach a tap) without holding the lease, or when the
//! lease's alone mark says the primary served past this side's last
//! checkpoint (it retires then: the VMM ends with status 1); apply part of
//! a checkpoint.

use std::sync::Arc;
use std::time::{Duration, Instant};

use migration::protocol::colo::DiskWrite;
use migration::protocol::{self, Command, Message, ProtocolError};
use replication::arbiter::Arbiter;
use replication::failover::{Action, Failover, Role, State};

use super::arbiter::{ArbiterSpec, Fence};
use super::proxy::{Cmd, Proxy};
use super::replica::{self, Replica};
use super::survivor::Survivor;
use super::{dirty, failover_config, incoming, ColoError, Report, Side};
use crate::boot::layout;
use crate::migrate::VmLink;
use crate::streams::endpoint::{Conn, Listener};
use crate::streams::Endpoint;
use crate::streams::Transport;
use crate::vm::VmHandle;
use crate::vstate::exit::VmExit;
use crate::vstate::memory::DirtyBitmap;
use devices::virtio::net::datagram::Datagram;

/// How long a NIC's backend swap, the link and a proxy's command may take.
const PROXY_WAIT: Duration = Duration::from_secs(5);
/// How long a takeover waits for the device loop to attach a tap.
const ATTACH_WAIT: Duration = Duration::from_secs(5);
/// The turn while waiting for the lease, and while serving.
const TURN: Duration = Duration::from_millis(50);
/// How often a fenced side asks the arbiter who holds the lease.
const ASK_EVERY: Duration = Duration::from_millis(500);

/// The secondary's side before the primary connects (what `colo_status`
/// shows while it waits).
pub fn side(from: &Endpoint, arbiter: &ArbiterSpec, transport: &'static str) -> Arc<Side> {
    Arc::new(Side::new(Report::new(
        Role::Secondary,
        from.to_string(),
        arbiter.to_string(),
        transport,
    )))
}

/// What the incoming thread runs once the initial sync is done.
/// `transport`: the streams this side opens once it serves alone (a
/// re-protect).
pub fn then(
    side: Arc<Side>,
    arbiter: ArbiterSpec,
    transport: Arc<Transport>,
) -> crate::migrate::dest::Then {
    Box::new(move |vm: &VmHandle, conn: Conn, listener: &Listener| {
        let link = VmLink {
            vm: vm.clone(),
            transport: transport.clone(),
        };
        if let Err(e) = serve(&link, conn, listener, &side, &arbiter) {
            let why = format!("the pair did not start: {e}");
            side.update(|r| {
                r.state = State::Retired;
                r.reason = Some(why.clone());
            });
            vm.exit().signal(VmExit::Retired(why));
        }
    })
}

/// Why the replication loop ended.
enum Ended {
    Lost(String),
    Forced(Vec<Action>),
    Stopped,
}

/// The pair's start on this side: the dirty log on and the guest running
/// (as the sync left it), then the primary's `Protect` and disk sums
/// checked against this side's; returns the pair's timing.
fn accept_pair(
    vm: &VmLink,
    conn: &mut Conn,
) -> Result<migration::protocol::colo::Timing, ColoError> {
    // The guest is still paused as the sync left it: from here on every
    // page it writes is seen, and owed to the primary at the next
    // checkpoint. (Had it run before, a page it wrote and the primary did
    // not would keep this guest's version past every checkpoint.)
    let ram = vm.ram();
    ram.start_dirty_log()?;
    // Both logs start empty here; should the log have been on already (a
    // `dirty-log start` from the API), what it holds is not the guest's
    // own since the sync: drop it.
    ram.dirty_pages()?;
    ram.clear_all()?;
    vm.resume()?;
    let Message::Protect(t) = protocol::expect(conn, Command::Protect)? else {
        return Err(ColoError::Missing("Protect"));
    };
    let Message::Disks(theirs) = protocol::expect(conn, Command::Disks)? else {
        return Err(ColoError::Missing("Disks"));
    };
    let ours = super::disks::sums(vm.manifest())?;
    if let Some(why) = super::disks::differ(&theirs, &ours, vm.manifest()) {
        let _ = protocol::write_message(conn, &Message::Abandon(why.clone()));
        return Err(ColoError::DisksDiffer(why));
    }
    protocol::write_message(conn, &Message::Accept)?;
    Ok(t)
}

fn serve(
    vm: &VmLink,
    mut conn: Conn,
    listener: &Listener,
    side: &Arc<Side>,
    arbiter: &ArbiterSpec,
) -> Result<(), ColoError> {
    let t = accept_pair(vm, &mut conn)?;
    let ram = vm.ram();
    let id = format!("secondary pid {}", std::process::id());
    let mut lease = arbiter.open(&id)?;
    let fence = Fence::new(lease.gate());
    let proxy = start_proxy(vm, listener, side.clone(), fence.clone())?;
    let channels = super::channels::accept(listener, t.channels, PROXY_WAIT)?;
    let timeout = Duration::from_millis(u64::from(t.timeout_ms));
    conn.set_timeouts(timeout).map_err(ColoError::Stream)?;
    side.update(|r| {
        r.heartbeat_ms = t.heartbeat_ms;
        r.heartbeat_timeout_ms = t.timeout_ms;
        r.channels = t.channels;
    });
    // What its guest wrote since it resumed: owed at the first checkpoint.
    let owed = ram.dirty_pages()?;
    let mut fo = Failover::secondary(
        failover_config(t.heartbeat_ms, t.timeout_ms),
        Instant::now(),
    );
    let mut rx = Receiver {
        vm,
        side,
        owed,
        layout: layout::ram_ranges(vm.manifest().mem_bytes),
        limit: vm.manifest().mem_bytes / protocol::PAGE_SIZE,
        proxy: Some(proxy),
        replicas: replica::of(vm),
        channels,
        staged: incoming::Staged::default(),
    };
    let actions = match rx.replicate(&mut conn, &mut fo, &mut *lease) {
        Ended::Stopped => return Ok(()),
        Ended::Forced(actions) => {
            // The primary heard from this side until then: it may release
            // output for up to its heartbeat timeout after (its peer gate).
            if let Some(at) = side.heard_at() {
                std::thread::sleep((at + timeout).saturating_duration_since(Instant::now()));
            }
            actions
        }
        Ended::Lost(why) => {
            log::warn!("COLO: the primary is lost: {why}");
            fo.connection_lost(&mut *lease)
        }
    };
    conn.shutdown();
    if let Err(e) = ram.stop_dirty_log() {
        log::warn!("COLO: dirty log not stopped: {e}");
    }
    // The proxy stays for a takeover (its offsets).
    let mut proxy = rx.proxy.take();
    let mut end = After {
        vm,
        side,
        fence,
        asked: Instant::now(),
    };
    end.run(&mut fo, &mut *lease, &mut proxy, actions);
    Ok(())
}

/// After the pair: carries out the state machine's decisions, and holds
/// the lease (and the proxy, if it serves through it) while this VM
/// serves; a fenced side ends as soon as the arbiter answers again.
struct After<'a> {
    vm: &'a VmLink,
    side: &'a Arc<Side>,
    fence: Fence,
    /// When a fenced side last asked the arbiter.
    asked: Instant,
}

impl After<'_> {
    fn run(
        &mut self,
        fo: &mut Failover,
        lease: &mut dyn Arbiter,
        proxy: &mut Option<Proxy>,
        mut actions: Vec<Action>,
    ) {
        let vm = self.vm;
        loop {
            for a in std::mem::take(&mut actions) {
                match a {
                    Action::TakeOver => match take_over(vm, proxy) {
                        Ok(()) => {
                            let _ = fo.takeover_complete();
                            eprintln!(
                                "tandem: COLO: failover: this VM serves now, from checkpoint \
                                 {} ({})",
                                fo.epoch(),
                                fo.status(Instant::now()).reason.unwrap_or_default()
                            );
                            crate::migrate::dest::announce(vm);
                        }
                        Err(e) => actions.extend(fo.takeover_failed(&e, lease)),
                    },
                    Action::Retire(why) => {
                        *proxy = None;
                        report(vm, self.side, fo, lease);
                        vm.exit().signal(VmExit::Retired(why));
                        return;
                    }
                    Action::Fence => {
                        self.fence.shut();
                        let why = fo.status(Instant::now()).reason.unwrap_or_default();
                        eprintln!("tandem: COLO: fenced, the guest is paused: {why}");
                        if let Err(e) = vm.pause() {
                            log::error!("COLO: cannot pause the fenced guest: {e}");
                        }
                    }
                    Action::SendHeartbeat | Action::StopReplication | Action::GoAlone => {}
                }
            }
            report(vm, self.side, fo, lease);
            if fo.state() == State::FailedOver {
                // It serves: from now on, as any side that serves alone.
                let fence = self.fence.clone();
                Survivor::with(vm, self.side.clone(), fo.clone(), fence, proxy.take()).run(lease);
                return;
            }
            if Side::take(&self.side.stop) {
                return;
            }
            if fo.state() == State::Fenced && self.asked.elapsed() >= ASK_EVERY {
                self.asked = Instant::now();
                if let Some(why) = super::arbiter::lost(lease) {
                    *proxy = None;
                    vm.exit().signal(VmExit::Fenced(why));
                    return;
                }
            }
            std::thread::sleep(TURN);
            actions = fo.tick(Instant::now(), lease);
        }
    }
}

fn report(vm: &VmHandle, side: &Side, fo: &Failover, lease: &dyn Arbiter) {
    let s = fo.status(Instant::now());
    let info = lease.describe();
    let disks = replica::of(vm)
        .iter()
        .flatten()
        .map(|d| d.stats())
        .collect();
    side.update(|r| {
        r.state = s.state;
        r.epoch = s.epoch;
        r.reason = s.reason;
        r.disks = disks;
        r.lease = Some(info);
    });
}

/// The network link from the primary (its second connection) and the
/// proxy on it: each NIC moves from its detached backend to a datagram
/// backend whose other end the proxy holds.
fn start_proxy(
    vm: &VmHandle,
    listener: &Listener,
    side: Arc<Side>,
    fence: Fence,
) -> Result<Proxy, ColoError> {
    let mut link = listener
        .accept_within(PROXY_WAIT)
        .map_err(ColoError::io("no network link from the primary"))?;
    link.set_timeouts(PROXY_WAIT).map_err(ColoError::Stream)?;
    let hello = protocol::read_message(&mut link)?;
    protocol::check_hello(&hello)?;
    let mut guests = Vec::new();
    for slot in vm.virtio().iter() {
        let Some(tap) = slot.tap() else { continue };
        let (backend, other) = Datagram::pair(tap).map_err(ColoError::Stream)?;
        if let Some(r) = slot.swap_backend(Box::new(backend), PROXY_WAIT) {
            r.map_err(ColoError::NicSwap)?;
            guests.push(other);
        }
    }
    Proxy::secondary(guests, link, side, fence).map_err(ColoError::Stream)
}

/// The takeover: every disk's overlay in its image (the uncommitted
/// journal dropped), locked; the NICs on their taps, through the proxy
/// when it holds offsets (connections opened since the last checkpoint),
/// else directly (and the proxy ends).
fn take_over(vm: &VmHandle, proxy: &mut Option<Proxy>) -> Result<(), String> {
    for r in replica::of(vm).iter().flatten() {
        r.take_over().map_err(|e| format!("disk: {e}"))?;
    }
    vm.hold_disk_locks(true).map_err(|e| e.to_string())?;
    if let Some(p) = proxy.as_ref().filter(|p| p.offsets() > 0) {
        let n = p.offsets();
        match serve_through(vm, p) {
            Ok(()) => {
                eprintln!(
                    "tandem: COLO: {n} connection(s) opened since the last checkpoint keep \
                     their sequence numbers (rewritten)"
                );
                return Ok(());
            }
            Err(e) => log::warn!("COLO: the proxy does not serve ({e}); {n} connection(s) break"),
        }
    }
    *proxy = None;
    for slot in vm.virtio().iter() {
        if let Some(r) = slot.attach_tap(ATTACH_WAIT) {
            r?;
        }
    }
    Ok(())
}

/// A write of the primary's guest: into its disk's journal. A disk this
/// VM does not replicate, or a full journal, ends the pair (the next
/// checkpoint could not be whole).
fn journal(replicas: &[Option<Arc<Replica>>], w: &DiskWrite) -> Result<(), ColoError> {
    let r = usize::try_from(w.disk)
        .ok()
        .and_then(|i| replicas.get(i))
        .and_then(Option::as_ref)
        .ok_or(ColoError::NotReplicated(w.disk))?;
    r.journal(w.offset, &w.data)
        .map_err(|source| ColoError::Journal {
            disk: u64::from(w.disk),
            source,
        })
}

/// Hands each NIC's tap to the proxy, which serves between them.
fn serve_through(vm: &VmHandle, proxy: &Proxy) -> Result<(), String> {
    let taps = vm
        .virtio()
        .iter()
        .filter_map(|slot| slot.open_tap())
        .collect::<Result<Vec<_>, String>>()?;
    if proxy.call(Cmd::Serve(taps), PROXY_WAIT) {
        Ok(())
    } else {
        Err("it did not answer".into())
    }
}

struct Receiver<'a> {
    vm: &'a VmHandle,
    side: &'a Side,
    /// The pages this guest wrote since the last committed checkpoint.
    owed: Vec<DirtyBitmap>,
    layout: Vec<(u64, u64)>,
    /// Pages a checkpoint may carry at most: the guest's.
    limit: u64,
    proxy: Option<Proxy>,
    /// The disks, indexed as the primary's `DiskWrite`s are.
    replicas: Vec<Option<Arc<Replica>>>,
    /// The page channels (none: the pages come on the stream).
    channels: Vec<Conn>,
    /// The pages the primary sent ahead of the next checkpoint.
    staged: incoming::Staged,
}

impl Receiver<'_> {
    /// Heartbeats and checkpoints until the primary is lost, a failover is
    /// forced (and the lease allows it), or the VMM ends.
    fn replicate(&mut self, conn: &mut Conn, fo: &mut Failover, lease: &mut dyn Arbiter) -> Ended {
        loop {
            if Side::take(&self.side.stop) {
                return Ended::Stopped;
            }
            if Side::take(&self.side.failover) {
                match fo.force_failover(lease) {
                    Ok(actions) => return Ended::Forced(actions),
                    Err(e) => log::warn!("COLO: failover not forced: {e}"),
                }
            }
            let m = match protocol::read_message(conn) {
                Ok(m) => m,
                Err(ProtocolError::Io(e)) => return Ended::Lost(format!("stream: {e}")),
                Err(e) => return Ended::Lost(e.to_string()),
            };
            let now = Instant::now();
            fo.heartbeat_received(now);
            self.side.heard(now);
            let done = match m {
                Message::Heartbeat => {
                    protocol::write_message(conn, &Message::Heartbeat).map_err(ColoError::from)
                }
                Message::Checkpoint { epoch } => self.checkpoint(conn, fo, epoch),
                Message::DiskWrite(w) => journal(&self.replicas, &w),
                Message::Memory(b) => self.staged.push(b, &self.layout, self.limit),
                other => Err(ColoError::Unexpected {
                    got: other.command().name(),
                    place: "from the primary",
                }),
            };
            if let Err(e) = done {
                return Ended::Lost(e.to_string());
            }
            report(self.vm, self.side, fo, lease);
        }
    }

    fn checkpoint(
        &mut self,
        conn: &mut Conn,
        fo: &mut Failover,
        epoch: u64,
    ) -> Result<(), ColoError> {
        let vm = self.vm;
        let was_paused = vm.is_paused();
        if !was_paused {
            vm.pause()?;
        }
        let got = self.receive(conn);
        if got.is_ok() {
            if let Some(p) = &self.proxy {
                // Paused, a copy of the primary: its guest's older frames go.
                if !p.call(Cmd::Committed(epoch, None), PROXY_WAIT) {
                    log::error!("COLO: the network proxy did not take checkpoint {epoch}");
                }
            }
        }
        let resumed = if was_paused { Ok(()) } else { vm.resume() };
        match got {
            Ok(pages) => {
                self.side.update(|r| r.applied_pages += pages);
                fo.checkpoint_committed(epoch)?;
            }
            Err(e) => {
                self.side.update(|r| r.dropped_checkpoints += 1);
                return Err(e);
            }
        }
        resumed?;
        Ok(())
    }

    /// One checkpoint, whole and checked, behind the pages sent ahead of
    /// it: from the stream, and from the page channels at once if there
    /// are any (the stream then carries no pages but those sent ahead).
    fn read(&mut self, conn: &mut Conn) -> Result<incoming::Checkpoint, ColoError> {
        let mut staged = std::mem::take(&mut self.staged);
        let mut c = self.read_own(conn)?;
        staged.prepend_to(&mut c);
        Ok(c)
    }

    /// The checkpoint's own messages (after `Dirty`).
    fn read_own(&mut self, conn: &mut Conn) -> Result<incoming::Checkpoint, ColoError> {
        let replicas = &self.replicas;
        let mut journal = |w: &DiskWrite| journal(replicas, w);
        let (layout, limit, manifest) = (&self.layout, self.limit, self.vm.manifest());
        if self.channels.is_empty() {
            return incoming::read_checkpoint(conn, layout, limit, manifest, &mut journal);
        }
        let channels = &mut self.channels;
        let (main, pages) = std::thread::scope(|s| {
            let pages = s.spawn(|| super::channels::receive(channels, layout, limit));
            let main = incoming::read_checkpoint(conn, layout, 0, manifest, &mut journal);
            (main, pages.join())
        });
        let (batches, n) =
            pages.map_err(|_| ColoError::Panicked("the page channels' thread"))??;
        let mut c = main?;
        c.batches.extend(batches);
        c.pages = c.pages.saturating_add(n);
        Ok(c)
    }

    /// With the guest paused: what it wrote goes to the primary, the
    /// checkpoint comes back whole and is applied. Returns its pages.
    fn receive(&mut self, conn: &mut Conn) -> Result<u64, ColoError> {
        let ram = self.vm.ram();
        let mine = ram.dirty_pages()?;
        ram.clear_all()?;
        dirty::or(&mut self.owed, &mine);
        protocol::write_message(conn, &Message::Dirty(dirty::spans(&self.owed)))?;
        let c = self.read(conn)?;
        let vm = self.vm;
        // Whole and checked: now it is applied.
        incoming::write_pages(vm.memory(), &c)?;
        vm.apply_state(&c.state)?;
        // Its guest is the primary's: so is its disk (its own writes go).
        for (i, r) in self.replicas.iter().enumerate() {
            if let Some(r) = r {
                r.commit().map_err(|source| ColoError::Journal {
                    disk: i as u64,
                    source,
                })?;
            }
        }
        // The pages just written are the primary's, not this guest's.
        ram.dirty_pages()?;
        ram.clear_all()?;
        dirty::clear(&mut self.owed);
        protocol::write_message(conn, &Message::Committed)?;
        Ok(c.pages)
    }
}

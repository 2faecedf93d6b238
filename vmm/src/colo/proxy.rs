//! The pair's network proxies, one thread per side ("colo-net"), between
//! each NIC (on a [`Datagram`](devices::virtio::net::datagram::Datagram)
//! backend) and the world:
//!
//! - **primary**: the client's frames from each tap go to the guest and,
//!   their acks moved to the secondary's sequence space, over the link to
//!   the secondary; the guest's output goes into the compare and reaches
//!   the tap only when released (matched by the secondary's output, or at
//!   a checkpoint); the compare's checkpoint requests go to the `colo`
//!   thread. Alone (the pair over), the guest's frames go straight out.
//! - **secondary**: mirrored frames go to its guest, its guest's output goes
//!   back over the link; nothing touches its taps. It keeps the sequence
//!   offset each mirrored client segment carries
//!   ([`replication::survivor`]) until the next commit. At a takeover with
//!   offsets kept, it opens its taps ([`Cmd::Serve`]) and goes on between
//!   them and its guest, rewriting those connections' segments (the
//!   others pass untouched); without any, the NICs go to their taps
//!   directly and the proxy ends.
//!
//! Frames carry the epoch (checkpoints committed) they were taken in; at a
//! commit, with both guests paused, the `colo` side calls
//! [`Proxy::call`]`(Cmd::Committed)`: what the guests sent before is
//! handled (primary: compared, then every held frame released; secondary:
//! dropped, the primary's copy replaced it) and older frames from the link
//! are dropped from then on.
//!
//! Never blocks on the network: the link is non-blocking with a bounded
//! outbox ([`link::MAX_PENDING`]). Never drops a client frame one guest
//! got and the other did not (they would answer differently, and each
//! difference costs a checkpoint): a guest whose receive queue is full
//! holds the next frame back until it has room, and until then the
//! primary leaves the client's frames in the tap, as a guest alone does,
//! and also while the outbox is past [`LINK_HIGH`]; the secondary stops
//! reading the link while its guest is far behind, so the primary's
//! outbox fills. A frame that does not fit anywhere else is dropped and
//! counted. Never releases a primary frame the compare holds,
//! except at a checkpoint or once alone; never writes a frame to a tap
//! while its side's [`Fence`] is closed (dropped and counted as fenced).

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devices::virtio::net::backend::{NetBackend, VNET_HDR_LEN};
use devices::virtio::net::datagram::Peer;
use replication::compare::{Action, Compare};
use replication::rewrite::Csum;
use replication::schedule::Reason;
use serde::Serialize;
use std::sync::atomic::{AtomicUsize, Ordering};
use vmm_sys_util::eventfd::EventFd;

use super::arbiter::Fence;
use super::link::{self, Decoder};
use super::stages::{InFlight, Replies, Stages};
use super::tap_out::Tap;
use super::Side;
use crate::streams::endpoint::Conn;

/// What the `colo` side asks of its proxy.
pub enum Cmd {
    /// Checkpoint `n` is committed; both guests are paused. The primary's
    /// says why it was taken (the compare counts what it released by it).
    Committed(u64, Option<Reason>),
    /// The pair is over: release what is held, compare no more.
    Alone,
    /// The secondary serves: each NIC's tap (in NIC order), between which
    /// and its guest the proxy goes on, rewriting.
    Serve(Vec<Box<dyn NetBackend>>),
    Stop,
}

/// Frames a proxy handled, and those it could not.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProxyCounters {
    pub from_taps: u64,
    pub mirrored: u64,
    pub to_taps: u64,
    pub from_peer: u64,
    pub stale: u64,
    pub dropped: u64,
    /// Frames for a tap dropped because this side may not serve.
    pub fenced: u64,
    /// Frames handed to the guests' NICs that their devices have not
    /// taken yet (the guests' receive backlog), now and at most.
    pub guest_backlog: u64,
    pub guest_backlog_max: u64,
}

const FRAME: usize = link::MAX_LINK;
const BURST: usize = 64;
/// The primary reads no client frame while its outbox to the secondary
/// holds more (the frames the client sends meanwhile wait in the tap).
const LINK_HIGH: usize = link::MAX_PENDING / 2;
/// How often a proxy copies its counters into its side's report.
const REPORT_EVERY: Duration = Duration::from_millis(100);

type Reply = mpsc::Sender<()>;

/// A running proxy.
pub struct Proxy {
    evt: EventFd,
    cmds: mpsc::Sender<(Cmd, Reply)>,
    thread: Option<JoinHandle<()>>,
    /// The secondary's: connections it holds an offset for.
    offsets: Arc<AtomicUsize>,
}

impl Proxy {
    /// The primary's: `nics` are each NIC's tap and the other end of its
    /// datagram backend.
    pub fn primary(
        nics: Vec<(Box<dyn NetBackend>, Peer)>,
        link: Conn,
        compare: Compare,
        side: Arc<Side>,
        fence: Fence,
    ) -> std::io::Result<Proxy> {
        let (taps, guests): (Vec<_>, _) = nics.into_iter().unzip();
        let taps: Vec<Tap> = taps.into_iter().map(Tap::new).collect();
        let pending = taps.iter().map(|_| None).collect();
        let core = Core::new(guests, link, true)?;
        let offsets = Arc::new(AtomicUsize::new(0));
        let p = Primary {
            core,
            taps,
            pending,
            compare,
            hdrs: HashMap::new(),
            alone: false,
            side,
            fence,
        };
        Self::spawn(move |evt, rx| p.run(evt, rx), offsets)
    }

    /// The secondary's: the other ends of its NICs' datagram backends.
    pub fn secondary(
        guests: Vec<Peer>,
        link: Conn,
        side: Arc<Side>,
        fence: Fence,
    ) -> std::io::Result<Proxy> {
        let core = Core::new(guests, link, false)?;
        let offsets = Arc::new(AtomicUsize::new(0));
        let s = Secondary::new(core, offsets.clone(), side, fence);
        Self::spawn(move |evt, rx| s.run(evt, rx), offsets)
    }

    /// The secondary's: connections whose segments it would rewrite if it
    /// served now.
    pub fn offsets(&self) -> usize {
        self.offsets.load(Ordering::SeqCst)
    }

    fn spawn(
        body: impl FnOnce(&EventFd, mpsc::Receiver<(Cmd, Reply)>) + Send + 'static,
        offsets: Arc<AtomicUsize>,
    ) -> std::io::Result<Proxy> {
        let evt = EventFd::new(libc::EFD_NONBLOCK)?;
        let theirs = evt.try_clone()?;
        let (cmds, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("colo-net".into())
            .spawn(move || {
                crate::sandbox::confine(crate::sandbox::Kind::Stream);
                body(&theirs, rx)
            })?;
        Ok(Proxy {
            evt,
            cmds,
            thread: Some(thread),
            offsets,
        })
    }

    /// Asks `cmd` and waits at most `wait` for it to be done; whether it
    /// was.
    pub fn call(&self, cmd: Cmd, wait: Duration) -> bool {
        let (reply, done) = mpsc::channel();
        if self.cmds.send((cmd, reply)).is_err() {
            return false;
        }
        let _ = self.evt.write(1);
        done.recv_timeout(wait).is_ok()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.call(Cmd::Stop, Duration::from_secs(2));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What both sides' loops share: the guests' ends and the link.
struct Core {
    guests: Vec<Peer>,
    /// What the guests are sent as (the secondary moves on at each
    /// checkpoint, dropping what its guest did not take yet).
    generation: u64,
    /// Frames each guest NIC was handed (the primary numbers its client
    /// frames by it).
    handed: Vec<u64>,
    link: Conn,
    linked: bool,
    dec: Decoder,
    outbox: Vec<u8>,
    epoch: u64,
    counters: ProxyCounters,
    buf: Vec<u8>,
    /// Frames on their way to the link, to time them.
    flight: InFlight,
    /// When each guest was handed a frame it has not answered.
    replies: Replies,
    stages: Stages,
    /// The primary's (its link carries client frames) or the secondary's.
    primary: bool,
    /// Guests with frames waiting for room in their receive queue (their
    /// socket is polled for writing).
    want_out: Vec<bool>,
    /// Whether the link is read now (the secondary stops while its guest
    /// is far behind).
    link_in: bool,
}

/// What became of a frame handed to a guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handed {
    /// It is in the guest's receive queue.
    Queued,
    /// The queue is full: hand it again once the guest took some.
    Full,
    /// It cannot be handed (counted as dropped).
    Dropped,
}

impl Core {
    fn new(guests: Vec<Peer>, link: Conn, primary: bool) -> std::io::Result<Core> {
        link.set_nonblocking(true)?;
        Ok(Core {
            want_out: vec![false; guests.len()],
            link_in: true,
            handed: Vec::new(),
            generation: 0,
            flight: InFlight::default(),
            replies: Replies::default(),
            stages: Stages::default(),
            primary,
            guests,
            link,
            linked: true,
            dec: Decoder::default(),
            outbox: Vec::new(),
            epoch: 0,
            counters: ProxyCounters::default(),
            buf: vec![0u8; FRAME],
        })
    }

    /// Waits for any descriptor of interest (`taps`: what each tap polls
    /// for; `read(i)`: whether tap `i` is read now), at most `most`.
    fn poll(&self, evt: &EventFd, taps: &[Tap], read: impl Fn(usize) -> bool, most: Duration) {
        let mut extra = Vec::new();
        for (i, t) in taps.iter().enumerate() {
            t.poll_fds(read(i), &mut extra);
        }
        let guests = self.guests.iter().enumerate().map(|(i, g)| {
            let out = self.want_out.get(i).is_some_and(|&w| w);
            (
                g.as_raw_fd(),
                libc::POLLIN | if out { libc::POLLOUT } else { 0 },
            )
        });
        let mut fds: Vec<libc::pollfd> = std::iter::once((evt.as_raw_fd(), libc::POLLIN))
            .chain(guests)
            .chain(extra)
            .map(|(fd, events)| libc::pollfd {
                fd,
                events,
                revents: 0,
            })
            .collect();
        if self.linked {
            let mut events = if self.link_in { libc::POLLIN } else { 0 };
            if !self.outbox.is_empty() {
                events |= libc::POLLOUT;
            }
            fds.push(libc::pollfd {
                fd: self.link.raw_fd(),
                events,
                revents: 0,
            });
        }
        let ms = i32::try_from(most.as_millis().max(1)).unwrap_or(i32::MAX);
        // SAFETY: `fds` is a live array of `fds.len()` pollfd structs that
        // poll only reads and writes within.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    }

    /// Queues a frame for the peer (dropped past the outbox's bound);
    /// `since`: when it was taken, to time its way to the link.
    fn send(&mut self, kind: u8, nic: usize, tag: u64, offset: u32, frame: &[u8], since: Instant) {
        if !self.linked || self.outbox.len() > link::MAX_PENDING {
            self.counters.dropped += 1;
            return;
        }
        let nic = u8::try_from(nic).unwrap_or(u8::MAX);
        let before = self.outbox.len();
        link::encode(kind, nic, tag, offset, frame, &mut self.outbox);
        self.flight.queued(self.outbox.len() - before, Some(since));
    }

    /// The histogram of frames reaching the link on this side.
    fn link_stage(&mut self) -> &mut replication::histogram::Histogram {
        if self.primary {
            &mut self.stages.tap_to_link
        } else {
            &mut self.stages.guest_to_link
        }
    }

    /// Writes what the outbox holds, as far as the link takes it.
    fn flush(&mut self) {
        while self.linked && !self.outbox.is_empty() {
            match self.link.write(&self.outbox) {
                Ok(0) => self.lose("the link took nothing"),
                Ok(n) => {
                    self.outbox.drain(..n);
                    let mut h = std::mem::take(self.link_stage());
                    self.flight.written(n, Instant::now(), &mut h);
                    *self.link_stage() = h;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => self.lose(&e.to_string()),
            }
        }
    }

    /// Frames from the peer; outputs only of this epoch or later.
    fn receive(&mut self) -> Vec<link::LinkFrame> {
        let mut got = Vec::new();
        let mut chunk = [0u8; 65536];
        while self.linked {
            match self.link.read(&mut chunk) {
                Ok(0) => self.lose("the peer closed the link"),
                Ok(n) => self.dec.push(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => self.lose(&e.to_string()),
            }
        }
        loop {
            match self.dec.next_frame() {
                Ok(Some(f)) if f.kind == link::OUTPUT && f.tag < self.epoch => {
                    self.counters.stale += 1
                }
                Ok(Some(f)) => {
                    self.counters.from_peer += 1;
                    got.push(f);
                }
                Ok(None) => break,
                Err(e) => {
                    self.lose(&e.to_string());
                    break;
                }
            }
        }
        got
    }

    fn lose(&mut self, why: &str) {
        if self.linked {
            log::warn!("COLO: network link lost: {why}");
        }
        self.linked = false;
        self.outbox.clear();
        self.flight.lost();
    }

    /// The frames guest `i` sent, at most `most`.
    fn sent_by_guest(&mut self, i: usize, most: usize) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while out.len() < most {
            match self.guests[i].recv(&mut self.buf) {
                Ok(n) => out.push(self.buf[..n].to_vec()),
                Err(_) => break,
            }
        }
        if !out.is_empty() {
            self.replies
                .sent(i, Instant::now(), &mut self.stages.guest_reply);
        }
        out
    }

    /// Hands `frame` to guest `i`: queued, or its queue is full (try
    /// again), or dropped and counted.
    fn hand_to_guest(&mut self, i: usize, frame: &[u8]) -> Handed {
        match self.guests.get(i).map(|g| g.send(self.generation, frame)) {
            Some(Err(e)) if e.kind() == ErrorKind::WouldBlock => Handed::Full,
            Some(Ok(_)) => {
                self.replies.handed(i, Instant::now());
                if self.handed.len() <= i {
                    self.handed.resize(i + 1, 0);
                }
                self.handed[i] += 1;
                let backlog = self.handed[i].saturating_sub(self.guests[i].taken());
                self.counters.guest_backlog = backlog;
                self.counters.guest_backlog_max = self.counters.guest_backlog_max.max(backlog);
                Handed::Queued
            }
            _ => {
                self.counters.dropped += 1;
                Handed::Dropped
            }
        }
    }
}

struct Primary {
    core: Core,
    taps: Vec<Tap>,
    /// Per NIC, a client frame read from its tap that its guest had no
    /// room for yet (with when it was read): the tap is not read until
    /// the guest took it.
    pending: Vec<Option<(Vec<u8>, Instant)>>,
    compare: Compare,
    /// Each held frame's NIC and virtio-net header, by its compare number.
    hdrs: HashMap<u64, (usize, Vec<u8>)>,
    alone: bool,
    side: Arc<Side>,
    fence: Fence,
}

impl Primary {
    fn run(mut self, evt: &EventFd, cmds: mpsc::Receiver<(Cmd, Reply)>) {
        let mut reported = Instant::now();
        loop {
            let most = self
                .compare
                .next_deadline(Instant::now())
                .map_or(REPORT_EVERY, |d| d.min(REPORT_EVERY));
            for (i, p) in self.pending.iter().enumerate() {
                self.core.want_out[i] = p.is_some();
            }
            self.core.poll(evt, &self.taps, |i| self.reads(i), most);
            let _ = evt.read();
            self.drain_taps();
            let mut acts = Vec::new();
            while let Ok((cmd, reply)) = cmds.try_recv() {
                match cmd {
                    Cmd::Stop => {
                        let _ = reply.send(());
                        return;
                    }
                    Cmd::Committed(n, why) => {
                        self.guests_out(usize::MAX, &mut acts);
                        self.compare.checkpoint_done(Instant::now(), why, &mut acts);
                        self.core.epoch = n;
                        self.boundaries(n);
                    }
                    Cmd::Alone => {
                        self.guests_out(usize::MAX, &mut acts);
                        self.compare
                            .checkpoint_done(Instant::now(), None, &mut acts);
                        self.alone = true;
                        self.core.lose("the pair is over");
                    }
                    // The primary serves with its own taps already.
                    Cmd::Serve(_) => {}
                }
                self.act(std::mem::take(&mut acts));
                let _ = reply.send(());
            }
            self.clients();
            self.guests_out(BURST, &mut acts);
            for f in self.core.receive() {
                if f.kind == link::OUTPUT && f.frame.len() > VNET_HDR_LEN {
                    self.compare
                        .secondary(&f.frame[VNET_HDR_LEN..], Instant::now(), &mut acts);
                }
            }
            self.compare.tick(Instant::now(), &mut acts);
            self.act(acts);
            self.core.flush();
            if reported.elapsed() > REPORT_EVERY {
                reported = Instant::now();
                self.report();
            }
        }
    }

    fn report(&self) {
        let (c, p) = (self.compare.counters().clone(), self.core.counters.clone());
        let (h, s) = (self.compare.holds().clone(), self.core.stages.clone());
        self.side.update(|r| {
            r.compare = Some(c);
            r.proxy = Some(p);
            r.holds = Some(h);
            r.stages = Some(s);
        });
    }

    /// Whether tap `i` is read now: its guest has room for the frame held
    /// back (none is), and the outbox to the secondary is not past
    /// [`LINK_HIGH`] (never while alone).
    fn reads(&self, i: usize) -> bool {
        let busy_link = !self.alone && self.core.linked && self.core.outbox.len() > LINK_HIGH;
        self.pending.get(i).is_some_and(Option::is_none) && !busy_link
    }

    /// The client's frames: to the guest, and mirrored.
    fn clients(&mut self) {
        for i in 0..self.taps.len() {
            if let Some((frame, read)) = self.pending[i].take() {
                if !self.client(i, frame, read) {
                    continue;
                }
            }
            for _ in 0..BURST {
                if !self.reads(i) {
                    break;
                }
                let n = match self.taps[i].dev.read_frame(&mut self.core.buf) {
                    Ok(n) => n,
                    Err(_) => break,
                };
                let read = Instant::now();
                self.core.counters.from_taps += 1;
                let frame = self.core.buf[..n].to_vec();
                if !self.client(i, frame, read) {
                    break;
                }
            }
        }
    }

    /// Client frame `frame` (read at `read`) to guest `i` and mirrored;
    /// false when the guest had no room (it is held back in `pending`).
    fn client(&mut self, i: usize, mut frame: Vec<u8>, read: Instant) -> bool {
        // What its guest did not get, the secondary's does not.
        match self.core.hand_to_guest(i, &frame) {
            Handed::Queued => {}
            Handed::Dropped => return true,
            Handed::Full => {
                self.pending[i] = Some((frame, read));
                return false;
            }
        }
        let number = self.core.handed[i] - 1;
        if self.alone || !self.core.linked {
            return true;
        }
        let n = frame.len();
        if n <= VNET_HDR_LEN {
            self.core.send(link::CLIENT, i, number, 0, &frame, read);
            return true;
        }
        let csum = csum_of(&frame);
        let offset = self
            .compare
            .client_to_secondary(&mut frame[VNET_HDR_LEN..], csum, Instant::now())
            .ok()
            .flatten()
            .unwrap_or(0);
        self.core.counters.mirrored += 1;
        self.core
            .send(link::CLIENT, i, number, offset, &frame, read);
        true
    }

    /// Checkpoint `n` is committed, its guest paused since it was taken:
    /// where it cut each NIC's client frames (those its guest had are in
    /// the checkpoint; the secondary's guest gets the others).
    fn boundaries(&mut self, n: u64) {
        for i in 0..self.core.guests.len() {
            // Not the frames its device took: those it still holds are
            // not in the checkpoint's guest, and go to the secondary's.
            let delivered = self.core.guests[i].delivered();
            let now = Instant::now();
            self.core
                .send(link::BOUNDARY, i, n, 0, &delivered.to_le_bytes(), now);
        }
    }

    /// The guest's output (at most `most` frames of each NIC): into the
    /// compare, or out once alone.
    fn guests_out(&mut self, most: usize, acts: &mut Vec<Action>) {
        for i in 0..self.core.guests.len() {
            for frame in self.core.sent_by_guest(i, most) {
                if self.alone || frame.len() <= VNET_HDR_LEN {
                    self.out_to_tap(i, frame);
                    continue;
                }
                let id = self.compare.next_id().0;
                self.hdrs.insert(id, (i, frame[..VNET_HDR_LEN].to_vec()));
                self.compare
                    .primary(frame[VNET_HDR_LEN..].to_vec(), Instant::now(), acts);
            }
        }
    }

    fn act(&mut self, acts: Vec<Action>) {
        for a in acts {
            match a {
                Action::Release { id, frame } => {
                    let Some((i, mut bytes)) = self.hdrs.remove(&id.0) else {
                        continue;
                    };
                    bytes.extend_from_slice(&frame);
                    self.out_to_tap(i, bytes);
                }
                Action::Checkpoint(reason) => self.side.request(reason),
            }
        }
        // Frames the compare dropped never come back.
        if self.hdrs.len() > 4 * self.compare.config().max_queue + BURST {
            let oldest = self.compare.next_id().0;
            let keep = (4 * self.compare.config().max_queue) as u64;
            self.hdrs.retain(|&id, _| id + keep >= oldest);
        }
    }

    fn out_to_tap(&mut self, i: usize, frame: Vec<u8>) {
        let c = &mut self.core;
        self.taps[i].put(
            frame,
            &self.fence,
            &mut c.counters,
            &mut c.stages.release_to_tap,
        );
    }

    fn drain_taps(&mut self) {
        let c = &mut self.core;
        for t in &mut self.taps {
            t.drain(&self.fence, &mut c.counters, &mut c.stages.release_to_tap);
        }
    }
}

/// Which checksum a frame (virtio-net header first) carries.
fn csum_of(frame: &[u8]) -> Csum {
    if frame.first().is_some_and(|f| f & 1 != 0) {
        Csum::Partial
    } else {
        Csum::Full
    }
}

#[path = "proxy_secondary.rs"]
mod secondary;
use secondary::Secondary;

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
//! outbox ([`link::MAX_PENDING`]); a frame that does not fit anywhere is
//! dropped and counted. Never releases a primary frame the compare holds,
//! except at a checkpoint or once alone; never writes a frame to a tap
//! while its side's [`Fence`] is closed (dropped and counted as fenced).

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixDatagram;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devices::virtio::net::backend::{NetBackend, VNET_HDR_LEN};
use replication::compare::{Action, Compare};
use replication::rewrite::Csum;
use replication::survivor::{self, Offsets};
use serde::Serialize;
use std::sync::atomic::{AtomicUsize, Ordering};
use vmm_sys_util::eventfd::EventFd;

use super::arbiter::Fence;
use super::link::{self, Decoder};
use super::Side;
use crate::streams::endpoint::Conn;

/// What the `colo` side asks of its proxy.
pub enum Cmd {
    /// Checkpoint `n` is committed; both guests are paused.
    Committed(u64),
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
}

const FRAME: usize = link::MAX_LINK;
const TURN_MS: i32 = 10;
const BURST: usize = 64;
/// How long a full tap is waited for before a released frame is dropped.
const TAP_WAIT: Duration = Duration::from_millis(20);

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
        nics: Vec<(Box<dyn NetBackend>, UnixDatagram)>,
        link: Conn,
        compare: Compare,
        side: Arc<Side>,
        fence: Fence,
    ) -> std::io::Result<Proxy> {
        let (taps, guests) = nics.into_iter().unzip();
        let core = Core::new(guests, link)?;
        let offsets = Arc::new(AtomicUsize::new(0));
        let p = Primary {
            core,
            taps,
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
        guests: Vec<UnixDatagram>,
        link: Conn,
        fence: Fence,
    ) -> std::io::Result<Proxy> {
        let core = Core::new(guests, link)?;
        let offsets = Arc::new(AtomicUsize::new(0));
        let s = Secondary {
            core,
            offsets: Offsets::new(survivor::DEFAULT_CAP),
            count: offsets.clone(),
            taps: Vec::new(),
            fence,
        };
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
            .spawn(move || body(&theirs, rx))?;
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
    guests: Vec<UnixDatagram>,
    link: Conn,
    linked: bool,
    dec: Decoder,
    outbox: Vec<u8>,
    epoch: u64,
    counters: ProxyCounters,
    buf: Vec<u8>,
}

impl Core {
    fn new(guests: Vec<UnixDatagram>, link: Conn) -> std::io::Result<Core> {
        link.set_nonblocking(true)?;
        Ok(Core {
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

    /// Waits for any descriptor of interest (`extra`: the taps).
    fn poll(&self, evt: &EventFd, extra: &[i32]) {
        let mut fds: Vec<libc::pollfd> = std::iter::once(evt.as_raw_fd())
            .chain(extra.iter().copied())
            .chain(self.guests.iter().map(|g| g.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        if self.linked {
            let mut events = libc::POLLIN;
            if !self.outbox.is_empty() {
                events |= libc::POLLOUT;
            }
            fds.push(libc::pollfd {
                fd: self.link.raw_fd(),
                events,
                revents: 0,
            });
        }
        // SAFETY: `fds` is a live array of `fds.len()` pollfd structs that
        // poll only reads and writes within.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, TURN_MS) };
    }

    /// Queues a frame for the peer (dropped past the outbox's bound).
    fn send(&mut self, kind: u8, nic: usize, offset: u32, frame: &[u8]) {
        if !self.linked || self.outbox.len() > link::MAX_PENDING {
            self.counters.dropped += 1;
            return;
        }
        let nic = u8::try_from(nic).unwrap_or(u8::MAX);
        link::encode(kind, nic, self.epoch, offset, frame, &mut self.outbox);
    }

    /// Writes what the outbox holds, as far as the link takes it.
    fn flush(&mut self) {
        while self.linked && !self.outbox.is_empty() {
            match self.link.write(&self.outbox) {
                Ok(0) => self.lose("the link took nothing"),
                Ok(n) => {
                    self.outbox.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => self.lose(&e.to_string()),
            }
        }
    }

    /// Frames from the peer, of this epoch or later.
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
                Ok(Some(f)) if f.epoch < self.epoch => self.counters.stale += 1,
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
    }

    /// The frames guest `i` sent, at most a burst.
    fn sent_by_guest(&mut self, i: usize) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while out.len() < BURST {
            match self.guests[i].recv(&mut self.buf) {
                Ok(n) => out.push(self.buf[..n].to_vec()),
                Err(_) => break,
            }
        }
        out
    }
}

struct Primary {
    core: Core,
    taps: Vec<Box<dyn NetBackend>>,
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
            let taps: Vec<i32> = self.taps.iter().map(|t| t.rx_fd()).collect();
            self.core.poll(evt, &taps);
            let _ = evt.read();
            let mut acts = Vec::new();
            while let Ok((cmd, reply)) = cmds.try_recv() {
                match cmd {
                    Cmd::Stop => {
                        let _ = reply.send(());
                        return;
                    }
                    Cmd::Committed(n) => {
                        self.guests_out(&mut acts);
                        self.compare.checkpoint_done(&mut acts);
                        self.core.epoch = n;
                    }
                    Cmd::Alone => {
                        self.guests_out(&mut acts);
                        self.compare.checkpoint_done(&mut acts);
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
            self.guests_out(&mut acts);
            for f in self.core.receive() {
                if f.kind == link::OUTPUT && f.frame.len() > VNET_HDR_LEN {
                    self.compare
                        .secondary(&f.frame[VNET_HDR_LEN..], Instant::now(), &mut acts);
                }
            }
            self.compare.tick(Instant::now(), &mut acts);
            self.act(acts);
            self.core.flush();
            if reported.elapsed() > Duration::from_millis(100) {
                reported = Instant::now();
                let (c, p) = (self.compare.counters().clone(), self.core.counters.clone());
                self.side.update(|r| {
                    r.compare = Some(c);
                    r.proxy = Some(p);
                });
            }
        }
    }

    /// The client's frames: to the guest, and mirrored.
    fn clients(&mut self) {
        for i in 0..self.taps.len() {
            for _ in 0..BURST {
                let n = match self.taps[i].read_frame(&mut self.core.buf) {
                    Ok(n) => n,
                    Err(_) => break,
                };
                self.core.counters.from_taps += 1;
                let mut frame = self.core.buf[..n].to_vec();
                if self.core.guests[i].send(&frame).is_err() {
                    self.core.counters.dropped += 1;
                }
                if self.alone || !self.core.linked || n <= VNET_HDR_LEN {
                    continue;
                }
                let csum = csum_of(&frame);
                let offset = self
                    .compare
                    .client_to_secondary(&mut frame[VNET_HDR_LEN..], csum, Instant::now())
                    .ok()
                    .flatten()
                    .unwrap_or(0);
                self.core.counters.mirrored += 1;
                self.core.send(link::CLIENT, i, offset, &frame);
            }
        }
    }

    /// The guest's output: into the compare, or out once alone.
    fn guests_out(&mut self, acts: &mut Vec<Action>) {
        for i in 0..self.core.guests.len() {
            for frame in self.core.sent_by_guest(i) {
                if self.alone || frame.len() <= VNET_HDR_LEN {
                    self.out_to_tap(i, &frame);
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
                    self.out_to_tap(i, &bytes);
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

    fn out_to_tap(&mut self, i: usize, frame: &[u8]) {
        out_to_tap(
            &mut *self.taps[i],
            frame,
            &self.fence,
            &mut self.core.counters,
        );
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

/// Writes `frame` to `tap`, waiting a little for room, if `fence` lets it.
fn out_to_tap(tap: &mut dyn NetBackend, frame: &[u8], fence: &Fence, counters: &mut ProxyCounters) {
    if !fence.open() {
        counters.fenced += 1;
        return;
    }
    let end = Instant::now() + TAP_WAIT;
    loop {
        match tap.write_frame(frame) {
            Ok(_) => {
                counters.to_taps += 1;
                return;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < end => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(_) => {
                counters.dropped += 1;
                return;
            }
        }
    }
}

/// The secondary's proxy: see the module doc.
struct Secondary {
    core: Core,
    offsets: Offsets,
    /// What `Proxy::offsets` reads.
    count: Arc<AtomicUsize>,
    /// Its taps, once it serves.
    taps: Vec<Box<dyn NetBackend>>,
    fence: Fence,
}

impl Secondary {
    fn run(mut self, evt: &EventFd, cmds: mpsc::Receiver<(Cmd, Reply)>) {
        loop {
            let taps: Vec<i32> = self.taps.iter().map(|t| t.rx_fd()).collect();
            self.core.poll(evt, &taps);
            let _ = evt.read();
            while let Ok((cmd, reply)) = cmds.try_recv() {
                match cmd {
                    Cmd::Stop => {
                        let _ = reply.send(());
                        return;
                    }
                    Cmd::Committed(n) => {
                        // What its guest sent before is the past the
                        // primary's copy replaced; the guests agree on
                        // every connection now.
                        for i in 0..self.core.guests.len() {
                            self.core.sent_by_guest(i);
                        }
                        self.core.epoch = n;
                        self.offsets.clear();
                    }
                    Cmd::Serve(taps) => {
                        self.core.lose("this side serves");
                        self.taps = taps;
                    }
                    Cmd::Alone => {}
                }
                self.count.store(self.offsets.len(), Ordering::SeqCst);
                let _ = reply.send(());
            }
            if self.taps.is_empty() {
                self.mirror();
            } else {
                self.serve();
            }
        }
    }

    /// In the pair: mirrored frames in, its guest's output back.
    fn mirror(&mut self) {
        let core = &mut self.core;
        for f in core.receive() {
            let nic = usize::from(f.nic);
            if f.kind != link::CLIENT || nic >= core.guests.len() {
                continue;
            }
            if let Some(frame) = f.frame.get(VNET_HDR_LEN..) {
                self.offsets.learn(frame, f.offset);
            }
            if core.guests[nic].send(&f.frame).is_err() {
                core.counters.dropped += 1;
            }
        }
        self.count.store(self.offsets.len(), Ordering::SeqCst);
        for i in 0..core.guests.len() {
            for frame in core.sent_by_guest(i) {
                core.send(link::OUTPUT, i, 0, &frame);
            }
        }
        core.flush();
    }

    /// Serving: between each tap and its guest, the connections opened
    /// since the last checkpoint rewritten.
    fn serve(&mut self) {
        let core = &mut self.core;
        for (i, tap) in self.taps.iter_mut().enumerate() {
            let Some(guest) = core.guests.get(i) else {
                continue;
            };
            for _ in 0..BURST {
                let Ok(n) = tap.read_frame(&mut core.buf) else {
                    break;
                };
                core.counters.from_taps += 1;
                if n > VNET_HDR_LEN {
                    let csum = csum_of(&core.buf[..n]);
                    let _ = self
                        .offsets
                        .client_to_guest(&mut core.buf[VNET_HDR_LEN..n], csum);
                }
                if guest.send(&core.buf[..n]).is_err() {
                    core.counters.dropped += 1;
                }
            }
            for mut frame in core.sent_by_guest(i) {
                let csum = csum_of(&frame);
                if let Some(body) = frame.get_mut(VNET_HDR_LEN..) {
                    let _ = self.offsets.guest_to_client(body, csum);
                }
                out_to_tap(&mut **tap, &frame, &self.fence, &mut core.counters);
            }
        }
    }
}

//! The secondary's proxy loop (see [`super`]'s module doc): mirrored
//! client frames to its guest, its guest's output back over the link; at
//! a takeover, between its taps and its guest.
//!
//! Each checkpoint cuts every NIC's client frames where the primary's
//! guest had taken them ([`link::BOUNDARY`]): the frames before are in the
//! checkpoint, the ones after are the new epoch's. At its own commit this
//! guest becomes the primary's as of that cut, so what was queued for it
//! and not taken goes (the generation moves on), and once the boundary is
//! there every kept frame from it on is handed again, in order — the
//! frames that arrived during the checkpoint included, and those this
//! guest had taken before its memory was replaced. Until the boundary
//! arrives, new frames wait. So both guests get the same frames after
//! every checkpoint, whatever the timing of the two commits.
//!
//! A frame its guest has no room for stays kept, and it and the frames
//! after it are handed, in order, once the guest took some (its socket
//! polled for writing); while more than [`BEHIND`] bytes wait so (and no
//! boundary is awaited), the link is not read, so the primary reads no
//! more of the client's.
//!
//! Runs on the secondary's `colo-net` thread. Never does: touch a tap
//! before it serves, keep more than [`MAX_KEPT`] bytes of frames (the
//! oldest go, counted as dropped), hand a frame of a NIC whose boundary it
//! waits for, drop a frame because its guest's queue is full.

use std::collections::VecDeque;
use std::time::Instant;

use super::*;
use replication::survivor::{self, Offsets};

/// The most bytes of client frames kept for handing again, per NIC.
const MAX_KEPT: usize = 16 << 20;
/// Bytes of kept frames not yet handed to a guest past which the link is
/// not read.
const BEHIND: usize = MAX_KEPT / 4;

/// One client frame kept since the last boundary.
struct Kept {
    number: u64,
    offset: u32,
    frame: Vec<u8>,
    /// When it came from the link, until it was first handed on.
    came: Option<Instant>,
}

/// A NIC's client frames since the last boundary, and where it stands.
#[derive(Default)]
struct Nic {
    kept: VecDeque<Kept>,
    bytes: usize,
    /// The last `unhanded` kept frames are not handed yet (their guest had
    /// no room), `unhanded_bytes` long.
    unhanded: usize,
    unhanded_bytes: usize,
    /// A commit happened; its boundary is not applied yet.
    waiting: bool,
    /// A boundary that came before its commit: (epoch, first number).
    early: Option<(u64, u64)>,
}

/// The secondary's proxy: see the module doc.
pub(super) struct Secondary {
    core: Core,
    offsets: Offsets,
    /// What `Proxy::offsets` reads.
    count: Arc<AtomicUsize>,
    nics: Vec<Nic>,
    /// Its taps, once it serves.
    taps: Vec<Tap>,
    fence: Fence,
    side: Arc<Side>,
}

impl Secondary {
    pub(super) fn new(core: Core, count: Arc<AtomicUsize>, side: Arc<Side>, fence: Fence) -> Self {
        let nics = core.guests.iter().map(|_| Nic::default()).collect();
        Secondary {
            core,
            offsets: Offsets::new(survivor::DEFAULT_CAP),
            count,
            nics,
            taps: Vec::new(),
            fence,
            side,
        }
    }

    pub(super) fn run(mut self, evt: &EventFd, cmds: mpsc::Receiver<(Cmd, Reply)>) {
        let mut reported = Instant::now();
        loop {
            for (i, n) in self.nics.iter().enumerate() {
                self.core.want_out[i] = n.unhanded > 0 && !n.waiting;
            }
            self.core.link_in = self
                .nics
                .iter()
                .all(|n| n.waiting || n.unhanded_bytes <= BEHIND);
            self.core.poll(
                evt,
                &self.taps,
                |i| self.nics.get(i).is_some_and(|n| n.unhanded == 0),
                REPORT_EVERY,
            );
            let _ = evt.read();
            let c = &mut self.core;
            for t in &mut self.taps {
                t.drain(&self.fence, &mut c.counters, &mut c.stages.release_to_tap);
            }
            if reported.elapsed() > REPORT_EVERY {
                reported = Instant::now();
                let (p, s) = (self.core.counters.clone(), self.core.stages.clone());
                self.side.update(|r| {
                    r.proxy = Some(p);
                    r.stages = Some(s);
                });
            }
            while let Ok((cmd, reply)) = cmds.try_recv() {
                let stop = matches!(cmd, Cmd::Stop);
                self.command(cmd);
                self.count.store(self.offsets.len(), Ordering::SeqCst);
                let _ = reply.send(());
                if stop {
                    return;
                }
            }
            if self.taps.is_empty() {
                self.mirror();
            } else {
                self.serve();
            }
        }
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Committed(n, _) => self.committed(n),
            Cmd::Serve(taps) => {
                self.core.lose("this side serves");
                // Its guest is the last checkpoint's. A boundary that
                // never came (the link went during the commit): every
                // kept frame goes on, some perhaps a second time (TCP
                // drops a duplicate, an echo is answered twice).
                for i in 0..self.nics.len() {
                    if self.nics[i].waiting {
                        self.nics[i].waiting = false;
                        self.hand_kept(i, 0);
                    }
                }
                self.taps = taps.into_iter().map(Tap::new).collect();
            }
            Cmd::Alone | Cmd::Stop => {}
        }
    }

    /// Checkpoint `n` is committed, this guest paused and now a copy of
    /// the primary's as of that checkpoint.
    fn committed(&mut self, n: u64) {
        // What its guest sent before is the past the primary's copy
        // replaced; the guests agree on every connection now.
        for i in 0..self.core.guests.len() {
            self.core.sent_by_guest(i, usize::MAX);
        }
        self.core.epoch = n;
        self.offsets.clear();
        // Nothing queued for its guest before is taken now.
        self.core.generation += 1;
        for (i, g) in self.core.guests.iter().enumerate() {
            g.set_floor(self.core.generation);
            // What was queued goes untaken: the backlog starts again.
            if let Some(h) = self.core.handed.get_mut(i) {
                *h = g.taken();
            }
        }
        for i in 0..self.nics.len() {
            self.nics[i].waiting = true;
            match self.nics[i].early.take() {
                Some((e, first)) if e == n => self.boundary(i, first),
                Some((e, first)) if e > n => self.nics[i].early = Some((e, first)),
                _ => {}
            }
        }
    }

    /// NIC `i`'s boundary of the last commit: the frames from `first` on
    /// go to its guest.
    fn boundary(&mut self, i: usize, first: u64) {
        self.nics[i].waiting = false;
        self.hand_kept(i, first);
    }

    /// Drops NIC `i`'s kept frames numbered below `first` and hands the
    /// others to its guest, in order.
    fn hand_kept(&mut self, i: usize, first: u64) {
        let nic = &mut self.nics[i];
        while nic.kept.front().is_some_and(|k| k.number < first) {
            if let Some(k) = nic.kept.pop_front() {
                nic.bytes -= k.frame.len();
            }
        }
        nic.unhanded = nic.kept.len();
        nic.unhanded_bytes = nic.bytes;
        self.pump(i);
    }

    /// Hands NIC `i`'s kept frames not handed yet to its guest, in order,
    /// as far as its queue has room (none while a boundary is awaited).
    fn pump(&mut self, i: usize) {
        let nic = &mut self.nics[i];
        while nic.unhanded > 0 && !nic.waiting {
            let at = nic.kept.len() - nic.unhanded;
            let Some(k) = nic.kept.get_mut(at) else {
                break;
            };
            let len = k.frame.len();
            if hand(&mut self.core, &mut self.offsets, i, k) == Handed::Full {
                break;
            }
            nic.unhanded -= 1;
            nic.unhanded_bytes -= len;
        }
    }

    /// In the pair: mirrored frames in, its guest's output back.
    fn mirror(&mut self) {
        for i in 0..self.nics.len() {
            self.pump(i);
        }
        let got = if self.core.link_in {
            self.core.receive()
        } else {
            Vec::new()
        };
        for f in got {
            let i = usize::from(f.nic);
            if i >= self.nics.len() {
                continue;
            }
            match f.kind {
                link::CLIENT => self.client(i, f),
                link::BOUNDARY => {
                    let first = f
                        .frame
                        .first_chunk::<8>()
                        .map_or(0, |b| u64::from_le_bytes(*b));
                    if f.tag == self.core.epoch && self.nics[i].waiting {
                        self.boundary(i, first);
                    } else if f.tag > self.core.epoch {
                        self.nics[i].early = Some((f.tag, first));
                    }
                }
                _ => {}
            }
        }
        self.count.store(self.offsets.len(), Ordering::SeqCst);
        let core = &mut self.core;
        for i in 0..core.guests.len() {
            for frame in core.sent_by_guest(i, BURST) {
                let epoch = core.epoch;
                core.send(link::OUTPUT, i, epoch, 0, &frame, Instant::now());
            }
        }
        core.flush();
    }

    /// A mirrored client frame: kept, and handed on unless a boundary is
    /// awaited.
    fn client(&mut self, i: usize, f: link::LinkFrame) {
        let nic = &mut self.nics[i];
        let k = Kept {
            number: f.tag,
            offset: f.offset,
            frame: f.frame,
            came: Some(Instant::now()),
        };
        let len = k.frame.len();
        nic.bytes += len;
        nic.kept.push_back(k);
        if !nic.waiting {
            nic.unhanded += 1;
            nic.unhanded_bytes += len;
        }
        while nic.bytes > MAX_KEPT {
            let Some(old) = nic.kept.pop_front() else {
                break;
            };
            nic.bytes -= old.frame.len();
            if nic.unhanded > nic.kept.len() {
                nic.unhanded = nic.kept.len();
                nic.unhanded_bytes -= old.frame.len();
            }
            self.core.counters.dropped += 1;
        }
        self.pump(i);
    }

    /// Serving: between each tap and its guest, the connections opened
    /// since the last checkpoint rewritten.
    fn serve(&mut self) {
        for i in 0..self.nics.len() {
            self.pump(i);
        }
        let core = &mut self.core;
        for (i, tap) in self.taps.iter_mut().enumerate() {
            if i >= core.guests.len() {
                continue;
            }
            // The frames kept from the pair go first.
            for _ in 0..BURST {
                if self.nics.get(i).is_some_and(|n| n.unhanded > 0) {
                    break;
                }
                let Ok(n) = tap.dev.read_frame(&mut core.buf) else {
                    break;
                };
                core.counters.from_taps += 1;
                let mut frame = core.buf[..n].to_vec();
                if n > VNET_HDR_LEN {
                    let csum = csum_of(&frame);
                    let _ = self
                        .offsets
                        .client_to_guest(&mut frame[VNET_HDR_LEN..], csum);
                }
                let _ = core.hand_to_guest(i, &frame);
            }
            for mut frame in core.sent_by_guest(i, BURST) {
                let csum = csum_of(&frame);
                if let Some(body) = frame.get_mut(VNET_HDR_LEN..) {
                    let _ = self.offsets.guest_to_client(body, csum);
                }
                tap.put(
                    frame,
                    &self.fence,
                    &mut core.counters,
                    &mut core.stages.release_to_tap,
                );
            }
        }
    }
}

/// Hands kept frame `k` to guest `i`, learning its offset (unless its
/// queue is full).
fn hand(core: &mut Core, offsets: &mut Offsets, i: usize, k: &mut Kept) -> Handed {
    let handed = core.hand_to_guest(i, &k.frame);
    if handed == Handed::Full {
        return handed;
    }
    if let Some(frame) = k.frame.get(VNET_HDR_LEN..) {
        offsets.learn(frame, k.offset);
    }
    if let Some(came) = k.came.take() {
        core.stages.link_to_guest.record(came.elapsed());
    }
    handed
}

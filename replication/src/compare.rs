//! The compare engine: the primary guest's outgoing frames are held until
//! the secondary guest sent the same; a match releases them, a mismatch
//! or a frame held past `compare_timeout` asks for a checkpoint, a full
//! queue drops and counts (or asks for a checkpoint, by policy).
//!
//! Inputs: [`Compare::primary`] (a frame the primary guest sent towards the
//! client; the engine owns it until released), [`Compare::secondary`]
//! (a frame the secondary guest sent, in its own sequence space: moved to
//! the primary's here, with the connection table), [`Compare::tick`], and
//! [`Compare::checkpoint_done`]. Outputs: [`Action`]s, appended to the
//! caller's list, and [`Counters`].
//!
//! The rules:
//! - **Pass-through** (ARP, not IP, fragments, other protocols, garbage,
//!   frames over [`MAX_FRAME`](crate::packet::MAX_FRAME)): released at once, counted.
//! - **TCP**, per connection, as two byte streams in the primary's
//!   sequence space: the secondary's payload bytes are buffered from the
//!   compare cursor on; each is compared with the primary's byte at the
//!   same position as soon as both exist, whatever the segment
//!   boundaries; a differing byte is a mismatch. A primary segment with
//!   payload is matched once all of its bytes were. Without payload: a
//!   SYN (FIN) is matched once the secondary sent a SYN (FIN) at the same
//!   position; an RST once the secondary sent an RST; a pure ACK once the
//!   secondary reached the same sequence position and acknowledged at
//!   least as much. Held segments leave in arrival order per connection.
//!   Bytes before the cursor (retransmissions) are not compared again; a
//!   secondary segment past a gap in its stream is ignored (counted).
//!   A secondary segment of a connection whose secondary ISN is known but
//!   not yet the primary's waits for it.
//! - **UDP and ICMP**, per flow, first in first out: the next secondary
//!   payload must equal the oldest held primary payload.
//! - A **mismatch**, or the oldest held frame waiting longer than
//!   `compare_timeout`, asks for a checkpoint; one at a time: no other is
//!   asked until [`Compare::checkpoint_done`], which releases every held
//!   frame in arrival order and drops the secondary's state.
//! - **Bounds**: at most `max_queue` held primary frames and `max_queue`
//!   held secondary frames (each at most [`MAX_FRAME`](crate::packet::MAX_FRAME) bytes); a frame
//!   over is dropped and counted. With [`QueueFull::Checkpoint`], a queue
//!   that fills up also asks for a checkpoint.
//!
//! Runs on the primary's compare thread, alone: no clock reads (times are
//! arguments), no I/O, no blocking, no growth past its bounds on any
//! input, no panic.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use serde::Serialize;
use thiserror::Error;

use crate::conntrack::{ConnTrack, ConnTrackConfig, ConnTrackError, Side};
use crate::histogram::Histogram;
use crate::packet::{parse, ConnKey, Frame, IcmpKey, PassReason, TcpSeg};
use crate::rewrite::{self, Csum, RewriteError};

#[path = "compare_tcp.rs"]
mod tcp;

use tcp::{Placed, Stream};

/// A held primary frame's number, in arrival order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct FrameId(pub u64);

/// Why a checkpoint is asked for: the scheduler's reasons (the compare
/// asks for `Mismatch`, `Timeout` and, with [`QueueFull::Checkpoint`],
/// `Queue`).
pub use crate::schedule::Reason;

/// What a full queue does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueueFull {
    /// Drop the new frame and count it (design §6: the measured better).
    #[default]
    Drop,
    /// Drop it too, and ask for a checkpoint as soon as a queue is full.
    Checkpoint,
}

/// The engine's bounds and policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompareConfig {
    /// How long a primary frame may wait for its match.
    pub compare_timeout: Duration,
    /// The most frames held on each side.
    pub max_queue: usize,
    /// What a full queue does.
    pub queue_full: QueueFull,
    /// The connection table.
    pub conntrack: ConnTrackConfig,
}

impl Default for CompareConfig {
    fn default() -> Self {
        CompareConfig {
            compare_timeout: Duration::from_millis(3000),
            max_queue: 1024,
            queue_full: QueueFull::Drop,
            conntrack: ConnTrackConfig::default(),
        }
    }
}

/// A configuration refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CompareError {
    /// `max_queue` is 0.
    #[error("the compare queues need room for at least one frame")]
    NoQueue,
    /// The connection table's configuration.
    #[error("connection table: {0}")]
    ConnTrack(#[from] ConnTrackError),
}

/// What the caller must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send this primary frame to the client.
    Release {
        /// Its number.
        id: FrameId,
        /// The frame, as the primary sent it.
        frame: Vec<u8>,
    },
    /// Take a checkpoint, then call [`Compare::checkpoint_done`].
    Checkpoint(Reason),
}

/// The engine's counters. Always:
/// `primary_frames == released + held + dropped_primary`, and
/// `released == matched + passed_through + oversize + released_at_checkpoint`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counters {
    /// Frames from the primary guest.
    pub primary_frames: u64,
    /// Frames from the secondary guest.
    pub secondary_frames: u64,
    /// Primary frames released on a match.
    pub matched: u64,
    /// Mismatches found (one per connection or flow until the checkpoint).
    pub mismatched: u64,
    /// Of those, by protocol.
    pub mismatched_by: ByProtocol,
    /// Checkpoints asked because a frame waited too long.
    pub timed_out: u64,
    /// Checkpoints asked because a queue filled up.
    pub queue_full: u64,
    /// Frames dropped on a full queue, both sides.
    pub dropped_full: u64,
    /// Of those, the primary's.
    pub dropped_primary: u64,
    /// Primary frames released uncompared (ARP, not IP…).
    pub passed_through: u64,
    /// Primary frames over `MAX_FRAME` bytes, released uncompared.
    pub oversize: u64,
    /// Primary frames released, all causes.
    pub released: u64,
    /// Of those, released by a checkpoint.
    pub released_at_checkpoint: u64,
    /// Secondary TCP segments ignored: past a gap in their stream.
    pub secondary_gaps: u64,
    /// Checkpoints done.
    pub checkpoints: u64,
    /// Connections evicted from the full connection table.
    pub conn_evictions: u64,
    /// Primary frames held now.
    pub held: u64,
    /// Secondary frames held now.
    pub held_secondary: u64,
}

/// Mismatches, by the protocol of the flow that diverged.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ByProtocol {
    pub tcp: u64,
    pub udp: u64,
    pub icmp: u64,
}

impl ByProtocol {
    fn add(&mut self, proto: Proto) {
        match proto {
            Proto::Tcp => self.tcp += 1,
            Proto::Udp => self.udp += 1,
            Proto::Icmp => self.icmp += 1,
        }
    }
}

/// Primary frames released by checkpoints, by the checkpoint's reason.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ByCheckpoint {
    pub period: u64,
    pub mismatch: u64,
    pub timeout: u64,
    pub queue: u64,
    pub demand: u64,
    pub disk: u64,
    /// The pair ended (alone): what was held went out uncompared.
    pub alone: u64,
}

impl ByCheckpoint {
    fn add(&mut self, reason: Option<Reason>, n: u64) {
        let slot = match reason {
            Some(Reason::Period) => &mut self.period,
            Some(Reason::Mismatch) => &mut self.mismatch,
            Some(Reason::Timeout) => &mut self.timeout,
            Some(Reason::Queue) => &mut self.queue,
            Some(Reason::Demand) => &mut self.demand,
            Some(Reason::Disk) => &mut self.disk,
            None => &mut self.alone,
        };
        *slot += n;
    }
}

/// How long primary frames were held, by what released them (a frame
/// passed through is not held: it is only counted).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Holds {
    /// Released by the secondary's matching output: how long that took
    /// after the primary's (near 0 when the secondary's came first).
    pub matched: Histogram,
    /// Released by a checkpoint (or the pair's end), whatever its reason.
    pub checkpoint: Histogram,
    /// Frames released by checkpoints, by the checkpoint's reason.
    pub checkpoint_by_reason: ByCheckpoint,
    /// And by their protocol (what the secondary did not match).
    pub checkpoint_by_protocol: ByProtocol,
    /// Frames released by a match, by protocol.
    pub matched_by_protocol: ByProtocol,
}

/// A held primary frame.
#[derive(Debug)]
struct Held {
    frame: Vec<u8>,
    at: Instant,
    proto: Proto,
}

/// A UDP or ICMP flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum FlowKey {
    Udp(ConnKey),
    Icmp(IcmpKey),
}

impl FlowKey {
    fn proto(&self) -> Proto {
        match self {
            FlowKey::Udp(_) => Proto::Udp,
            FlowKey::Icmp(_) => Proto::Icmp,
        }
    }
}

/// Which protocol a mismatch was found in.
#[derive(Clone, Copy, Debug)]
enum Proto {
    Tcp,
    Udp,
    Icmp,
}

/// A UDP or ICMP flow's queues.
#[derive(Debug, Default)]
struct Flow {
    /// Held primary frames and their payloads' offsets, oldest first.
    primary: VecDeque<(u64, Range<usize>)>,
    /// Secondary payloads not matched yet, oldest first.
    secondary: VecDeque<Vec<u8>>,
    /// A mismatch was found: nothing more is compared until the checkpoint.
    diverged: bool,
}

/// The compare engine.
#[derive(Debug)]
pub struct Compare {
    cfg: CompareConfig,
    conntrack: ConnTrack,
    held: BTreeMap<u64, Held>,
    streams: HashMap<ConnKey, Stream>,
    flows: HashMap<FlowKey, Flow>,
    next_id: u64,
    held_secondary: usize,
    pending: Option<Reason>,
    counters: Counters,
    holds: Holds,
}

impl Compare {
    /// An engine holding nothing.
    pub fn new(cfg: CompareConfig) -> Result<Compare, CompareError> {
        if cfg.max_queue == 0 {
            return Err(CompareError::NoQueue);
        }
        Ok(Compare {
            conntrack: ConnTrack::new(cfg.conntrack.clone())?,
            cfg,
            held: BTreeMap::new(),
            streams: HashMap::new(),
            flows: HashMap::new(),
            next_id: 0,
            held_secondary: 0,
            pending: None,
            counters: Counters::default(),
            holds: Holds::default(),
        })
    }

    /// A frame the primary guest sent.
    pub fn primary(&mut self, frame: Vec<u8>, now: Instant, out: &mut Vec<Action>) {
        self.counters.primary_frames += 1;
        let id = self.next_id;
        self.next_id += 1;
        match parse(&frame) {
            Frame::PassThrough(why) => {
                if why == PassReason::TooBig {
                    self.counters.oversize += 1;
                } else {
                    self.counters.passed_through += 1;
                }
                self.counters.released += 1;
                out.push(Action::Release {
                    id: FrameId(id),
                    frame,
                });
            }
            parsed => {
                if self.held.len() >= self.cfg.max_queue {
                    self.counters.dropped_full += 1;
                    self.counters.dropped_primary += 1;
                    self.queue_full(out);
                } else {
                    let proto = match parsed {
                        Frame::Udp { .. } => Proto::Udp,
                        Frame::Icmp { .. } => Proto::Icmp,
                        _ => Proto::Tcp,
                    };
                    self.held.insert(
                        id,
                        Held {
                            frame,
                            at: now,
                            proto,
                        },
                    );
                    self.hold(id, parsed, now, out);
                    if self.held.len() >= self.cfg.max_queue {
                        self.queue_full(out);
                    }
                }
            }
        }
        self.check_timeout(now, out);
        self.bound_streams();
        self.sync_counters();
    }

    fn hold(&mut self, id: u64, parsed: Frame, now: Instant, out: &mut Vec<Action>) {
        match parsed {
            Frame::Tcp(seg) => self.primary_tcp(id, &seg, now, out),
            Frame::Udp { conn, payload, .. } => {
                self.primary_flow(FlowKey::Udp(conn), id, payload, now, out);
            }
            Frame::Icmp { key, payload } => {
                self.primary_flow(FlowKey::Icmp(key), id, payload, now, out);
            }
            Frame::PassThrough(_) => {}
        }
    }

    /// A frame the secondary guest sent (its own sequence space).
    pub fn secondary(&mut self, frame: &[u8], now: Instant, out: &mut Vec<Action>) {
        self.counters.secondary_frames += 1;
        let parsed = parse(frame);
        if matches!(parsed, Frame::PassThrough(_)) {
            // Nothing to compare with: the primary's own is released.
        } else if self.held_secondary >= self.cfg.max_queue {
            self.counters.dropped_full += 1;
            self.queue_full(out);
        } else {
            match parsed {
                Frame::Tcp(seg) => self.secondary_tcp(&seg, frame, now, out),
                Frame::Udp { conn, payload, .. } => {
                    self.secondary_flow(FlowKey::Udp(conn), frame.get(payload), now, out);
                }
                Frame::Icmp { key, payload } => {
                    self.secondary_flow(FlowKey::Icmp(key), frame.get(payload), now, out);
                }
                Frame::PassThrough(_) => {}
            }
            if self.held_secondary >= self.cfg.max_queue {
                self.queue_full(out);
            }
        }
        self.check_timeout(now, out);
        self.bound_streams();
        self.sync_counters();
    }

    /// A client frame about to be mirrored to the secondary: recorded in
    /// the connection table, and its ack moved to the secondary's
    /// sequence space. Returns the offset it was moved by (`None`: not a
    /// TCP segment), which the secondary keeps ([`crate::survivor`]).
    pub fn client_to_secondary(
        &mut self,
        frame: &mut [u8],
        csum: Csum,
        now: Instant,
    ) -> Result<Option<u32>, RewriteError> {
        let Frame::Tcp(seg) = parse(frame) else {
            return Ok(None);
        };
        let offset = self
            .conntrack
            .observe(&seg, Side::Client, now)
            .offset()
            .unwrap_or(0);
        rewrite::client_to_secondary(frame, &seg, offset, csum)?;
        Ok(Some(offset))
    }

    /// Time passes: asks for a checkpoint when the oldest held frame
    /// waited too long; expires connections.
    pub fn tick(&mut self, now: Instant, out: &mut Vec<Action>) {
        self.check_timeout(now, out);
        self.conntrack.expire(now);
        self.forget_idle_streams();
        self.sync_counters();
    }

    /// The checkpoint asked for (or any other, taken for `reason`; `None`:
    /// the pair ended) is done: every held primary frame is released in
    /// arrival order; the secondary's state is dropped (it is a copy of the
    /// primary now, its offsets 0).
    pub fn checkpoint_done(&mut self, now: Instant, reason: Option<Reason>, out: &mut Vec<Action>) {
        let held = std::mem::take(&mut self.held);
        let n = held.len() as u64;
        for h in held.values() {
            self.holds
                .checkpoint
                .record(now.saturating_duration_since(h.at));
            self.holds.checkpoint_by_protocol.add(h.proto);
        }
        self.holds.checkpoint_by_reason.add(reason, n);
        out.extend(held.into_iter().map(|(id, h)| Action::Release {
            id: FrameId(id),
            frame: h.frame,
        }));
        self.counters.released += n;
        self.counters.released_at_checkpoint += n;
        self.counters.checkpoints += 1;
        for s in self.streams.values_mut() {
            s.checkpoint_done();
        }
        self.flows.clear();
        self.held_secondary = 0;
        self.pending = None;
        self.conntrack.checkpoint_done();
        self.forget_idle_streams();
        self.sync_counters();
    }

    /// How long until [`Compare::tick`] would ask for a checkpoint on its
    /// own (the oldest held frame's timeout); `None` while nothing is held
    /// or a checkpoint is asked already. The caller's poll timeout.
    pub fn next_deadline(&self, now: Instant) -> Option<Duration> {
        if self.pending.is_some() {
            return None;
        }
        let (_, oldest) = self.held.first_key_value()?;
        Some((oldest.at + self.cfg.compare_timeout).saturating_duration_since(now))
    }

    /// The number the next primary frame gets (its `Release` carries it).
    pub fn next_id(&self) -> FrameId {
        FrameId(self.next_id)
    }

    /// The counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// How long frames were held, by what released them.
    pub fn holds(&self) -> &Holds {
        &self.holds
    }

    /// The connection table.
    pub fn conntrack(&self) -> &ConnTrack {
        &self.conntrack
    }

    /// The checkpoint asked for and not done yet, if any.
    pub fn pending(&self) -> Option<Reason> {
        self.pending
    }

    /// The configuration.
    pub fn config(&self) -> &CompareConfig {
        &self.cfg
    }

    fn ask(&mut self, reason: Reason, out: &mut Vec<Action>) -> bool {
        if self.pending.is_some() {
            return false;
        }
        self.pending = Some(reason);
        out.push(Action::Checkpoint(reason));
        true
    }

    fn queue_full(&mut self, out: &mut Vec<Action>) {
        if self.cfg.queue_full == QueueFull::Checkpoint && self.ask(Reason::Queue, out) {
            self.counters.queue_full += 1;
        }
    }

    fn mismatch(&mut self, proto: Proto, out: &mut Vec<Action>) {
        self.counters.mismatched += 1;
        self.counters.mismatched_by.add(proto);
        self.ask(Reason::Mismatch, out);
    }

    fn check_timeout(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Some((_, oldest)) = self.held.first_key_value() else {
            return;
        };
        if now.saturating_duration_since(oldest.at) > self.cfg.compare_timeout
            && self.ask(Reason::Timeout, out)
        {
            self.counters.timed_out += 1;
        }
    }

    fn release(&mut self, id: u64, now: Instant, out: &mut Vec<Action>) {
        if let Some(h) = self.held.remove(&id) {
            self.holds
                .matched
                .record(now.saturating_duration_since(h.at));
            self.holds.matched_by_protocol.add(h.proto);
            self.counters.matched += 1;
            self.counters.released += 1;
            out.push(Action::Release {
                id: FrameId(id),
                frame: h.frame,
            });
        }
    }

    fn sync_counters(&mut self) {
        self.counters.held = self.held.len() as u64;
        self.counters.held_secondary = self.held_secondary as u64;
        self.counters.conn_evictions = self.conntrack.evictions();
    }

    /// Keeps the streams bounded between ticks: an idle stream of a
    /// connection evicted from the table is forgotten once there are
    /// twice as many streams as tracked connections and held frames can
    /// explain (amortised: half of them go each time).
    fn bound_streams(&mut self) {
        let explained = self
            .cfg
            .conntrack
            .max_entries
            .saturating_add(self.cfg.max_queue.saturating_mul(2));
        if self.streams.len() > explained.saturating_mul(2) {
            self.forget_idle_streams();
        }
    }

    /// Drops the streams that hold nothing of a connection no longer
    /// tracked.
    fn forget_idle_streams(&mut self) {
        let ct = &self.conntrack;
        self.streams
            .retain(|k, s| !s.is_empty() || ct.get(k).is_some());
    }
}

// TCP.
impl Compare {
    fn primary_tcp(&mut self, id: u64, seg: &TcpSeg, now: Instant, out: &mut Vec<Action>) {
        let offset = self.conntrack.observe(seg, Side::Primary, now).offset();
        let stream = self.streams.entry(seg.conn).or_default();
        stream.primary(id, seg);
        // The primary's SYN may be what waiting secondary frames needed.
        let waiting = match offset {
            Some(_) => std::mem::take(&mut stream.raw),
            None => VecDeque::new(),
        };
        self.held_secondary = self.held_secondary.saturating_sub(waiting.len());
        for frame in waiting {
            if let Frame::Tcp(s) = parse(&frame) {
                self.secondary_tcp_placed(&s, &frame, offset.unwrap_or(0), out);
            }
        }
        self.settle(seg.conn, now, out);
    }

    fn secondary_tcp(&mut self, seg: &TcpSeg, frame: &[u8], now: Instant, out: &mut Vec<Action>) {
        match self.conntrack.observe(seg, Side::Secondary, now).offset() {
            Some(offset) => {
                self.secondary_tcp_placed(seg, frame, offset, out);
                self.settle(seg.conn, now, out);
            }
            None => {
                self.streams
                    .entry(seg.conn)
                    .or_default()
                    .raw
                    .push_back(frame.to_vec());
                self.held_secondary += 1;
            }
        }
    }

    /// Adds a secondary segment's bytes to its stream and compares.
    fn secondary_tcp_placed(
        &mut self,
        seg: &TcpSeg,
        frame: &[u8],
        offset: u32,
        out: &mut Vec<Action>,
    ) {
        let stream = self.streams.entry(seg.conn).or_default();
        let before = stream.secondary_held();
        let payload = frame.get(seg.payload.clone()).unwrap_or(&[]);
        if stream.secondary(seg, offset, payload) == Placed::Gap {
            self.counters.secondary_gaps += 1;
        }
        let diverged = stream.advance(&self.held).is_err();
        let after = stream.secondary_held();
        self.held_secondary = (self.held_secondary + after).saturating_sub(before);
        if diverged {
            self.mismatch(Proto::Tcp, out);
        }
    }

    /// Compares what can be, releases what matched, and forgets the
    /// stream when it holds nothing and the connection is gone.
    fn settle(&mut self, key: ConnKey, now: Instant, out: &mut Vec<Action>) {
        let Some(stream) = self.streams.get_mut(&key) else {
            return;
        };
        let before = stream.secondary_held();
        let diverged = stream.advance(&self.held).is_err();
        let mut ids = Vec::new();
        stream.take_ready(&mut ids);
        let after = stream.secondary_held();
        let forget = stream.is_empty() && self.conntrack.get(&key).is_none();
        self.held_secondary = (self.held_secondary + after).saturating_sub(before);
        if forget {
            self.streams.remove(&key);
        }
        if diverged {
            self.mismatch(Proto::Tcp, out);
        }
        for id in ids {
            self.release(id, now, out);
        }
    }
}

// UDP and ICMP.
impl Compare {
    fn primary_flow(
        &mut self,
        key: FlowKey,
        id: u64,
        payload: Range<usize>,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        let flow = self.flows.entry(key).or_default();
        flow.primary.push_back((id, payload));
        self.match_flow(key, now, out);
    }

    fn secondary_flow(
        &mut self,
        key: FlowKey,
        payload: Option<&[u8]>,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        let flow = self.flows.entry(key).or_default();
        if !flow.diverged {
            flow.secondary.push_back(payload.unwrap_or(&[]).to_vec());
            self.held_secondary += 1;
        }
        self.match_flow(key, now, out);
    }

    /// Matches the flow's queues head to head, as far as they go.
    fn match_flow(&mut self, key: FlowKey, now: Instant, out: &mut Vec<Action>) {
        let Some(flow) = self.flows.get_mut(&key) else {
            return;
        };
        let mut ids = Vec::new();
        let mut diverged = false;
        while !flow.diverged {
            let (Some((id, range)), Some(s)) = (flow.primary.front(), flow.secondary.front())
            else {
                break;
            };
            let p = self.held.get(id).and_then(|h| h.frame.get(range.clone()));
            self.held_secondary = self.held_secondary.saturating_sub(1);
            if p == Some(s.as_slice()) {
                ids.push(*id);
                flow.primary.pop_front();
                flow.secondary.pop_front();
            } else {
                self.held_secondary = self.held_secondary.saturating_sub(flow.secondary.len() - 1);
                flow.secondary.clear();
                flow.diverged = true;
                diverged = true;
            }
        }
        if flow.primary.is_empty() && flow.secondary.is_empty() && !flow.diverged {
            self.flows.remove(&key);
        }
        if diverged {
            self.mismatch(key.proto(), out);
        }
        for id in ids {
            self.release(id, now, out);
        }
    }
}

#[cfg(test)]
#[path = "compare_tests.rs"]
mod tests;

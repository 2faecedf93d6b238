//! Receive segment coalescing (RSC): merges in-order TCP segments read from
//! the tap into one large GSO frame for the guest, so its stack handles one
//! packet instead of dozens (design §4 "RSC"). Pure logic: frames in, frames
//! out, time passed in; no I/O and no clock.
//!
//! Input frames are as read from a tap with `IFF_VNET_HDR`: a 12-byte
//! `virtio_net_hdr_v1`, then an Ethernet frame. They are hostile input: a
//! frame that is malformed or not a candidate is delivered untouched and
//! counted, never dropped, never a panic.
//!
//! # Flows and ordering
//! A flow is (IP version, source and destination address, source and
//! destination port); at most [`MAX_FLOWS`] have a pending (partly
//! coalesced) packet at once, the oldest being flushed to make room. The
//! frames of one flow leave in the order they came: any frame of a flow that
//! has a pending packet, whatever the frame is, first flushes that packet.
//! Frames of other flows, and non-TCP frames, are delivered at once.
//!
//! # Rules
//! *Delivered untouched* ([`PassCounters`]): not IPv4/IPv6 (ARP, VLAN-tagged,
//! ...), not TCP (UDP, ICMP, IPv6 extension headers count as `ip_options`),
//! SYN, IPv4 options (IHL != 5), IPv4 fragments or DF clear, ECN CE (see
//! below), a length that does not add up (frame shorter than the IP length,
//! TCP data offset), bad IPv4 header or TCP checksum, malformed TCP options,
//! a vnet header that already says GSO, and any IPv4 (IPv6) frame when the
//! guest cannot take TCPv4 (TCPv6) GSO frames ([`RscConfig`]).
//!
//! *Flush the flow, then deliver the frame* ([`FlushCounters`]): FIN, RST,
//! URG, ECE, CWR, AE, or no ACK; a pure ACK (no payload); a duplicate ACK (a
//! pure ACK with the pending packet's ack number and window, also counted
//! in the packet's duplicate-ACK count); a data segment out of order
//! (sequence number not the next expected one, or an ack number older than
//! the pending one); a window change.
//!
//! *Flush the flow, and the segment starts the next packet*: the segment
//! would take the IP packet over the size cap; its payload is larger than
//! the packet's MSS; its TCP options differ; its IP header differs in TOS or
//! TTL (IPv4), traffic class, flow label or hop limit (IPv6). These are
//! routine in a bulk transfer and the segment itself is a fine candidate.
//!
//! *Merge*: a data segment whose only flags are ACK and PSH, in order, with
//! an equal or newer ack number and the same window. PSH is merged, then
//! the packet is flushed (like Linux GRO: the sender wants it delivered).
//! A merged segment shorter than the MSS also ends the packet, so that all
//! its segments but the last are MSS-sized, as a GSO packet's are.
//!
//! *Options*: unlike QEMU, which bypasses any segment with TCP options,
//! segments with options are merged when their option bytes are identical
//! to the pending packet's except for a timestamp (kind 8, at the same
//! place): TSval may not go back, TSecr must be equal. The coalesced packet
//! keeps the last segment's options, ack number, window and flags.
//!
//! *Timer*: the first segment of a pending packet sets its deadline to
//! `now + interval`; [`Rsc::drain_expired`] (also run at the start of every
//! [`Rsc::input`]) flushes the packets whose deadline passed, and
//! [`Rsc::next_deadline`] tells when to call it.
//!
//! # Choices
//! *ECN*: a CE-marked segment is delivered untouched (congestion signals are
//! per segment); ECT(0)/ECT(1) segments are merged, but only with segments
//! of the same TOS/traffic class, so the marks stay truthful. ECE/CWR flush.
//!
//! *Size cap*: the coalesced IP packet (IP header + TCP header + payload,
//! i.e. the IPv4 total length, or 40 + the IPv6 payload length) is at most
//! `max_size`, itself at most 65535. The frame handed out is 12 + 14 bytes
//! longer.
//!
//! *MSS*: `gso_size` is the payload length of the packet's first segment; a
//! larger segment does not join, a smaller one joins as the last.
//!
//! *Input checksums*: with `DATA_VALID` the tap vouches for them; with
//! `NEEDS_CSUM` the segment comes from a sender on the host (the data never
//! crossed a wire) and its partial checksum must be the TCP one
//! (`csum_start` = the TCP header, `csum_offset` = 16); with neither, the
//! IPv4 header and TCP checksums are checked here. The IPv4 header checksum
//! is always checked.
//!
//! *Output*: a flow with a single segment is flushed as its original frame,
//! byte for byte. A coalesced frame gets its IPv4 total length / IPv6
//! payload length and IPv4 header checksum fixed, `gso_type` TCPV4/TCPV6,
//! `gso_size` = MSS, `hdr_len` = Ethernet + IP + TCP header length, and
//! `NEEDS_CSUM` with the TCP checksum field holding the pseudo-header sum
//! (`CHECKSUM_PARTIAL`). Without RSC_EXT, `csum_start` is the TCP header's
//! offset in the Ethernet frame and `csum_offset` 16: Linux 6.1's
//! `virtio_net_hdr_to_skb` needs exactly that for a TCP GSO frame (without
//! `NEEDS_CSUM` it has to dissect the frame to find the transport header),
//! and treats `CHECKSUM_PARTIAL` as verified on receive. With RSC_EXT,
//! `flags` also has `RSC_INFO`, `csum_start` is the number of coalesced
//! segments and `csum_offset` the duplicate-ACK count (virtio 1.2
//! §5.1.6.4.1: a GSO frame MUST have `NEEDS_CSUM`, the checksum field holds
//! the pseudo header, and with RSC_EXT the counts replace the csum fields).
//! `DATA_VALID` is not set: the spec asks for `NEEDS_CSUM` and the two say
//! contradictory things about the checksum field; NetKVM (the RSC_EXT
//! driver) ignores both flags on GSO frames and tells Windows the checksum
//! succeeded but its value is not to be checked.
//!
//! *Offloads*: IPv4 is coalesced only with GUEST_TSO4 and GUEST_CSUM
//! (GUEST_TSO6 for IPv6): the spec forbids GSO frames to a guest without
//! them, and `NEEDS_CSUM` needs GUEST_CSUM. RSC_EXT only changes the header
//! (QEMU enables RSC4 as RSC_EXT and GUEST_TSO4 likewise).

mod parse;

#[cfg(test)]
mod driver_tests;
#[cfg(test)]
mod pass_tests;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;
#[cfg(test)]
pub(crate) mod testutil;

use std::time::{Duration, Instant};

use serde::Serialize;

use super::features;
use parse::{
    classify, fold, pseudo_sum, sum, Class, FlowKey, Offload, Seg, Timestamp, ETH_HLEN, GSO_TCPV4,
    GSO_TCPV6, HDR_F_NEEDS_CSUM, HDR_F_RSC_INFO, IPV4_HLEN, IP_OFF, TCP_ACK, TCP_CSUM_OFF, TCP_CWR,
    TCP_ECE, TCP_FIN, TCP_HLEN, TCP_PSH, TCP_RST, TCP_URG,
};

/// Most flows with a pending packet at once.
pub const MAX_FLOWS: usize = 32;
/// Largest IP packet (and the most `max_size` can be).
pub const MAX_IP_LEN: usize = 65535;
/// Default drain interval.
pub const DEFAULT_INTERVAL: Duration = Duration::from_micros(300);

/// What the guest negotiated, and the engine's knobs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RscConfig {
    /// How long a pending packet may wait for more segments.
    pub interval: Duration,
    /// VIRTIO_NET_F_RSC_EXT: report segment and duplicate-ACK counts.
    pub rsc_ext: bool,
    /// VIRTIO_NET_F_GUEST_TSO4: the guest takes TCPv4 GSO frames.
    pub guest_tso4: bool,
    /// VIRTIO_NET_F_GUEST_TSO6.
    pub guest_tso6: bool,
    /// VIRTIO_NET_F_GUEST_CSUM: the guest takes partial checksums.
    pub guest_csum: bool,
    /// Cap on the coalesced IP packet length (clamped to 65535).
    pub max_size: usize,
}

impl Default for RscConfig {
    /// Nothing negotiated: every frame passes through.
    fn default() -> Self {
        RscConfig {
            interval: DEFAULT_INTERVAL,
            rsc_ext: false,
            guest_tso4: false,
            guest_tso6: false,
            guest_csum: false,
            max_size: MAX_IP_LEN,
        }
    }
}

impl RscConfig {
    /// The configuration for the features the driver acked.
    pub fn from_features(acked: u64) -> Self {
        RscConfig {
            rsc_ext: acked & features::RSC_EXT != 0,
            guest_tso4: acked & features::GUEST_TSO4 != 0,
            guest_tso6: acked & features::GUEST_TSO6 != 0,
            guest_csum: acked & features::GUEST_CSUM != 0,
            ..RscConfig::default()
        }
    }

    fn offload(&self) -> Offload {
        Offload {
            v4: self.guest_csum && self.guest_tso4,
            v6: self.guest_csum && self.guest_tso6,
        }
    }
}

/// Why pending packets were flushed (one count per packet).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FlushCounters {
    /// The next segment would have taken the packet over the size cap.
    pub size: u64,
    /// The next segment was larger than the packet's MSS.
    pub mss: u64,
    /// A segment shorter than the MSS was merged as the last one.
    pub short_segment: u64,
    /// The deadline passed.
    pub timer: u64,
    /// FIN, RST, URG, ECE, CWR, AE or no ACK.
    pub tcp_flags: u64,
    /// PSH merged.
    pub psh: u64,
    pub pure_ack: u64,
    pub dup_ack: u64,
    pub out_of_order: u64,
    pub window_change: u64,
    /// TCP options changed (other than a timestamp moving forward).
    pub options: u64,
    /// TOS/TTL (IPv4), traffic class/flow label/hop limit (IPv6) changed.
    pub header_change: u64,
    /// A frame of the flow had to be delivered untouched.
    pub pass_through_flow: u64,
    /// Room was needed for a new flow.
    pub evicted: u64,
    /// [`Rsc::flush_all`].
    pub flush_all: u64,
}

/// Why frames were delivered untouched without being considered.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PassCounters {
    pub not_ip: u64,
    pub not_tcp: u64,
    pub syn: u64,
    /// IPv4 options, IPv6 extension headers.
    pub ip_options: u64,
    /// IPv4 fragment, or DF clear.
    pub fragment: u64,
    /// ECN CE.
    pub ecn: u64,
    /// Truncated frame, inconsistent IP length or TCP data offset.
    pub bad_length: u64,
    pub bad_checksum: u64,
    /// The vnet header already says GSO.
    pub already_gso: u64,
    /// The guest cannot take GSO frames of this IP version.
    pub no_offload: u64,
    /// Malformed TCP options.
    pub tcp_options: u64,
}

/// Engine counters. Invariants: `received = sum(pass) + immediate + started
/// + coalesced`, and `delivered = sum(pass) + immediate + sum(flush)`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RscCounters {
    /// Frames fed to [`Rsc::input`].
    pub received: u64,
    /// Frames handed out.
    pub delivered: u64,
    /// Segments that started a pending packet.
    pub started: u64,
    /// Segments merged into an earlier one.
    pub coalesced: u64,
    /// Handed-out frames that hold more than one segment.
    pub coalesced_frames: u64,
    /// Valid TCP frames delivered as they are (control flags, pure ACKs,
    /// out of order, window change).
    pub immediate: u64,
    /// Duplicate ACKs seen while their flow had a pending packet.
    pub dup_acks: u64,
    /// [`Rsc::drain_expired`] runs that flushed something.
    pub timer_drains: u64,
    pub flush: FlushCounters,
    pub pass: PassCounters,
}

/// Why a frame is delivered untouched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PassReason {
    NotIp,
    NotTcp,
    Syn,
    IpOptions,
    Fragment,
    Ecn,
    BadLength,
    BadChecksum,
    AlreadyGso,
    NoOffload,
    TcpOptions,
}

/// Why a pending packet is flushed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushReason {
    Size,
    Mss,
    ShortSegment,
    Timer,
    TcpFlags,
    Psh,
    PureAck,
    DupAck,
    OutOfOrder,
    WindowChange,
    Options,
    HeaderChange,
    PassThroughFlow,
    Evicted,
    FlushAll,
}

impl PassCounters {
    fn bump(&mut self, r: PassReason) {
        let c = match r {
            PassReason::NotIp => &mut self.not_ip,
            PassReason::NotTcp => &mut self.not_tcp,
            PassReason::Syn => &mut self.syn,
            PassReason::IpOptions => &mut self.ip_options,
            PassReason::Fragment => &mut self.fragment,
            PassReason::Ecn => &mut self.ecn,
            PassReason::BadLength => &mut self.bad_length,
            PassReason::BadChecksum => &mut self.bad_checksum,
            PassReason::AlreadyGso => &mut self.already_gso,
            PassReason::NoOffload => &mut self.no_offload,
            PassReason::TcpOptions => &mut self.tcp_options,
        };
        *c += 1;
    }

    /// All pass-throughs.
    pub fn total(&self) -> u64 {
        self.not_ip
            + self.not_tcp
            + self.syn
            + self.ip_options
            + self.fragment
            + self.ecn
            + self.bad_length
            + self.bad_checksum
            + self.already_gso
            + self.no_offload
            + self.tcp_options
    }
}

impl FlushCounters {
    fn bump(&mut self, r: FlushReason) {
        let c = match r {
            FlushReason::Size => &mut self.size,
            FlushReason::Mss => &mut self.mss,
            FlushReason::ShortSegment => &mut self.short_segment,
            FlushReason::Timer => &mut self.timer,
            FlushReason::TcpFlags => &mut self.tcp_flags,
            FlushReason::Psh => &mut self.psh,
            FlushReason::PureAck => &mut self.pure_ack,
            FlushReason::DupAck => &mut self.dup_ack,
            FlushReason::OutOfOrder => &mut self.out_of_order,
            FlushReason::WindowChange => &mut self.window_change,
            FlushReason::Options => &mut self.options,
            FlushReason::HeaderChange => &mut self.header_change,
            FlushReason::PassThroughFlow => &mut self.pass_through_flow,
            FlushReason::Evicted => &mut self.evicted,
            FlushReason::FlushAll => &mut self.flush_all,
        };
        *c += 1;
    }

    /// All flushes.
    pub fn total(&self) -> u64 {
        self.size
            + self.mss
            + self.short_segment
            + self.timer
            + self.tcp_flags
            + self.psh
            + self.pure_ack
            + self.dup_ack
            + self.out_of_order
            + self.window_change
            + self.options
            + self.header_change
            + self.pass_through_flow
            + self.evicted
            + self.flush_all
    }
}

/// A packet being coalesced.
struct Pending {
    key: FlowKey,
    /// The first frame; from the second segment on, truncated to its IP
    /// packet, with every later payload appended and the TCP header fields
    /// of the latest segment.
    buf: Vec<u8>,
    /// End of the first frame's IP packet in `buf`.
    ip_end: usize,
    ip_hlen: usize,
    tcp_off: usize,
    tcp_hlen: usize,
    /// The IP packet length so far.
    ip_len: usize,
    next_seq: u32,
    ack: u32,
    window: u16,
    ip_sig: u64,
    ts: Option<Timestamp>,
    mss: usize,
    segs: u32,
    dup_acks: u32,
    deadline: Instant,
}

/// What to do with a data segment of a flow that has a pending packet.
enum Verdict {
    Merge,
    /// Flush, then deliver the segment untouched.
    FlushDeliver(FlushReason),
    /// Flush, then the segment starts a new packet.
    FlushRestart(FlushReason),
}

/// The RSC engine of one receive queue.
pub struct Rsc {
    cfg: RscConfig,
    cap: usize,
    /// Pending packets, oldest first.
    flows: Vec<Pending>,
    counters: RscCounters,
    /// For each frame appended to the caller's `out` since it was last
    /// empty, how many input frames it carries (see [`Rsc::take_inputs`]).
    emitted: Vec<u32>,
}

impl Rsc {
    pub fn new(cfg: RscConfig) -> Self {
        let cap = cfg.max_size.min(MAX_IP_LEN);
        Rsc {
            cfg,
            cap,
            flows: Vec::new(),
            counters: RscCounters::default(),
            emitted: Vec::new(),
        }
    }

    /// How many input frames each frame the engine appended to `out`
    /// carries, in `out`'s order (1, or a coalesced packet's segments);
    /// taken with the frames. Every input frame is in exactly one output
    /// frame or pending ([`Rsc::pending_inputs`]): a COLO primary tells its
    /// pair which received frames its guest has from these.
    pub fn take_inputs(&mut self) -> std::vec::Drain<'_, u32> {
        self.emitted.drain(..)
    }

    /// Forgets every pending packet (their frames were taken back).
    pub fn discard(&mut self) {
        self.flows.clear();
        self.emitted.clear();
    }

    /// Input frames in pending packets.
    pub fn pending_inputs(&self) -> u64 {
        self.flows.iter().map(|p| u64::from(p.segs)).sum()
    }

    /// A caller that emptied `out` and did not take the inputs: forget
    /// them (so that they stay as many as `out`'s frames).
    fn sync_emitted(&mut self, out: &[Vec<u8>]) {
        if out.is_empty() {
            self.emitted.clear();
        }
    }

    pub fn config(&self) -> &RscConfig {
        &self.cfg
    }

    pub fn counters(&self) -> &RscCounters {
        &self.counters
    }

    /// Flows with a pending packet.
    pub fn pending_flows(&self) -> usize {
        self.flows.len()
    }

    /// When [`Rsc::drain_expired`] next has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.flows.iter().map(|p| p.deadline).min()
    }

    /// Feeds one frame (vnet header + Ethernet frame) received at `now`.
    /// Appends to `out`, in order, the frames to deliver now.
    pub fn input(&mut self, frame: &[u8], now: Instant, out: &mut Vec<Vec<u8>>) {
        self.sync_emitted(out);
        self.counters.received += 1;
        self.drain_expired(now, out);
        match classify(frame, self.cfg.offload()) {
            Class::Pass(reason, key) => {
                self.counters.pass.bump(reason);
                if let Some(key) = key {
                    self.flush_key(&key, FlushReason::PassThroughFlow, out);
                }
                self.emit(frame.to_vec(), out);
            }
            Class::Tcp(seg) => self.tcp(frame, seg, now, out),
        }
    }

    /// Flushes every pending packet whose deadline is at or before `now`.
    pub fn drain_expired(&mut self, now: Instant, out: &mut Vec<Vec<u8>>) {
        self.sync_emitted(out);
        let before = out.len();
        let mut i = 0;
        while i < self.flows.len() {
            if self.flows[i].deadline <= now {
                self.flush_at(i, FlushReason::Timer, out);
            } else {
                i += 1;
            }
        }
        if out.len() > before {
            self.counters.timer_drains += 1;
        }
    }

    /// Flushes every pending packet, oldest first.
    pub fn flush_all(&mut self, out: &mut Vec<Vec<u8>>) {
        self.sync_emitted(out);
        while !self.flows.is_empty() {
            self.flush_at(0, FlushReason::FlushAll, out);
        }
    }

    /// Switches to `cfg` (the driver negotiated again): pending packets,
    /// built for the old configuration, are flushed into `out` first, as
    /// by [`Rsc::flush_all`]; the counters go on.
    pub fn reconfigure(&mut self, cfg: RscConfig, out: &mut Vec<Vec<u8>>) {
        self.flush_all(out);
        self.cap = cfg.max_size.min(MAX_IP_LEN);
        self.cfg = cfg;
    }

    fn tcp(&mut self, frame: &[u8], seg: Seg, now: Instant, out: &mut Vec<Vec<u8>>) {
        let idx = self.flows.iter().position(|p| p.key == seg.key);
        let control = seg.flags & (TCP_FIN | TCP_RST | TCP_URG | TCP_ECE | TCP_CWR) != 0
            || seg.ae
            || seg.flags & TCP_ACK == 0;
        if control || seg.payload_len == 0 {
            if let Some(i) = idx {
                let reason = if control {
                    FlushReason::TcpFlags
                } else if seg.ack == self.flows[i].ack && seg.window == self.flows[i].window {
                    self.flows[i].dup_acks += 1;
                    self.counters.dup_acks += 1;
                    FlushReason::DupAck
                } else {
                    FlushReason::PureAck
                };
                self.flush_at(i, reason, out);
            }
            self.counters.immediate += 1;
            self.emit(frame.to_vec(), out);
            return;
        }
        let i = match idx {
            None => self.start(frame, &seg, now, out),
            Some(i) => match self.verdict(i, frame, &seg) {
                Verdict::Merge => {
                    self.merge(i, frame, &seg);
                    i
                }
                Verdict::FlushDeliver(reason) => {
                    self.flush_at(i, reason, out);
                    self.counters.immediate += 1;
                    self.emit(frame.to_vec(), out);
                    return;
                }
                Verdict::FlushRestart(reason) => {
                    self.flush_at(i, reason, out);
                    self.start(frame, &seg, now, out)
                }
            },
        };
        if seg.flags & TCP_PSH != 0 {
            self.flush_at(i, FlushReason::Psh, out);
        } else if self.flows.get(i).is_some_and(|p| seg.payload_len < p.mss) {
            self.flush_at(i, FlushReason::ShortSegment, out);
        }
    }

    /// Starts a pending packet with `seg`; returns its index.
    fn start(&mut self, frame: &[u8], seg: &Seg, now: Instant, out: &mut Vec<Vec<u8>>) -> usize {
        if self.flows.len() >= MAX_FLOWS {
            self.flush_at(0, FlushReason::Evicted, out);
        }
        self.counters.started += 1;
        self.flows.push(Pending {
            key: seg.key,
            buf: frame.to_vec(),
            ip_end: seg.ip_end,
            ip_hlen: seg.ip_hlen,
            tcp_off: seg.tcp_off,
            tcp_hlen: seg.tcp_hlen,
            ip_len: seg.ip_end - IP_OFF,
            next_seq: seg.seq.wrapping_add(seg.payload_len as u32),
            ack: seg.ack,
            window: seg.window,
            ip_sig: seg.ip_sig,
            ts: seg.ts,
            mss: seg.payload_len,
            segs: 1,
            dup_acks: 0,
            deadline: now.checked_add(self.cfg.interval).unwrap_or(now),
        });
        self.flows.len() - 1
    }

    fn verdict(&self, i: usize, frame: &[u8], seg: &Seg) -> Verdict {
        let Some(p) = self.flows.get(i) else {
            return Verdict::FlushRestart(FlushReason::OutOfOrder);
        };
        if seg.seq != p.next_seq || (seg.ack.wrapping_sub(p.ack) as i32) < 0 {
            return Verdict::FlushDeliver(FlushReason::OutOfOrder);
        }
        if seg.window != p.window {
            return Verdict::FlushDeliver(FlushReason::WindowChange);
        }
        if seg.ip_sig != p.ip_sig {
            return Verdict::FlushRestart(FlushReason::HeaderChange);
        }
        if !same_options(p, frame, seg) {
            return Verdict::FlushRestart(FlushReason::Options);
        }
        if seg.payload_len > p.mss {
            return Verdict::FlushRestart(FlushReason::Mss);
        }
        if p.ip_len + seg.payload_len > self.cap {
            return Verdict::FlushRestart(FlushReason::Size);
        }
        Verdict::Merge
    }

    fn merge(&mut self, i: usize, frame: &[u8], seg: &Seg) {
        let Some(p) = self.flows.get_mut(i) else {
            return;
        };
        let Some(payload) = frame.get(seg.payload_off()..seg.payload_off() + seg.payload_len)
        else {
            return;
        };
        if p.segs == 1 {
            // Drop Ethernet padding after the first IP packet.
            p.buf.truncate(p.ip_end);
        }
        p.buf.extend_from_slice(payload);
        // The latest ack (8..12), flags and window (13..16), options.
        let t = p.tcp_off;
        for r in [8..12, 13..16, TCP_HLEN..p.tcp_hlen] {
            copy(&mut p.buf, frame, t + r.start..t + r.end);
        }
        p.ip_len += seg.payload_len;
        p.next_seq = p.next_seq.wrapping_add(seg.payload_len as u32);
        p.ack = seg.ack;
        p.ts = seg.ts;
        p.segs += 1;
        self.counters.coalesced += 1;
    }

    fn flush_key(&mut self, key: &FlowKey, reason: FlushReason, out: &mut Vec<Vec<u8>>) {
        if let Some(i) = self.flows.iter().position(|p| p.key == *key) {
            self.flush_at(i, reason, out);
        }
    }

    fn flush_at(&mut self, i: usize, reason: FlushReason, out: &mut Vec<Vec<u8>>) {
        if i >= self.flows.len() {
            return;
        }
        let p = self.flows.remove(i);
        self.counters.flush.bump(reason);
        let segs = p.segs;
        let frame = if p.segs > 1 {
            self.counters.coalesced_frames += 1;
            self.finish(p)
        } else {
            p.buf
        };
        self.emit_of(frame, segs, out);
    }

    /// Appends one input frame, as it came.
    fn emit(&mut self, frame: Vec<u8>, out: &mut Vec<Vec<u8>>) {
        self.emit_of(frame, 1, out);
    }

    /// Appends a frame that carries `inputs` input frames.
    fn emit_of(&mut self, frame: Vec<u8>, inputs: u32, out: &mut Vec<Vec<u8>>) {
        self.counters.delivered += 1;
        out.push(frame);
        self.emitted.push(inputs);
    }

    /// Fixes up a coalesced packet's headers.
    fn finish(&self, p: Pending) -> Vec<u8> {
        let mut b = p.buf;
        let ip_len = p.ip_len;
        let tcp_len = ip_len - p.ip_hlen;
        if p.key.v6 {
            put16(&mut b, IP_OFF + 4, (ip_len - p.ip_hlen) as u16);
        } else {
            put16(&mut b, IP_OFF + 2, ip_len as u16);
            put16(&mut b, IP_OFF + 10, 0);
            let c = b
                .get(IP_OFF..IP_OFF + IPV4_HLEN)
                .map_or(0, |h| !fold(sum(h, 0)));
            put16(&mut b, IP_OFF + 10, c);
        }
        // CHECKSUM_PARTIAL: the field holds the pseudo-header sum.
        let partial = fold(pseudo_sum(&p.key, tcp_len as u32));
        put16(&mut b, p.tcp_off + TCP_CSUM_OFF, partial);

        let (flags, csum_start, csum_offset) = if self.cfg.rsc_ext {
            (
                HDR_F_NEEDS_CSUM | HDR_F_RSC_INFO,
                p.segs.min(u32::from(u16::MAX)) as u16,
                p.dup_acks.min(u32::from(u16::MAX)) as u16,
            )
        } else {
            (
                HDR_F_NEEDS_CSUM,
                (ETH_HLEN + p.ip_hlen) as u16,
                TCP_CSUM_OFF as u16,
            )
        };
        let gso_type = if p.key.v6 { GSO_TCPV6 } else { GSO_TCPV4 };
        let hdr_len = (ETH_HLEN + p.ip_hlen + p.tcp_hlen) as u16;
        let mut h = [0u8; parse::VNET_HDR_LEN];
        h[0] = flags;
        h[1] = gso_type;
        h[2..4].copy_from_slice(&hdr_len.to_le_bytes());
        h[4..6].copy_from_slice(&(p.mss as u16).to_le_bytes());
        h[6..8].copy_from_slice(&csum_start.to_le_bytes());
        h[8..10].copy_from_slice(&csum_offset.to_le_bytes());
        if let Some(dst) = b.get_mut(..parse::VNET_HDR_LEN) {
            dst.copy_from_slice(&h);
        }
        b
    }
}

/// Whether `seg`'s TCP options may join `p`'s: same bytes except for a
/// timestamp at the same place, whose TSval does not go back and whose
/// TSecr is unchanged.
fn same_options(p: &Pending, frame: &[u8], seg: &Seg) -> bool {
    if seg.tcp_hlen != p.tcp_hlen {
        return false;
    }
    let (Some(old), Some(new)) = (
        p.buf.get(p.tcp_off + TCP_HLEN..p.tcp_off + p.tcp_hlen),
        frame.get(seg.tcp_off + TCP_HLEN..seg.tcp_off + seg.tcp_hlen),
    ) else {
        return false;
    };
    match (p.ts, seg.ts) {
        (None, None) => old == new,
        (Some(a), Some(b)) => {
            a.off == b.off
                && old.get(..a.off) == new.get(..b.off)
                && old.get(a.off + 8..) == new.get(b.off + 8..)
                && (b.val.wrapping_sub(a.val) as i32) >= 0
                && b.ecr == a.ecr
        }
        _ => false,
    }
}

/// Copies `range` of `src` over the same range of `dst`, if both have it.
fn copy(dst: &mut [u8], src: &[u8], range: std::ops::Range<usize>) {
    if let (Some(d), Some(s)) = (dst.get_mut(range.clone()), src.get(range)) {
        d.copy_from_slice(s);
    }
}

fn put16(b: &mut [u8], off: usize, v: u16) {
    if let Some(d) = b.get_mut(off..off + 2) {
        d.copy_from_slice(&v.to_be_bytes());
    }
}

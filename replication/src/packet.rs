//! One Ethernet frame from a tap (without the virtio-net header), parsed
//! once with etherparse into what the compare needs: a TCP segment, a UDP
//! datagram, an ICMP message, or a frame to pass through untouched.
//!
//! Owns: the classification ([`Frame`]) and the connection key
//! ([`ConnKey`]), the same for both directions of one connection.
//!
//! Runs on the primary's compare thread (and wherever a frame must be
//! rewritten). It must never panic on hostile input, never index out of
//! bounds, never allocate: a [`Frame`] holds offsets into the caller's
//! bytes, not copies. A frame it cannot classify is [`Frame::PassThrough`]
//! with the reason, never an error.

use std::net::IpAddr;
use std::ops::Range;

use etherparse::{NetSlice, SlicedPacket, TransportSlice};

/// The transport protocol of a [`ConnKey`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proto {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

/// One end of a connection: an address and a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    /// The IPv4 or IPv6 address.
    pub addr: IpAddr,
    /// The TCP or UDP port.
    pub port: u16,
}

/// Which way a frame goes along its connection, relative to the key's
/// canonical order (`ConnKey::a` is the smaller endpoint).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From `a` to `b`.
    AToB,
    /// From `b` to `a`.
    BToA,
}

/// A TCP or UDP connection, the same key for both directions: the two
/// endpoints are stored in canonical order (`a < b`), and
/// [`ConnKey::of`] says which way a given frame goes. Which end is the
/// guest is not part of the key: the caller knows it (a frame from a
/// guest's tap goes from the guest, a mirrored client frame goes to it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnKey {
    /// TCP or UDP.
    pub proto: Proto,
    /// The smaller endpoint.
    pub a: Endpoint,
    /// The larger endpoint.
    pub b: Endpoint,
}

impl ConnKey {
    /// The key of a frame from `src` to `dst`, and its direction.
    pub fn of(proto: Proto, src: Endpoint, dst: Endpoint) -> (ConnKey, Direction) {
        if src <= dst {
            (
                ConnKey {
                    proto,
                    a: src,
                    b: dst,
                },
                Direction::AToB,
            )
        } else {
            (
                ConnKey {
                    proto,
                    a: dst,
                    b: src,
                },
                Direction::BToA,
            )
        }
    }

    /// The sender and the receiver of a frame going `dir` on this key.
    pub fn ends(&self, dir: Direction) -> (Endpoint, Endpoint) {
        match dir {
            Direction::AToB => (self.a, self.b),
            Direction::BToA => (self.b, self.a),
        }
    }
}

/// An ICMP (v4 or v6) flow: the addresses as sent (not normalised: the
/// compare only looks at one direction), type, code, and the echo
/// identifier (0 for the types without one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IcmpKey {
    /// The sender.
    pub src: IpAddr,
    /// The receiver.
    pub dst: IpAddr,
    /// The ICMP type.
    pub ty: u8,
    /// The ICMP code.
    pub code: u8,
    /// The echo identifier, 0 for the other types.
    pub id: u16,
}

/// TCP flags, with the wire's bit values (byte 13 of the TCP header).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TcpFlags(pub u8);

impl TcpFlags {
    /// FIN.
    pub const FIN: u8 = 0x01;
    /// SYN.
    pub const SYN: u8 = 0x02;
    /// RST.
    pub const RST: u8 = 0x04;
    /// PSH.
    pub const PSH: u8 = 0x08;
    /// ACK.
    pub const ACK: u8 = 0x10;
    /// URG.
    pub const URG: u8 = 0x20;

    /// Whether all of `bits` are set.
    pub fn has(self, bits: u8) -> bool {
        self.0 & bits == bits
    }
}

/// A TCP segment: its connection, header fields, and where things are in
/// the frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpSeg {
    /// The connection.
    pub conn: ConnKey,
    /// The way the segment goes on it.
    pub dir: Direction,
    /// The sequence number.
    pub seq: u32,
    /// The acknowledgment number (meaningful with ACK only).
    pub ack: u32,
    /// The flags.
    pub flags: TcpFlags,
    /// The advertised window.
    pub window: u16,
    /// Offset of the TCP header in the frame.
    pub header: usize,
    /// The payload's offsets in the frame (Ethernet padding excluded).
    pub payload: Range<usize>,
}

impl TcpSeg {
    /// The payload's length in bytes.
    pub fn payload_len(&self) -> u32 {
        u32::try_from(self.payload.len()).unwrap_or(u32::MAX)
    }
}

/// Why a frame passes through uncompared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PassReason {
    /// An ARP frame.
    Arp,
    /// Not IP (another EtherType, or no network layer).
    NotIp,
    /// An IP fragment (the compare does not reassemble).
    Fragment,
    /// IP, but neither TCP, UDP nor ICMP.
    OtherProtocol,
    /// Truncated, a bad length, or otherwise unparseable.
    Malformed,
    /// Larger than [`MAX_FRAME`] bytes.
    TooBig,
}

/// A frame's classification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// A TCP segment.
    Tcp(TcpSeg),
    /// A UDP datagram.
    Udp {
        /// The connection.
        conn: ConnKey,
        /// The way the datagram goes on it.
        dir: Direction,
        /// The payload's offsets in the frame.
        payload: Range<usize>,
    },
    /// An ICMP (v4 or v6) message.
    Icmp {
        /// The flow.
        key: IcmpKey,
        /// The offsets of the message after its type, code and checksum
        /// (identifier, sequence and data for an echo).
        payload: Range<usize>,
    },
    /// Anything else, released uncompared.
    PassThrough(PassReason),
}

/// The largest frame the compare holds (a 64 KiB IP packet, its Ethernet
/// header and two VLAN tags); a larger one is passed through.
pub const MAX_FRAME: usize = 65550;

/// Where `part` starts in `base`, when it lies inside it.
fn offset_in(base: &[u8], part: &[u8]) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(base.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (end <= base.len()).then_some(start..end)
}

/// Classifies one Ethernet frame.
pub fn parse(frame: &[u8]) -> Frame {
    if frame.len() > MAX_FRAME {
        return Frame::PassThrough(PassReason::TooBig);
    }
    let Ok(sliced) = SlicedPacket::from_ethernet(frame) else {
        return Frame::PassThrough(PassReason::Malformed);
    };
    let (src, dst) = match &sliced.net {
        Some(NetSlice::Ipv4(ip)) => {
            if ip.is_payload_fragmented() {
                return Frame::PassThrough(PassReason::Fragment);
            }
            let h = ip.header();
            (IpAddr::from(h.source()), IpAddr::from(h.destination()))
        }
        Some(NetSlice::Ipv6(ip)) => {
            if ip.is_payload_fragmented() {
                return Frame::PassThrough(PassReason::Fragment);
            }
            let h = ip.header();
            (IpAddr::from(h.source()), IpAddr::from(h.destination()))
        }
        Some(NetSlice::Arp(_)) => return Frame::PassThrough(PassReason::Arp),
        None => return Frame::PassThrough(PassReason::NotIp),
    };
    let classified = match &sliced.transport {
        Some(TransportSlice::Tcp(tcp)) => tcp_frame(frame, tcp, src, dst),
        Some(TransportSlice::Udp(udp)) => {
            let (conn, dir) = ConnKey::of(
                Proto::Udp,
                Endpoint {
                    addr: src,
                    port: udp.source_port(),
                },
                Endpoint {
                    addr: dst,
                    port: udp.destination_port(),
                },
            );
            offset_in(frame, udp.payload()).map(|payload| Frame::Udp { conn, dir, payload })
        }
        Some(TransportSlice::Icmpv4(icmp)) => {
            let echo = matches!(icmp.type_u8(), 0 | 8 | 13 | 14);
            icmp_frame(frame, icmp.slice(), src, dst, echo)
        }
        Some(TransportSlice::Icmpv6(icmp)) => {
            let echo = matches!(icmp.type_u8(), 128 | 129);
            icmp_frame(frame, icmp.slice(), src, dst, echo)
        }
        Some(_) | None => Some(Frame::PassThrough(PassReason::OtherProtocol)),
    };
    classified.unwrap_or(Frame::PassThrough(PassReason::Malformed))
}

fn tcp_frame(
    frame: &[u8],
    tcp: &etherparse::TcpSlice<'_>,
    src: IpAddr,
    dst: IpAddr,
) -> Option<Frame> {
    let (conn, dir) = ConnKey::of(
        Proto::Tcp,
        Endpoint {
            addr: src,
            port: tcp.source_port(),
        },
        Endpoint {
            addr: dst,
            port: tcp.destination_port(),
        },
    );
    let header = offset_in(frame, tcp.header_slice())?;
    let flags = *tcp.header_slice().get(13)? & 0x3f;
    Some(Frame::Tcp(TcpSeg {
        conn,
        dir,
        seq: tcp.sequence_number(),
        ack: tcp.acknowledgment_number(),
        flags: TcpFlags(flags),
        window: tcp.window_size(),
        header: header.start,
        payload: offset_in(frame, tcp.payload())?,
    }))
}

fn icmp_frame(frame: &[u8], icmp: &[u8], src: IpAddr, dst: IpAddr, echo: bool) -> Option<Frame> {
    let ty = *icmp.first()?;
    let code = *icmp.get(1)?;
    let id = match (echo, icmp.get(4..6)) {
        (true, Some(&[hi, lo])) => u16::from_be_bytes([hi, lo]),
        _ => 0,
    };
    let payload = offset_in(frame, icmp.get(4..)?)?;
    Some(Frame::Icmp {
        key: IcmpKey {
            src,
            dst,
            ty,
            code,
            id,
        },
        payload,
    })
}

#[cfg(test)]
#[path = "packet_tests.rs"]
pub(crate) mod tests;

//! Tests of [`super::parse`], and the frame builders the other modules'
//! tests use (etherparse's `PacketBuilder`).

use std::net::IpAddr;

use etherparse::PacketBuilder;
use proptest::prelude::*;

use super::*;

const MAC_A: [u8; 6] = [2, 0, 0, 0, 0, 1];
const MAC_B: [u8; 6] = [2, 0, 0, 0, 0, 2];

/// IPv4 addresses of the guest and the client in the tests.
pub(crate) const GUEST4: [u8; 4] = [10, 0, 0, 2];
pub(crate) const CLIENT4: [u8; 4] = [10, 0, 0, 1];
/// IPv6 addresses of the guest and the client in the tests.
pub(crate) const GUEST6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
pub(crate) const CLIENT6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];

/// A TCP segment to build.
#[derive(Clone, Debug)]
pub(crate) struct Tcp {
    pub v6: bool,
    pub from_guest: bool,
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: Option<u32>,
    pub flags: u8,
    pub window: u16,
}

impl Tcp {
    /// A segment from the guest's port 80 to the client's port 40000.
    pub(crate) fn guest(seq: u32) -> Tcp {
        Tcp {
            v6: false,
            from_guest: true,
            sport: 80,
            dport: 40000,
            seq,
            ack: Some(1000),
            flags: 0,
            window: 512,
        }
    }

    /// The same segment from the client to the guest.
    pub(crate) fn client(seq: u32) -> Tcp {
        Tcp {
            from_guest: false,
            sport: 40000,
            dport: 80,
            ..Tcp::guest(seq)
        }
    }

    pub(crate) fn v6(self) -> Tcp {
        Tcp { v6: true, ..self }
    }

    pub(crate) fn flags(self, flags: u8) -> Tcp {
        Tcp { flags, ..self }
    }

    pub(crate) fn ack(self, ack: Option<u32>) -> Tcp {
        Tcp { ack, ..self }
    }

    /// The frame, checksums right.
    pub(crate) fn build(&self, payload: &[u8]) -> Vec<u8> {
        let eth = PacketBuilder::ethernet2(MAC_A, MAC_B);
        let ip = match (self.v6, self.from_guest) {
            (false, true) => eth.ipv4(GUEST4, CLIENT4, 64),
            (false, false) => eth.ipv4(CLIENT4, GUEST4, 64),
            (true, true) => eth.ipv6(GUEST6, CLIENT6, 64),
            (true, false) => eth.ipv6(CLIENT6, GUEST6, 64),
        };
        let mut b = ip.tcp(self.sport, self.dport, self.seq, self.window);
        if let Some(ack) = self.ack {
            b = b.ack(ack);
        }
        if self.flags & TcpFlags::SYN != 0 {
            b = b.syn();
        }
        if self.flags & TcpFlags::FIN != 0 {
            b = b.fin();
        }
        if self.flags & TcpFlags::RST != 0 {
            b = b.rst();
        }
        if self.flags & TcpFlags::PSH != 0 {
            b = b.psh();
        }
        let mut out = Vec::with_capacity(b.size(payload.len()));
        b.write(&mut out, payload).unwrap();
        out
    }
}

/// A UDP datagram from the guest (port 53 to 5353).
pub(crate) fn udp(v6: bool, payload: &[u8]) -> Vec<u8> {
    let eth = PacketBuilder::ethernet2(MAC_A, MAC_B);
    let b = if v6 {
        eth.ipv6(GUEST6, CLIENT6, 64)
    } else {
        eth.ipv4(GUEST4, CLIENT4, 64)
    };
    let b = b.udp(53, 5353);
    let mut out = Vec::new();
    b.write(&mut out, payload).unwrap();
    out
}

/// An echo reply from the guest.
pub(crate) fn echo_reply(v6: bool, id: u16, seq: u16, payload: &[u8]) -> Vec<u8> {
    let eth = PacketBuilder::ethernet2(MAC_A, MAC_B);
    let mut out = Vec::new();
    if v6 {
        let b = eth.ipv6(GUEST6, CLIENT6, 64).icmpv6_echo_reply(id, seq);
        b.write(&mut out, payload).unwrap();
    } else {
        let b = eth.ipv4(GUEST4, CLIENT4, 64).icmpv4_echo_reply(id, seq);
        b.write(&mut out, payload).unwrap();
    }
    out
}

/// An ARP request from the guest.
pub(crate) fn arp() -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&MAC_A);
    f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&MAC_A);
    f.extend_from_slice(&GUEST4);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&CLIENT4);
    f
}

fn tcp_of(frame: &[u8]) -> TcpSeg {
    match parse(frame) {
        Frame::Tcp(seg) => seg,
        other => panic!("not TCP: {other:?}"),
    }
}

#[test]
fn tcp_v4_fields_and_offsets() {
    let f = Tcp::guest(7).flags(TcpFlags::PSH).build(b"hello");
    let seg = tcp_of(&f);
    assert_eq!((seg.seq, seg.ack, seg.window), (7, 1000, 512));
    assert!(seg.flags.has(TcpFlags::ACK | TcpFlags::PSH));
    assert!(!seg.flags.has(TcpFlags::SYN));
    assert_eq!(seg.header, 14 + 20);
    assert_eq!(&f[seg.payload.clone()], b"hello");
    let (src, dst) = seg.conn.ends(seg.dir);
    assert_eq!((src.addr, src.port), (IpAddr::from(GUEST4), 80));
    assert_eq!((dst.addr, dst.port), (IpAddr::from(CLIENT4), 40000));
}

#[test]
fn both_directions_give_one_key() {
    for v6 in [false, true] {
        let g = Tcp::guest(1);
        let c = Tcp::client(1);
        let (g, c) = if v6 { (g.v6(), c.v6()) } else { (g, c) };
        let a = tcp_of(&g.build(b"x"));
        let b = tcp_of(&c.build(b"y"));
        assert_eq!(a.conn, b.conn);
        assert_ne!(a.dir, b.dir);
    }
}

#[test]
fn tcp_v6_payload() {
    let f = Tcp::guest(9).v6().flags(TcpFlags::SYN).ack(None).build(b"");
    let seg = tcp_of(&f);
    assert_eq!(seg.header, 14 + 40);
    assert!(seg.payload.is_empty());
    assert!(seg.flags.has(TcpFlags::SYN));
    assert!(!seg.flags.has(TcpFlags::ACK));
}

#[test]
fn padding_is_not_payload() {
    let mut f = Tcp::guest(1).build(b"");
    f.resize(60, 0);
    assert!(tcp_of(&f).payload.is_empty());
}

#[test]
fn udp_and_icmp() {
    for v6 in [false, true] {
        let f = udp(v6, b"dns");
        match parse(&f) {
            Frame::Udp { payload, conn, .. } => {
                assert_eq!(&f[payload], b"dns");
                assert_eq!(conn.proto, Proto::Udp);
            }
            other => panic!("{other:?}"),
        }
        let f = echo_reply(v6, 0x1234, 5, b"ping");
        match parse(&f) {
            Frame::Icmp { key, payload } => {
                assert_eq!(key.id, 0x1234);
                assert_eq!(key.ty, if v6 { 129 } else { 0 });
                assert_eq!(&f[payload], &[0x12, 0x34, 0, 5, b'p', b'i', b'n', b'g']);
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn pass_through_reasons() {
    assert_eq!(parse(&arp()), Frame::PassThrough(PassReason::Arp));
    assert_eq!(parse(&[]), Frame::PassThrough(PassReason::Malformed));
    let mut other = Tcp::guest(1).build(b"");
    other[12] = 0x88;
    other[13] = 0xb5;
    assert_eq!(parse(&other), Frame::PassThrough(PassReason::NotIp));
    let mut frag = udp(false, b"abc");
    frag[14 + 6] = 0x20; // more fragments
    assert_eq!(parse(&frag), Frame::PassThrough(PassReason::Fragment));
    let f = Tcp::guest(1).build(b"abcdef");
    assert_eq!(
        parse(&f[..f.len() - 3]),
        Frame::PassThrough(PassReason::Malformed)
    );
    assert_eq!(
        parse(&vec![0; MAX_FRAME + 1]),
        Frame::PassThrough(PassReason::TooBig)
    );
}

#[test]
fn vlan_tagged_tcp() {
    let b = PacketBuilder::ethernet2(MAC_A, MAC_B)
        .single_vlan(etherparse::VlanId::try_new(5).unwrap())
        .ipv4(GUEST4, CLIENT4, 64)
        .tcp(80, 40000, 3, 100);
    let mut f = Vec::new();
    b.write(&mut f, b"v").unwrap();
    let seg = tcp_of(&f);
    assert_eq!(seg.header, 18 + 20);
    assert_eq!(&f[seg.payload], b"v");
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        check_in_bounds(&bytes);
    }

    #[test]
    fn damaged_frames_never_panic(
        payload in proptest::collection::vec(any::<u8>(), 0..64),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
        cut in any::<prop::sample::Index>(),
        v6 in any::<bool>(),
    ) {
        let tcp = if v6 { Tcp::guest(1).v6() } else { Tcp::guest(1) };
        let mut f = tcp.build(&payload);
        let i = at.index(f.len());
        f[i] = byte;
        f.truncate(cut.index(f.len() + 1));
        check_in_bounds(&f);
    }
}

fn check_in_bounds(bytes: &[u8]) {
    match parse(bytes) {
        Frame::Tcp(seg) => {
            assert!(seg.payload.end <= bytes.len());
            assert!(seg.header + 20 <= seg.payload.start);
        }
        Frame::Udp { payload, .. } | Frame::Icmp { payload, .. } => {
            assert!(payload.end <= bytes.len());
        }
        Frame::PassThrough(_) => {}
    }
}

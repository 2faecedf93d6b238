//! Parsing of one frame as read from the tap: virtio-net header, Ethernet,
//! IPv4 or IPv6, TCP. The frame is hostile input: every read is
//! bounds-checked, and anything unexpected classifies the frame as a
//! pass-through with a reason (never a panic).

use super::PassReason;

pub use crate::virtio::net::backend::VNET_HDR_LEN;
/// Ethernet header without VLAN tag.
pub const ETH_HLEN: usize = 14;
/// Offset of the IP header in a frame.
pub const IP_OFF: usize = VNET_HDR_LEN + ETH_HLEN;
/// IPv4 header without options.
pub const IPV4_HLEN: usize = 20;
/// IPv6 fixed header.
pub const IPV6_HLEN: usize = 40;
/// TCP header without options.
pub const TCP_HLEN: usize = 20;
/// Offset of the checksum in the TCP header.
pub const TCP_CSUM_OFF: usize = 16;

/// `virtio_net_hdr.flags`.
pub const HDR_F_NEEDS_CSUM: u8 = 1;
pub const HDR_F_DATA_VALID: u8 = 2;
pub const HDR_F_RSC_INFO: u8 = 4;
/// `virtio_net_hdr.gso_type`.
pub const GSO_NONE: u8 = 0;
pub const GSO_TCPV4: u8 = 1;
pub const GSO_TCPV6: u8 = 4;

/// TCP flags (byte 13 of the header).
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_PSH: u8 = 0x08;
pub const TCP_ACK: u8 = 0x10;
pub const TCP_URG: u8 = 0x20;
pub const TCP_ECE: u8 = 0x40;
pub const TCP_CWR: u8 = 0x80;

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const ECN_CE: u8 = 3;

/// A TCP connection as seen from one direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub v6: bool,
    /// IPv4 addresses use the first 4 bytes.
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub sport: u16,
    pub dport: u16,
}

/// The TCP timestamp option of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timestamp {
    /// Offset of TSval from the start of the TCP options.
    pub off: usize,
    pub val: u32,
    pub ecr: u32,
}

/// A TCP segment that passed every sanity check: a coalescing candidate.
#[derive(Clone, Debug)]
pub struct Seg {
    pub key: FlowKey,
    /// 20 (IPv4 without options) or 40 (IPv6).
    pub ip_hlen: usize,
    /// Offset of the TCP header in the frame.
    pub tcp_off: usize,
    pub tcp_hlen: usize,
    pub payload_len: usize,
    /// Offset in the frame where the IP packet ends (Ethernet padding
    /// may follow).
    pub ip_end: usize,
    pub seq: u32,
    pub ack: u32,
    /// TCP flags byte.
    pub flags: u8,
    /// The AE (former NS) bit, byte 12 bit 0: accurate ECN.
    pub ae: bool,
    pub window: u16,
    /// IP header fields that must be equal in every segment of a
    /// coalesced packet: TOS (with the ECN bits) and TTL for IPv4; traffic
    /// class, flow label and hop limit for IPv6.
    pub ip_sig: u64,
    pub ts: Option<Timestamp>,
}

impl Seg {
    pub fn payload_off(&self) -> usize {
        self.tcp_off + self.tcp_hlen
    }
}

/// What a frame is.
#[derive(Debug)]
pub enum Class {
    /// Deliver untouched; if the frame belongs to a known TCP flow, its
    /// key (that flow must be flushed first).
    Pass(PassReason, Option<FlowKey>),
    Tcp(Seg),
}

/// Which IP versions may be coalesced at all.
#[derive(Clone, Copy, Debug)]
pub struct Offload {
    pub v4: bool,
    pub v6: bool,
}

fn be16(b: &[u8], off: usize) -> Option<u16> {
    let s: [u8; 2] = b.get(off..off.checked_add(2)?)?.try_into().ok()?;
    Some(u16::from_be_bytes(s))
}

fn be32(b: &[u8], off: usize) -> Option<u32> {
    let s: [u8; 4] = b.get(off..off.checked_add(4)?)?.try_into().ok()?;
    Some(u32::from_be_bytes(s))
}

fn le16(b: &[u8], off: usize) -> Option<u16> {
    let s: [u8; 2] = b.get(off..off.checked_add(2)?)?.try_into().ok()?;
    Some(u16::from_le_bytes(s))
}

fn addr<const N: usize>(b: &[u8], off: usize) -> Option<[u8; 16]> {
    let mut a = [0u8; 16];
    a.get_mut(..N)?
        .copy_from_slice(b.get(off..off.checked_add(N)?)?);
    Some(a)
}

/// The vnet header fields the classifier looks at.
struct VnetHdr {
    flags: u8,
    gso_type: u8,
    csum_start: u16,
    csum_offset: u16,
}

fn vnet_hdr(frame: &[u8]) -> Option<VnetHdr> {
    Some(VnetHdr {
        flags: *frame.first()?,
        gso_type: *frame.get(1)?,
        csum_start: le16(frame, 6)?,
        csum_offset: le16(frame, 8)?,
    })
}

/// Classifies one frame (vnet header + Ethernet frame).
pub fn classify(frame: &[u8], offload: Offload) -> Class {
    let Some(hdr) = vnet_hdr(frame) else {
        return Class::Pass(PassReason::BadLength, None);
    };
    let Some(ethertype) = be16(frame, VNET_HDR_LEN + 12) else {
        return Class::Pass(PassReason::BadLength, None);
    };
    let Some(ip) = frame.get(IP_OFF..) else {
        return Class::Pass(PassReason::BadLength, None);
    };
    let r = match ethertype {
        ETH_P_IP => ipv4(ip, &hdr, offload.v4),
        ETH_P_IPV6 => ipv6(ip, &hdr, offload.v6),
        _ => Err((PassReason::NotIp, None)),
    };
    match r {
        Ok(seg) => Class::Tcp(seg),
        Err((reason, key)) => Class::Pass(reason, key),
    }
}

type Res = Result<Seg, (PassReason, Option<FlowKey>)>;

fn ipv4(ip: &[u8], hdr: &VnetHdr, offload: bool) -> Res {
    let b0 = *ip.first().ok_or((PassReason::BadLength, None))?;
    if b0 >> 4 != 4 {
        return Err((PassReason::NotIp, None));
    }
    if ip.len() < IPV4_HLEN {
        return Err((PassReason::BadLength, None));
    }
    let ihl = usize::from(b0 & 0xf) * 4;
    if ihl < IPV4_HLEN {
        return Err((PassReason::BadLength, None));
    }
    if ip.get(9) != Some(&IPPROTO_TCP) {
        return Err((PassReason::NotTcp, None));
    }
    let frag = be16(ip, 6).unwrap_or(0);
    let (df, mf, frag_off) = (frag & 0x4000 != 0, frag & 0x2000 != 0, frag & 0x1fff);
    // The ports are only there in a first (or only) fragment.
    let key = if frag_off == 0 {
        (|| {
            Some(FlowKey {
                v6: false,
                src: addr::<4>(ip, 12)?,
                dst: addr::<4>(ip, 16)?,
                sport: be16(ip, ihl)?,
                dport: be16(ip, ihl + 2)?,
            })
        })()
    } else {
        None
    };
    let fail = |r: PassReason| Err((r, key));
    if hdr.gso_type != GSO_NONE {
        return fail(PassReason::AlreadyGso);
    }
    if !offload {
        return fail(PassReason::NoOffload);
    }
    if ihl != IPV4_HLEN {
        return fail(PassReason::IpOptions);
    }
    if mf || frag_off != 0 || !df {
        return fail(PassReason::Fragment);
    }
    let total = usize::from(be16(ip, 2).unwrap_or(0));
    if total < IPV4_HLEN + TCP_HLEN || total > ip.len() {
        return fail(PassReason::BadLength);
    }
    let Some(iph) = ip.get(..IPV4_HLEN) else {
        return fail(PassReason::BadLength);
    };
    if fold(sum(iph, 0)) != 0xffff {
        return fail(PassReason::BadChecksum);
    }
    let tos = ip.get(1).copied().unwrap_or(0);
    if tos & 3 == ECN_CE {
        return fail(PassReason::Ecn);
    }
    let ttl = ip.get(8).copied().unwrap_or(0);
    let Some(key) = key else {
        return fail(PassReason::BadLength);
    };
    let sig = (u64::from(tos) << 8) | u64::from(ttl);
    tcp(ip, IPV4_HLEN, total, key, sig, hdr)
}

/// IPv6 next-header values of extension headers (RFC 8200 and IANA).
fn is_ext_header(nh: u8) -> bool {
    matches!(nh, 0 | 43 | 44 | 50 | 51 | 60 | 135 | 139 | 140 | 253 | 254)
}

fn ipv6(ip: &[u8], hdr: &VnetHdr, offload: bool) -> Res {
    let b0 = *ip.first().ok_or((PassReason::BadLength, None))?;
    if b0 >> 4 != 6 {
        return Err((PassReason::NotIp, None));
    }
    if ip.len() < IPV6_HLEN {
        return Err((PassReason::BadLength, None));
    }
    let nh = ip.get(6).copied().unwrap_or(0);
    if nh != IPPROTO_TCP {
        let reason = if is_ext_header(nh) {
            PassReason::IpOptions
        } else {
            PassReason::NotTcp
        };
        return Err((reason, None));
    }
    let key = (|| {
        Some(FlowKey {
            v6: true,
            src: addr::<16>(ip, 8)?,
            dst: addr::<16>(ip, 24)?,
            sport: be16(ip, IPV6_HLEN)?,
            dport: be16(ip, IPV6_HLEN + 2)?,
        })
    })();
    let fail = |r: PassReason| Err((r, key));
    if hdr.gso_type != GSO_NONE {
        return fail(PassReason::AlreadyGso);
    }
    if !offload {
        return fail(PassReason::NoOffload);
    }
    // A payload length of 0 would be a jumbogram: not handled.
    let total = IPV6_HLEN + usize::from(be16(ip, 4).unwrap_or(0));
    if total < IPV6_HLEN + TCP_HLEN || total > ip.len() {
        return fail(PassReason::BadLength);
    }
    let word0 = be32(ip, 0).unwrap_or(0);
    let tclass = ((word0 >> 20) & 0xff) as u8;
    if tclass & 3 == ECN_CE {
        return fail(PassReason::Ecn);
    }
    let hop = ip.get(7).copied().unwrap_or(0);
    let Some(key) = key else {
        return fail(PassReason::BadLength);
    };
    let sig = (u64::from(word0) << 8) | u64::from(hop);
    tcp(ip, IPV6_HLEN, total, key, sig, hdr)
}

/// The TCP part, `ip[..total]` being the IP packet and `ip_hlen` its
/// header length.
fn tcp(ip: &[u8], ip_hlen: usize, total: usize, key: FlowKey, sig: u64, hdr: &VnetHdr) -> Res {
    let fail = |r: PassReason| Err((r, Some(key)));
    let Some(t) = ip.get(ip_hlen..total) else {
        return fail(PassReason::BadLength);
    };
    let b12 = t.get(12).copied().unwrap_or(0);
    let flags = t.get(13).copied().unwrap_or(0);
    let tcp_hlen = usize::from(b12 >> 4) * 4;
    if tcp_hlen < TCP_HLEN || tcp_hlen > t.len() {
        return fail(PassReason::BadLength);
    }
    if flags & TCP_SYN != 0 {
        return fail(PassReason::Syn);
    }
    // Checksum: valid per the tap (DATA_VALID), partial from a local
    // sender (NEEDS_CSUM: the data never crossed a wire), or checked here.
    if hdr.flags & HDR_F_NEEDS_CSUM != 0 {
        let start = ETH_HLEN + ip_hlen;
        if usize::from(hdr.csum_start) != start || usize::from(hdr.csum_offset) != TCP_CSUM_OFF {
            return fail(PassReason::BadChecksum);
        }
    } else if hdr.flags & HDR_F_DATA_VALID == 0 {
        let ps = pseudo_sum(&key, t.len() as u32);
        if fold(sum(t, ps)) != 0xffff {
            return fail(PassReason::BadChecksum);
        }
    }
    let Some(opts) = t.get(TCP_HLEN..tcp_hlen) else {
        return fail(PassReason::BadLength);
    };
    let Ok(ts) = timestamp(opts) else {
        return fail(PassReason::TcpOptions);
    };
    let field = |off: usize| be32(t, off).unwrap_or(0);
    Ok(Seg {
        key,
        ip_hlen,
        tcp_off: IP_OFF + ip_hlen,
        tcp_hlen,
        payload_len: t.len() - tcp_hlen,
        ip_end: IP_OFF + total,
        seq: field(4),
        ack: field(8),
        flags,
        ae: b12 & 1 != 0,
        window: be16(t, 14).unwrap_or(0),
        ip_sig: sig,
        ts,
    })
}

/// Walks the TCP options: `Err` if malformed, else the timestamp option if
/// there is exactly one (a second one is malformed too).
fn timestamp(opts: &[u8]) -> Result<Option<Timestamp>, ()> {
    let mut i = 0;
    let mut ts = None;
    while let Some(&kind) = opts.get(i) {
        match kind {
            0 => break,
            1 => i += 1,
            _ => {
                let len = usize::from(*opts.get(i + 1).ok_or(())?);
                if len < 2 || i + len > opts.len() {
                    return Err(());
                }
                if kind == 8 {
                    if len != 10 || ts.is_some() {
                        return Err(());
                    }
                    ts = Some(Timestamp {
                        off: i + 2,
                        val: be32(opts, i + 2).ok_or(())?,
                        ecr: be32(opts, i + 6).ok_or(())?,
                    });
                }
                i += len;
            }
        }
    }
    Ok(ts)
}

/// Ones'-complement sum of `data` as big-endian 16-bit words (an odd last
/// byte padded with zero), added to `init`. Not folded.
pub fn sum(data: &[u8], init: u64) -> u64 {
    let mut s = init;
    let mut words = data.chunks_exact(2);
    for w in &mut words {
        s += u64::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let Some(&last) = words.remainder().first() {
        s += u64::from(last) << 8;
    }
    s
}

/// Folds a sum to 16 bits.
pub fn fold(mut s: u64) -> u16 {
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// Sum of the TCP pseudo-header for a TCP length of `tcp_len`.
pub fn pseudo_sum(key: &FlowKey, tcp_len: u32) -> u64 {
    let n = if key.v6 { 16 } else { 4 };
    let s = sum(&key.src[..n], 0);
    let s = sum(&key.dst[..n], s);
    s + u64::from(IPPROTO_TCP) + u64::from(tcp_len >> 16) + u64::from(tcp_len & 0xffff)
}

//! Frames as a tap hands them over (12-byte virtio-net header, Ethernet,
//! IPv4 or IPv6, TCP), built with etherparse from a few fuzzer bytes, so
//! that the RSC engine sees segments with right checksums and real flows,
//! not only noise; and the TCP payload of a frame read back with etherparse.

use etherparse::{
    EtherType, Ethernet2Header, IpDscp, IpEcn, IpNumber, Ipv4Header, Ipv6FlowLabel, Ipv6Header,
    SlicedPacket, TcpHeader, TcpOptionElement, TransportSlice,
};

/// Size of the virtio-net header on every frame.
pub const VNET_HDR_LEN: usize = 12;
const NEEDS_CSUM: u8 = 1;
const DATA_VALID: u8 = 2;

/// How a segment's TCP checksum is presented.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Csum {
    /// Full checksum, no vnet flag: the engine checks it.
    Full,
    /// Full checksum and DATA_VALID.
    DataValid,
    /// Pseudo-header sum and NEEDS_CSUM (a sender on the host).
    Partial,
    /// A wrong full checksum.
    Bad,
}

/// One TCP segment to build.
#[derive(Clone, Debug)]
pub struct Segment {
    pub v6: bool,
    /// Tells flows apart (last byte of the source address, and the port).
    pub host: u8,
    pub seq: u32,
    pub ack: u32,
    pub window: u16,
    /// TCP flags byte (FIN 0x01 ... CWR 0x80).
    pub flags: u8,
    /// TSval, TSecr.
    pub ts: Option<(u32, u32)>,
    /// A second option (MSS) after the timestamp.
    pub extra_option: bool,
    pub payload_len: usize,
    /// Payload bytes are a function of this and the sequence number.
    pub stream: u8,
    /// IPv4 TOS / IPv6 traffic class (the low 2 bits are ECN).
    pub tos: u8,
    pub ttl: u8,
    pub df: bool,
    /// IPv4 options (4 NOPs).
    pub ip_options: bool,
    pub bad_ip_csum: bool,
    pub csum: Csum,
    /// `gso_type` in the vnet header (0: none).
    pub gso_type: u8,
}

const DST4: [u8; 4] = [10, 0, 0, 254];

fn dst6() -> [u8; 16] {
    let mut a = [0u8; 16];
    a[0] = 0xfd;
    a[15] = 0xfe;
    a
}

fn src6(host: u8) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[0] = 0xfd;
    a[15] = host;
    a
}

/// Payload byte `i` of stream `stream` at sequence `seq`.
fn payload(stream: u8, seq: u32, len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (seq.wrapping_add(i).wrapping_mul(2_654_435_761) >> 24) as u8 ^ stream)
        .collect()
}

/// Ones'-complement sum of `data` (big-endian 16-bit words) onto `acc`.
fn sum16(data: &[u8], mut acc: u32) -> u32 {
    for pair in data.chunks(2) {
        let hi = u32::from(pair[0]) << 8;
        let lo = pair.get(1).map_or(0, |&b| u32::from(b));
        acc += hi | lo;
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

impl Segment {
    /// vnet header + Ethernet + IP + TCP + payload.
    pub fn build(&self) -> Vec<u8> {
        let port = 5000 + u16::from(self.host);
        let mut tcp = TcpHeader::new(port, 40000, self.seq, self.window);
        tcp.acknowledgment_number = self.ack;
        tcp.fin = self.flags & 0x01 != 0;
        tcp.syn = self.flags & 0x02 != 0;
        tcp.rst = self.flags & 0x04 != 0;
        tcp.psh = self.flags & 0x08 != 0;
        tcp.ack = self.flags & 0x10 != 0;
        tcp.urg = self.flags & 0x20 != 0;
        tcp.ece = self.flags & 0x40 != 0;
        tcp.cwr = self.flags & 0x80 != 0;
        let mut opts = Vec::new();
        if let Some((val, ecr)) = self.ts {
            opts.extend([
                TcpOptionElement::Noop,
                TcpOptionElement::Noop,
                TcpOptionElement::Timestamp(val, ecr),
            ]);
        }
        if self.extra_option {
            opts.push(TcpOptionElement::MaximumSegmentSize(1460));
        }
        // At most 12 + 4 bytes: always fits the 40 bytes of options.
        let _ = tcp.set_options(&opts);
        let data = payload(self.stream, self.seq, self.payload_len);
        let tcp_len = tcp.header_len() + data.len();

        let (mut ip, full, pseudo) = if self.v6 {
            self.ipv6(&tcp, &data, tcp_len)
        } else {
            self.ipv4(&tcp, &data, tcp_len)
        };
        tcp.checksum = match self.csum {
            Csum::Full | Csum::DataValid => full,
            Csum::Partial => pseudo,
            Csum::Bad => full ^ 0x5a5a,
        };

        let mut f = vec![0u8; VNET_HDR_LEN];
        match self.csum {
            Csum::DataValid => f[0] = DATA_VALID,
            Csum::Partial => {
                f[0] = NEEDS_CSUM;
                f[6..8].copy_from_slice(&((14 + ip.len()) as u16).to_le_bytes());
                f[8..10].copy_from_slice(&16u16.to_le_bytes());
            }
            Csum::Full | Csum::Bad => {}
        }
        f[1] = self.gso_type;
        let eth = Ethernet2Header {
            source: [2, 0, 0, 0, 0, self.host],
            destination: [2, 0, 0, 0, 0, 0xfe],
            ether_type: if self.v6 {
                EtherType::IPV6
            } else {
                EtherType::IPV4
            },
        };
        f.extend_from_slice(&eth.to_bytes());
        f.append(&mut ip);
        f.extend_from_slice(&tcp.to_bytes());
        f.extend_from_slice(&data);
        f
    }

    /// The IPv6 header's bytes, the full TCP checksum and the pseudo sum.
    fn ipv6(&self, tcp: &TcpHeader, data: &[u8], tcp_len: usize) -> (Vec<u8>, u16, u16) {
        let ip = Ipv6Header {
            traffic_class: self.tos,
            flow_label: Ipv6FlowLabel::try_new(0x12345).unwrap_or_default(),
            payload_length: tcp_len as u16,
            next_header: IpNumber::TCP,
            hop_limit: self.ttl,
            source: src6(self.host),
            destination: dst6(),
        };
        let full = tcp.calc_checksum_ipv6(&ip, data).unwrap_or(0);
        let mut p = Vec::with_capacity(40);
        p.extend_from_slice(&ip.source);
        p.extend_from_slice(&ip.destination);
        p.extend_from_slice(&(tcp_len as u32).to_be_bytes());
        p.extend_from_slice(&[0, 0, 0, 6]);
        (ip.to_bytes().to_vec(), full, fold(sum16(&p, 0)))
    }

    /// The IPv4 header's bytes, the full TCP checksum and the pseudo sum.
    fn ipv4(&self, tcp: &TcpHeader, data: &[u8], tcp_len: usize) -> (Vec<u8>, u16, u16) {
        let src = [10, 0, 0, self.host];
        let total = u16::try_from(tcp_len).unwrap_or(u16::MAX);
        let Ok(mut ip) = Ipv4Header::new(total, self.ttl, IpNumber::TCP, src, DST4) else {
            return (Vec::new(), 0, 0);
        };
        ip.dscp = IpDscp::try_new(self.tos >> 2).unwrap_or_default();
        ip.ecn = IpEcn::try_new(self.tos & 3).unwrap_or_default();
        ip.identification = self.seq as u16;
        ip.dont_fragment = self.df;
        if self.ip_options {
            if let Ok(o) = (&[1u8, 1, 1, 1][..]).try_into() {
                ip.options = o;
                ip.total_len = ip.total_len.saturating_add(4);
            }
        }
        ip.header_checksum = ip.calc_header_checksum();
        if self.bad_ip_csum {
            ip.header_checksum ^= 0x0101;
        }
        let full = tcp.calc_checksum_ipv4(&ip, data).unwrap_or(0);
        let mut p = Vec::with_capacity(12);
        p.extend_from_slice(&src);
        p.extend_from_slice(&DST4);
        p.extend_from_slice(&[0, 6]);
        p.extend_from_slice(&(tcp_len as u16).to_be_bytes());
        (ip.to_bytes().to_vec(), full, fold(sum16(&p, 0)))
    }
}

/// The TCP payload of `frame` (vnet header first) as etherparse reads it:
/// its length and the sum of its bytes; zero for a frame that is not a
/// whole Ethernet/IP/TCP packet.
pub fn tcp_payload(frame: &[u8]) -> (u64, u64) {
    let Some(eth) = frame.get(VNET_HDR_LEN..) else {
        return (0, 0);
    };
    match SlicedPacket::from_ethernet(eth) {
        Ok(SlicedPacket {
            transport: Some(TransportSlice::Tcp(tcp)),
            ..
        }) => {
            let p = tcp.payload();
            (p.len() as u64, p.iter().map(|&b| u64::from(b)).sum())
        }
        _ => (0, 0),
    }
}

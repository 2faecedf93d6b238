//! Test helpers: building frames the way a tap hands them over (with
//! etherparse, checksums included), and reading output frames back the way
//! a guest would, checking their checksums independently of the engine.

use std::time::{Duration, Instant};

use etherparse::{
    EtherType, Ethernet2Header, IpDscp, IpEcn, IpFragOffset, IpNumber, Ipv4Header, Ipv6FlowLabel,
    Ipv6Header, NetSlice, SlicedPacket, TcpHeader, TcpOptionElement, TransportSlice,
};

use super::{Rsc, RscConfig};

pub const NEEDS_CSUM: u8 = 1;
pub const DATA_VALID: u8 = 2;
pub const RSC_INFO: u8 = 4;

/// How the input frame's TCP checksum is presented.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Csum {
    /// Full checksum, no vnet flag: the engine checks it.
    Full,
    /// Full checksum and DATA_VALID.
    DataValid,
    /// Partial (pseudo-header) checksum and NEEDS_CSUM, from a host sender.
    Partial,
    /// A wrong full checksum, no flag.
    Bad,
}

/// One TCP segment to build.
#[derive(Clone, Debug)]
pub struct Tcp {
    pub v6: bool,
    /// Last byte of the source address: tells flows apart.
    pub host: u8,
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    pub win: u16,
    pub psh: bool,
    pub fin: bool,
    pub syn: bool,
    pub rst: bool,
    pub urg: bool,
    pub ece: bool,
    pub cwr: bool,
    pub no_ack: bool,
    pub ts: Option<(u32, u32)>,
    /// Extra TCP options (after the timestamp, if any).
    pub opts: Vec<TcpOptionElement>,
    pub payload: Vec<u8>,
    pub ecn: u8,
    pub ttl: u8,
    pub df: bool,
    pub mf: bool,
    pub frag_off: u16,
    /// IPv4 options (4 bytes of NOPs).
    pub ip_opts: bool,
    pub bad_ip_csum: bool,
    pub csum: Csum,
    pub gso_type: u8,
}

/// Deterministic payload bytes: `len` bytes of stream `stream` from
/// offset `off`, so that misplaced or duplicated bytes show.
pub fn bytes(stream: u8, off: u32, len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| {
            let x = (off.wrapping_add(i)).wrapping_mul(2_654_435_761);
            (x >> 24) as u8 ^ stream
        })
        .collect()
}

impl Tcp {
    /// An IPv4 data segment of flow 1 at `seq` with `len` bytes of payload.
    pub fn v4(seq: u32, len: usize) -> Tcp {
        Tcp {
            v6: false,
            host: 1,
            sport: 5001,
            dport: 40000,
            seq,
            ack: 1000,
            win: 512,
            psh: false,
            fin: false,
            syn: false,
            rst: false,
            urg: false,
            ece: false,
            cwr: false,
            no_ack: false,
            ts: None,
            opts: Vec::new(),
            payload: bytes(1, seq, len),
            ecn: 0,
            ttl: 64,
            df: true,
            mf: false,
            frag_off: 0,
            ip_opts: false,
            bad_ip_csum: false,
            csum: Csum::Full,
            gso_type: 0,
        }
    }

    pub fn v6(seq: u32, len: usize) -> Tcp {
        Tcp {
            v6: true,
            ..Tcp::v4(seq, len)
        }
    }

    /// The segment that follows this one.
    pub fn next(&self, len: usize) -> Tcp {
        let seq = self.seq.wrapping_add(self.payload.len() as u32);
        Tcp {
            seq,
            payload: bytes(self.host, seq, len),
            psh: false,
            ..self.clone()
        }
    }

    pub fn with(mut self, f: impl FnOnce(&mut Tcp)) -> Tcp {
        f(&mut self);
        self
    }

    pub fn src4(&self) -> [u8; 4] {
        [10, 0, 0, self.host]
    }

    pub fn src6(&self) -> [u8; 16] {
        let mut a = [0u8; 16];
        a[0] = 0xfd;
        a[15] = self.host;
        a
    }

    /// vnet header + Ethernet + IP + TCP + payload.
    pub fn build(&self) -> Vec<u8> {
        let mut tcp = TcpHeader::new(self.sport, self.dport, self.seq, self.win);
        tcp.acknowledgment_number = self.ack;
        tcp.ack = !self.no_ack;
        tcp.psh = self.psh;
        tcp.fin = self.fin;
        tcp.syn = self.syn;
        tcp.rst = self.rst;
        tcp.urg = self.urg;
        tcp.ece = self.ece;
        tcp.cwr = self.cwr;
        let mut opts = Vec::new();
        if let Some((v, e)) = self.ts {
            opts.extend([
                TcpOptionElement::Noop,
                TcpOptionElement::Noop,
                TcpOptionElement::Timestamp(v, e),
            ]);
        }
        opts.extend(self.opts.iter().cloned());
        tcp.set_options(&opts).unwrap();
        let tcp_len = tcp.header_len() + self.payload.len();

        let eth = Ethernet2Header {
            source: [2, 0, 0, 0, 0, self.host],
            destination: [2, 0, 0, 0, 0, 0xfe],
            ether_type: if self.v6 {
                EtherType::IPV6
            } else {
                EtherType::IPV4
            },
        };
        let mut ip_bytes;
        let full;
        let pseudo;
        if self.v6 {
            let ip = Ipv6Header {
                traffic_class: self.ecn,
                flow_label: Ipv6FlowLabel::try_new(0x12345).unwrap(),
                payload_length: tcp_len as u16,
                next_header: IpNumber::TCP,
                hop_limit: self.ttl,
                source: self.src6(),
                destination: dst6(),
            };
            full = tcp.calc_checksum_ipv6(&ip, &self.payload).unwrap();
            pseudo = pseudo6(&self.src6(), &dst6(), tcp_len);
            ip_bytes = ip.to_bytes().to_vec();
        } else {
            let mut ip =
                Ipv4Header::new(tcp_len as u16, self.ttl, IpNumber::TCP, self.src4(), DST4)
                    .unwrap();
            ip.ecn = IpEcn::try_new(self.ecn).unwrap();
            ip.dscp = IpDscp::try_new(0).unwrap();
            ip.identification = self.seq as u16;
            ip.dont_fragment = self.df;
            ip.more_fragments = self.mf;
            ip.fragment_offset = IpFragOffset::try_new(self.frag_off).unwrap();
            if self.ip_opts {
                ip.options = (&[1u8, 1, 1, 1][..]).try_into().unwrap();
                ip.total_len += 4;
            }
            ip.header_checksum = ip.calc_header_checksum();
            if self.bad_ip_csum {
                ip.header_checksum ^= 0x0101;
            }
            full = tcp.calc_checksum_ipv4(&ip, &self.payload).unwrap();
            pseudo = pseudo4(&self.src4(), &DST4, tcp_len);
            ip_bytes = ip.to_bytes().to_vec();
        }
        let ip_hlen = ip_bytes.len();
        tcp.checksum = match self.csum {
            Csum::Full | Csum::DataValid => full,
            Csum::Partial => pseudo,
            Csum::Bad => full ^ 0x5a5a,
        };

        let mut f = vec![0u8; 12];
        match self.csum {
            Csum::DataValid => f[0] = DATA_VALID,
            Csum::Partial => {
                f[0] = NEEDS_CSUM;
                f[6..8].copy_from_slice(&((14 + ip_hlen) as u16).to_le_bytes());
                f[8..10].copy_from_slice(&16u16.to_le_bytes());
            }
            _ => {}
        }
        f[1] = self.gso_type;
        f.extend_from_slice(&eth.to_bytes());
        f.append(&mut ip_bytes);
        f.extend_from_slice(&tcp.to_bytes());
        f.extend_from_slice(&self.payload);
        f
    }
}

pub const DST4: [u8; 4] = [10, 0, 0, 254];

pub fn dst6() -> [u8; 16] {
    let mut a = [0u8; 16];
    a[0] = 0xfd;
    a[15] = 0xfe;
    a
}

/// Test-side ones'-complement arithmetic (independent of the engine's).
fn csum_add(data: &[u8], mut acc: u32) -> u32 {
    for (i, b) in data.iter().enumerate() {
        acc += if i % 2 == 0 {
            u32::from(*b) << 8
        } else {
            u32::from(*b)
        };
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc
}

fn fold16(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

fn pseudo4(src: &[u8; 4], dst: &[u8; 4], tcp_len: usize) -> u16 {
    let mut p = Vec::new();
    p.extend_from_slice(src);
    p.extend_from_slice(dst);
    p.extend_from_slice(&[0, 6]);
    p.extend_from_slice(&(tcp_len as u16).to_be_bytes());
    fold16(csum_add(&p, 0))
}

fn pseudo6(src: &[u8; 16], dst: &[u8; 16], tcp_len: usize) -> u16 {
    let mut p = Vec::new();
    p.extend_from_slice(src);
    p.extend_from_slice(dst);
    p.extend_from_slice(&(tcp_len as u32).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, 6]);
    fold16(csum_add(&p, 0))
}

/// The vnet header of an output frame, as a driver reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vnet {
    pub flags: u8,
    pub gso_type: u8,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
    pub num_buffers: u16,
}

pub fn vnet(frame: &[u8]) -> Vnet {
    let le = |o: usize| u16::from_le_bytes([frame[o], frame[o + 1]]);
    Vnet {
        flags: frame[0],
        gso_type: frame[1],
        hdr_len: le(2),
        gso_size: le(4),
        csum_start: le(6),
        csum_offset: le(8),
        num_buffers: le(10),
    }
}

/// An output frame taken apart (with etherparse).
#[derive(Clone, Debug)]
pub struct Out {
    pub vnet: Vnet,
    pub v6: bool,
    /// Last byte of the source address.
    pub host: u8,
    pub sport: u16,
    pub dport: u16,
    /// IPv4 total length, or 40 + IPv6 payload length.
    pub ip_len: usize,
    /// Offset of the TCP header in the Ethernet frame.
    pub tcp_off: usize,
    pub tcp_hlen: usize,
    pub tcp: TcpHeader,
    pub payload: Vec<u8>,
}

/// Parses an output frame that must be IP/TCP; panics otherwise.
pub fn parse(frame: &[u8]) -> Out {
    let eth = &frame[12..];
    let p = SlicedPacket::from_ethernet(eth).expect("output frame parses");
    let (v6, host, ip_len, ip_hlen) = match p.net.as_ref().expect("IP") {
        NetSlice::Ipv4(s) => {
            let h = s.header();
            (
                false,
                h.source()[3],
                usize::from(h.total_len()),
                h.slice().len(),
            )
        }
        NetSlice::Ipv6(s) => {
            let h = s.header();
            (
                true,
                h.source()[15],
                40 + usize::from(h.payload_length()),
                40,
            )
        }
        _ => panic!("not IP"),
    };
    let Some(TransportSlice::Tcp(t)) = p.transport.as_ref() else {
        panic!("not TCP");
    };
    Out {
        vnet: vnet(frame),
        v6,
        host,
        sport: t.source_port(),
        dport: t.destination_port(),
        ip_len,
        tcp_off: 14 + ip_hlen,
        tcp_hlen: t.slice().len() - t.payload().len(),
        tcp: t.to_header(),
        payload: t.payload().to_vec(),
    }
}

/// Checks an output frame's checksums as a guest would: the IPv4 header
/// checksum always; the TCP checksum after completing it the way the
/// vnet header says (`NEEDS_CSUM`: from `csum_start`, or from the TCP
/// header when `RSC_INFO` reuses the fields), compared with etherparse's.
pub fn check_checksums(frame: &[u8]) {
    let mut eth = frame[12..].to_vec();
    let o = parse(frame);
    let p = SlicedPacket::from_ethernet(&frame[12..]).unwrap();
    if let Some(NetSlice::Ipv4(s)) = p.net.as_ref() {
        let h = s.header().to_header();
        assert_eq!(h.header_checksum, h.calc_header_checksum(), "IPv4 header");
    }
    if o.vnet.flags & NEEDS_CSUM != 0 {
        let (start, off) = if o.vnet.flags & RSC_INFO != 0 {
            (o.tcp_off, 16)
        } else {
            (
                usize::from(o.vnet.csum_start),
                usize::from(o.vnet.csum_offset),
            )
        };
        assert_eq!(start, o.tcp_off, "csum_start is the TCP header");
        assert_eq!(off, 16, "csum_offset is the TCP checksum");
        let c = !fold16(csum_add(&eth[start..14 + o.ip_len], 0));
        eth[start + off..start + off + 2].copy_from_slice(&c.to_be_bytes());
    }
    let p = SlicedPacket::from_ethernet(&eth).unwrap();
    let Some(TransportSlice::Tcp(t)) = p.transport.as_ref() else {
        panic!("not TCP");
    };
    let h = t.to_header();
    let want = match p.net.as_ref().unwrap() {
        NetSlice::Ipv4(s) => h
            .calc_checksum_ipv4(&s.header().to_header(), t.payload())
            .unwrap(),
        NetSlice::Ipv6(s) => h
            .calc_checksum_ipv6(&s.header().to_header(), t.payload())
            .unwrap(),
        _ => unreachable!(),
    };
    assert_eq!(h.checksum, want, "TCP checksum");
}

/// Configurations.
pub fn linux() -> RscConfig {
    RscConfig {
        guest_tso4: true,
        guest_tso6: true,
        guest_csum: true,
        ..RscConfig::default()
    }
}

pub fn windows() -> RscConfig {
    RscConfig {
        rsc_ext: true,
        ..linux()
    }
}

/// An engine plus a clock and an output list.
pub struct Harness {
    pub rsc: Rsc,
    pub now: Instant,
    pub out: Vec<Vec<u8>>,
}

impl Harness {
    pub fn new(cfg: RscConfig) -> Self {
        let t0 = Instant::now();
        Harness {
            rsc: Rsc::new(cfg),
            now: t0,
            out: Vec::new(),
        }
    }

    pub fn feed(&mut self, s: &Tcp) {
        let f = s.build();
        self.rsc.input(&f, self.now, &mut self.out);
    }

    pub fn feed_raw(&mut self, f: &[u8]) {
        self.rsc.input(f, self.now, &mut self.out);
    }

    pub fn advance(&mut self, us: u64) {
        self.now += Duration::from_micros(us);
    }

    pub fn drain(&mut self) {
        self.rsc.drain_expired(self.now, &mut self.out);
    }

    pub fn flush(&mut self) {
        self.rsc.flush_all(&mut self.out);
    }

    /// Takes the output so far.
    pub fn take(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.out)
    }
}

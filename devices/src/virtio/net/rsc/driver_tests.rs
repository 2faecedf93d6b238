//! Driver-side harness: a guest that negotiated RSC_EXT (Windows NetKVM)
//! and one that did not (Linux). Coalesced frames go through `rx::deliver`
//! into mock guest memory with mergeable buffers, and are read back from
//! the used ring the way the drivers read them.

use super::testutil::*;
use super::*;
use crate::virtio::net::features::*;
use crate::virtio::net::rx::{deliver, RxOutcome};
use crate::virtio::test_util::{Driver, DATA};

const BUF: u32 = 4096;

/// A guest with `chains` posted 4 KiB receive buffers.
struct Guest {
    d: Driver,
    heads: Vec<u64>,
    seen: usize,
}

impl Guest {
    fn new(chains: u16) -> Self {
        let mut d = Driver::new(256);
        let heads = (0..chains)
            .map(|i| {
                let addr = DATA + u64::from(i) * u64::from(BUF);
                d.add_chain(&[(addr, BUF, true)]);
                addr
            })
            .collect();
        Guest { d, heads, seen: 0 }
    }

    /// Reads the next received packet: header + frame, over `num_buffers`
    /// used buffers.
    fn receive(&mut self) -> Vec<u8> {
        let used = self.d.used();
        let (head, len) = used[self.seen];
        let first = self.d.read(self.heads[head as usize], len as usize);
        let n = usize::from(vnet(&first).num_buffers);
        let mut pkt = first;
        for &(head, len) in &used[self.seen + 1..self.seen + n] {
            pkt.extend(self.d.read(self.heads[head as usize], len as usize));
        }
        self.seen += n;
        pkt
    }
}

/// What NetKVM makes of a received header (ParaNdis_PrepareReceivedPacket):
/// GSO frames are RSC frames; with RSC_INFO the counts come from the csum
/// fields.
#[derive(Debug, PartialEq, Eq)]
struct NetKvmView {
    rsc: bool,
    coalesced_segments: u16,
    dup_acks: u16,
    mss: u16,
}

fn netkvm_view(pkt: &[u8]) -> NetKvmView {
    let h = vnet(pkt);
    if h.gso_type == 0 {
        return NetKvmView {
            rsc: false,
            coalesced_segments: 1,
            dup_acks: 0,
            mss: 0,
        };
    }
    assert_ne!(h.flags & RSC_INFO, 0, "RSC_EXT negotiated: counts expected");
    NetKvmView {
        rsc: true,
        coalesced_segments: h.csum_start,
        dup_acks: h.csum_offset,
        mss: h.gso_size,
    }
}

fn send(rsc: &mut Rsc, g: &mut Guest, frames: &[Vec<u8>], now: Instant) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for f in frames {
        rsc.input(f, now, &mut out);
    }
    rsc.flush_all(&mut out);
    let mut q = g.d.queue();
    let mut got = Vec::new();
    for mut f in out {
        assert!(matches!(
            deliver(&mut q, &g.d.mem, &mut f, true),
            Ok(RxOutcome::Delivered(_))
        ));
        got.push(g.receive());
    }
    got
}

#[test]
fn windows_guest_reads_segment_and_dup_ack_counts() {
    let acked = GUEST_CSUM | GUEST_TSO4 | GUEST_TSO6 | MRG_RXBUF | RSC_EXT;
    let mut rsc = Rsc::new(RscConfig::from_features(acked));
    let mut g = Guest::new(200);

    // IPv4: 10 segments with timestamps, then a duplicate ACK.
    let mut v4 = vec![Tcp::v4(5000, 1448).with(|s| s.ts = Some((9, 3)))];
    for _ in 1..10 {
        let n = v4[v4.len() - 1].next(1448);
        v4.push(n);
    }
    let dup = Tcp::v4(5000 + 14480, 0).with(|s| s.ts = Some((9, 3)));
    // IPv6: 5 segments, the last one short.
    let mut v6 = vec![Tcp::v6(0, 1400).with(|s| s.host = 2)];
    for i in 1..5 {
        let n = v6[v6.len() - 1].next(if i == 4 { 100 } else { 1400 });
        v6.push(n);
    }
    let mut frames: Vec<Vec<u8>> = v4.iter().map(Tcp::build).collect();
    frames.push(dup.build());
    frames.extend(v6.iter().map(Tcp::build));

    let got = send(&mut rsc, &mut g, &frames, Instant::now());
    assert_eq!(got.len(), 3);

    let h = vnet(&got[0]);
    assert_eq!(
        h.flags,
        NEEDS_CSUM | RSC_INFO,
        "no DATA_VALID, see module doc"
    );
    assert_eq!(h.gso_type, 1, "TCPV4");
    assert_eq!(usize::from(h.hdr_len), 14 + 20 + 32);
    assert_eq!(h.num_buffers, 4, "14.5 KB over 4 KiB buffers");
    assert_eq!(
        netkvm_view(&got[0]),
        NetKvmView {
            rsc: true,
            coalesced_segments: 10,
            dup_acks: 1,
            mss: 1448,
        }
    );
    let o = parse(&got[0]);
    assert_eq!(o.payload.len(), 14480);
    check_checksums(&got[0]);

    assert!(!netkvm_view(&got[1]).rsc, "the dup ACK itself");
    assert_eq!(got[1][..10], dup.build()[..10]);

    assert_eq!(vnet(&got[2]).gso_type, 4, "TCPV6");
    assert_eq!(
        netkvm_view(&got[2]),
        NetKvmView {
            rsc: true,
            coalesced_segments: 5,
            dup_acks: 0,
            mss: 1400,
        }
    );
    check_checksums(&got[2]);
}

#[test]
fn linux_guest_gets_a_partial_checksum_gso_frame() {
    let acked = GUEST_CSUM | GUEST_TSO4 | GUEST_TSO6 | MRG_RXBUF;
    let mut rsc = Rsc::new(RscConfig::from_features(acked));
    let mut g = Guest::new(200);
    let mut segs = vec![Tcp::v4(1, 1448)];
    for _ in 1..44 {
        let n = segs[segs.len() - 1].next(1448);
        segs.push(n);
    }
    let frames: Vec<Vec<u8>> = segs.iter().map(Tcp::build).collect();
    let got = send(&mut rsc, &mut g, &frames, Instant::now());
    assert_eq!(got.len(), 1);
    let h = vnet(&got[0]);
    // What virtio_net_hdr_to_skb (Linux 6.1) needs for a TCPv4 GSO frame:
    // NEEDS_CSUM with the partial checksum at the TCP checksum.
    assert_eq!(h.flags, NEEDS_CSUM);
    assert_eq!((h.gso_type, h.gso_size), (1, 1448));
    assert_eq!((h.csum_start, h.csum_offset), (34, 16));
    assert_eq!(h.num_buffers, 16);
    let o = parse(&got[0]);
    assert_eq!(o.ip_len, 40 + 44 * 1448);
    // skb->len - (transport offset + 20) > gso_size: it is GSO.
    assert!(got[0].len() - 12 - (34 + 20) > usize::from(h.gso_size));
    check_checksums(&got[0]);
}

#[test]
fn a_guest_without_gso_gets_the_frames_as_they_came() {
    let mut rsc = Rsc::new(RscConfig::from_features(GUEST_CSUM | MRG_RXBUF));
    let mut g = Guest::new(16);
    let a = Tcp::v4(0, 1448);
    let frames = vec![a.build(), a.next(1448).build()];
    let got = send(&mut rsc, &mut g, &frames, Instant::now());
    assert_eq!(got.len(), 2);
    for (f, want) in got.iter().zip(&frames) {
        assert_eq!(f[12..], want[12..]);
        assert_eq!(vnet(f).gso_type, 0);
    }
}

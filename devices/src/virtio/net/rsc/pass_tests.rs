//! Unit tests: every reason to deliver a frame untouched.

use etherparse::{PacketBuilder, TcpOptionElement};

use super::testutil::*;
use super::*;

/// Feeds `frame` alone: it must come out untouched at once, counted by
/// `counter`, with nothing left pending.
fn passes(cfg: RscConfig, frame: &[u8], counter: impl Fn(&PassCounters) -> u64) {
    let mut h = Harness::new(cfg);
    h.feed_raw(frame);
    assert_eq!(h.take(), vec![frame.to_vec()]);
    let c = h.rsc.counters();
    assert_eq!(counter(&c.pass), 1, "{:?}", c.pass);
    assert_eq!(c.pass.total(), 1, "{:?}", c.pass);
    assert_eq!((c.received, c.delivered, c.started), (1, 1, 0));
    assert_eq!(h.rsc.pending_flows(), 0);
    assert_eq!(h.rsc.next_deadline(), None);
}

fn with_vnet(eth: Vec<u8>) -> Vec<u8> {
    let mut f = vec![0u8; 12];
    f.extend(eth);
    f
}

/// Fixes the IPv4 header checksum after a patch.
fn fix_ip_csum(f: &mut [u8]) {
    f[36..38].copy_from_slice(&[0, 0]);
    let mut s = 0u32;
    for w in f[26..46].chunks(2) {
        s += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    f[36..38].copy_from_slice(&(!(s as u16)).to_be_bytes());
}

#[test]
fn non_ip_frames_pass() {
    let f = |c: &PassCounters| c.not_ip;
    // ARP.
    let mut arp = vec![0xff; 6];
    arp.extend([2, 0, 0, 0, 0, 1, 0x08, 0x06]);
    arp.extend([0u8; 28]);
    passes(linux(), &with_vnet(arp), f);
    // VLAN-tagged IPv4/TCP.
    let mut v = Tcp::v4(0, 100).build();
    v.splice(24..24, [0x81, 0x00, 0x00, 0x05]);
    passes(linux(), &v, f);
    // Ethertype IPv4 but not version 4.
    let mut v = Tcp::v4(0, 100).build();
    v[26] = 0x65;
    passes(linux(), &v, f);
    let mut v = Tcp::v6(0, 100).build();
    v[26] = 0x45;
    passes(linux(), &v, f);
}

#[test]
fn non_tcp_frames_pass() {
    let f = |c: &PassCounters| c.not_tcp;
    let mut udp = Vec::new();
    PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
        .udp(53, 5353)
        .write(&mut udp, &[1, 2, 3])
        .unwrap();
    passes(linux(), &with_vnet(udp), f);
    let mut icmp = Vec::new();
    PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv6([0xfd; 16], [0xfe; 16], 64)
        .icmpv6_echo_request(1, 2)
        .write(&mut icmp, &[0; 8])
        .unwrap();
    passes(linux(), &with_vnet(icmp), f);
}

#[test]
fn syn_passes() {
    passes(
        linux(),
        &Tcp::v4(0, 0).with(|s| s.syn = true).build(),
        |c| c.syn,
    );
    let synack = Tcp::v6(0, 0).with(|s| s.syn = true).build();
    passes(linux(), &synack, |c| c.syn);
}

#[test]
fn ip_options_and_extension_headers_pass() {
    let f = |c: &PassCounters| c.ip_options;
    passes(
        linux(),
        &Tcp::v4(0, 100).with(|s| s.ip_opts = true).build(),
        f,
    );
    let mut v = Tcp::v6(0, 100).build();
    v[26 + 6] = 0; // hop-by-hop options
    passes(linux(), &v, f);
    v[26 + 6] = 44; // fragment header
    passes(linux(), &v, f);
}

#[test]
fn fragments_and_frames_without_df_pass() {
    let f = |c: &PassCounters| c.fragment;
    passes(linux(), &Tcp::v4(0, 100).with(|s| s.mf = true).build(), f);
    passes(
        linux(),
        &Tcp::v4(0, 100).with(|s| s.frag_off = 10).build(),
        f,
    );
    passes(linux(), &Tcp::v4(0, 100).with(|s| s.df = false).build(), f);
}

#[test]
fn ecn_ce_passes_but_ect_is_merged() {
    let f = |c: &PassCounters| c.ecn;
    passes(linux(), &Tcp::v4(0, 100).with(|s| s.ecn = 3).build(), f);
    passes(linux(), &Tcp::v6(0, 100).with(|s| s.ecn = 3).build(), f);
    for ect in [1, 2] {
        let mut h = Harness::new(linux());
        let a = Tcp::v4(0, 1000).with(|s| s.ecn = ect);
        h.feed(&a);
        h.feed(&a.next(1000));
        h.flush();
        assert_eq!(h.take().len(), 1, "ECT({}) merged", 2 - ect);
    }
}

#[test]
fn bad_lengths_pass() {
    let f = |c: &PassCounters| c.bad_length;
    let good = Tcp::v4(0, 100).with(|s| s.csum = Csum::DataValid).build();
    for n in [0, 5, 12, 20, 26, 30, 45, good.len() - 10] {
        passes(linux(), &good[..n], f);
    }
    let good6 = Tcp::v6(0, 100).with(|s| s.csum = Csum::DataValid).build();
    for n in [30, 65, 70, good6.len() - 1] {
        passes(linux(), &good6[..n], f);
    }
    // IPv4 total length too small, or larger than the frame.
    for len in [30u16, 39, 20 + 20 + 101] {
        let mut v = good.clone();
        v[28..30].copy_from_slice(&len.to_be_bytes());
        fix_ip_csum(&mut v);
        passes(linux(), &v, f);
    }
    // IPv6 payload length 0 (jumbogram) or too large.
    for len in [0u16, 19, 121] {
        let mut v = good6.clone();
        v[30..32].copy_from_slice(&len.to_be_bytes());
        passes(linux(), &v, f);
    }
    // TCP data offset under 5, or past the end of the segment.
    for off in [0x00, 0x40, 0xf0] {
        let mut v = Tcp::v4(0, 10).with(|s| s.csum = Csum::DataValid).build();
        v[46 + 12] = off;
        passes(linux(), &v, f);
    }
    // IHL under 5.
    let mut v = good.clone();
    v[26] = 0x44;
    passes(linux(), &v, f);
}

#[test]
fn bad_checksums_pass() {
    let f = |c: &PassCounters| c.bad_checksum;
    passes(
        linux(),
        &Tcp::v4(0, 100).with(|s| s.csum = Csum::Bad).build(),
        f,
    );
    passes(
        linux(),
        &Tcp::v6(0, 100).with(|s| s.csum = Csum::Bad).build(),
        f,
    );
    let bad_ip = Tcp::v4(0, 100).with(|s| {
        s.bad_ip_csum = true;
        s.csum = Csum::DataValid;
    });
    passes(linux(), &bad_ip.build(), f);
    // A partial checksum that is not the TCP one.
    let mut v = Tcp::v4(0, 100).with(|s| s.csum = Csum::Partial).build();
    v[6] += 2;
    passes(linux(), &v, f);
    let mut v = Tcp::v4(0, 100).with(|s| s.csum = Csum::Partial).build();
    v[8] = 6;
    passes(linux(), &v, f);
    // DATA_VALID vouches for the TCP checksum.
    let mut h = Harness::new(linux());
    let a = Tcp::v4(0, 100).with(|s| s.csum = Csum::Bad);
    let mut fa = a.build();
    fa[0] = DATA_VALID;
    h.feed_raw(&fa);
    assert_eq!(h.rsc.pending_flows(), 1);
}

#[test]
fn malformed_tcp_options_pass() {
    let f = |c: &PassCounters| c.tcp_options;
    let mss = |len_byte: u8| {
        let mut v = Tcp::v4(0, 100)
            .with(|s| {
                s.opts = vec![TcpOptionElement::MaximumSegmentSize(1460)];
                s.csum = Csum::DataValid;
            })
            .build();
        v[66 + 1] = len_byte;
        v
    };
    passes(linux(), &mss(1), f); // length under 2
    passes(linux(), &mss(9), f); // past the options
    let two_ts = Tcp::v4(0, 100).with(|s| {
        s.ts = Some((1, 2));
        s.opts = vec![
            TcpOptionElement::Noop,
            TcpOptionElement::Noop,
            TcpOptionElement::Timestamp(3, 4),
        ];
    });
    passes(linux(), &two_ts.build(), f);
    // A timestamp with the wrong length.
    let mut v = Tcp::v4(0, 100)
        .with(|s| {
            s.ts = Some((1, 2));
            s.csum = Csum::DataValid;
        })
        .build();
    v[66 + 3] = 8;
    passes(linux(), &v, f);
    // Well-formed but unusual options are fine (and EOL ends the list).
    let mut h = Harness::new(linux());
    let a = Tcp::v4(0, 100).with(|s| {
        s.opts = vec![
            TcpOptionElement::WindowScale(7),
            TcpOptionElement::Noop,
            TcpOptionElement::Noop,
            TcpOptionElement::Noop,
            TcpOptionElement::Noop,
        ];
    });
    h.feed(&a);
    assert_eq!(h.rsc.pending_flows(), 1);
}

#[test]
fn frames_already_gso_pass() {
    let f = |c: &PassCounters| c.already_gso;
    passes(
        linux(),
        &Tcp::v4(0, 100).with(|s| s.gso_type = 1).build(),
        f,
    );
    passes(
        linux(),
        &Tcp::v6(0, 100).with(|s| s.gso_type = 4).build(),
        f,
    );
    passes(
        linux(),
        &Tcp::v4(0, 100).with(|s| s.gso_type = 0x81).build(),
        f,
    );
}

#[test]
fn without_offloads_nothing_is_merged() {
    let f = |c: &PassCounters| c.no_offload;
    let v4 = Tcp::v4(0, 100).build();
    let v6 = Tcp::v6(0, 100).build();
    let none = RscConfig::default();
    passes(none.clone(), &v4, f);
    passes(none, &v6, f);
    let tso4 = RscConfig {
        guest_tso6: false,
        ..linux()
    };
    passes(tso4.clone(), &v6, f);
    let mut h = Harness::new(tso4);
    h.feed_raw(&v4);
    assert_eq!(h.rsc.pending_flows(), 1, "IPv4 still coalesced");
    let tso6 = RscConfig {
        guest_tso4: false,
        ..windows()
    };
    passes(tso6, &v4, f);
    let no_csum = RscConfig {
        guest_csum: false,
        ..linux()
    };
    passes(no_csum.clone(), &v4, f);
    passes(no_csum, &v6, f);
    let ext_only = RscConfig {
        rsc_ext: true,
        ..RscConfig::default()
    };
    passes(ext_only, &v4, f);
}

#[test]
fn pure_acks_and_control_frames_without_a_flow_go_out_at_once() {
    let mut h = Harness::new(linux());
    let frames = [
        Tcp::v4(0, 0),
        Tcp::v4(0, 0),
        Tcp::v4(0, 100).with(|s| s.fin = true),
        Tcp::v6(0, 100).with(|s| s.rst = true),
    ];
    for f in &frames {
        h.feed(f);
    }
    let want: Vec<Vec<u8>> = frames.iter().map(Tcp::build).collect();
    assert_eq!(h.take(), want);
    let c = h.rsc.counters();
    assert_eq!((c.immediate, c.dup_acks, c.flush.total()), (4, 0, 0));
}

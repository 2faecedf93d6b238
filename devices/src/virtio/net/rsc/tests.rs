//! Unit tests: coalescing, output headers, flush rules, ordering, timer.

use etherparse::TcpOptionElement;

use super::testutil::*;
use super::*;

/// A bulk burst of `n` MSS-sized segments of flow `s`, the first being `s`.
fn burst(s: &Tcp, n: usize) -> Vec<Tcp> {
    let mut v = vec![s.clone()];
    for _ in 1..n {
        let next = v[v.len() - 1].next(s.payload.len());
        v.push(next);
    }
    v
}

fn concat(segs: &[Tcp]) -> Vec<u8> {
    segs.iter().flat_map(|s| s.payload.clone()).collect()
}

#[test]
fn merges_in_order_ipv4_segments() {
    let mut h = Harness::new(linux());
    let segs = burst(&Tcp::v4(1000, 1448), 4);
    for s in &segs {
        h.feed(s);
    }
    assert!(h.out.is_empty(), "all four are held");
    assert_eq!(h.rsc.pending_flows(), 1);
    h.flush();
    let out = h.take();
    assert_eq!(out.len(), 1);
    let o = parse(&out[0]);
    assert_eq!((o.v6, o.host, o.sport, o.dport), (false, 1, 5001, 40000));
    assert_eq!(o.payload, concat(&segs));
    assert_eq!(o.tcp.sequence_number, 1000);
    assert_eq!(o.ip_len, 20 + 20 + 4 * 1448);
    assert_eq!(
        o.vnet,
        Vnet {
            flags: NEEDS_CSUM,
            gso_type: 1,
            hdr_len: 14 + 20 + 20,
            gso_size: 1448,
            csum_start: 14 + 20,
            csum_offset: 16,
            num_buffers: 0,
        }
    );
    check_checksums(&out[0]);
    let c = h.rsc.counters();
    assert_eq!(
        (
            c.received,
            c.started,
            c.coalesced,
            c.delivered,
            c.coalesced_frames
        ),
        (4, 1, 3, 1, 1)
    );
    assert_eq!(c.flush.flush_all, 1);
}

#[test]
fn merges_ipv6_segments() {
    let mut h = Harness::new(linux());
    let segs = burst(&Tcp::v6(7, 1428), 3);
    for s in &segs {
        h.feed(s);
    }
    h.flush();
    let out = h.take();
    assert_eq!(out.len(), 1);
    let o = parse(&out[0]);
    assert!(o.v6);
    assert_eq!(o.payload, concat(&segs));
    assert_eq!(o.ip_len, 40 + 20 + 3 * 1428);
    assert_eq!(o.vnet.gso_type, 4);
    assert_eq!(o.vnet.gso_size, 1428);
    assert_eq!(o.vnet.hdr_len, 14 + 40 + 20);
    assert_eq!((o.vnet.csum_start, o.vnet.csum_offset), (14 + 40, 16));
    check_checksums(&out[0]);
}

#[test]
fn merges_segments_with_timestamps_keeping_the_last_options() {
    let mut h = Harness::new(linux());
    let a = Tcp::v4(0, 1436).with(|s| s.ts = Some((100, 7)));
    let b = a.next(1436);
    let c = b.next(1436).with(|s| {
        s.ts = Some((101, 7));
        s.ack = 1500;
    });
    for s in [&a, &b, &c] {
        h.feed(s);
    }
    h.flush();
    let out = h.take();
    assert_eq!(out.len(), 1, "TSval may move forward");
    let o = parse(&out[0]);
    assert_eq!(o.vnet.hdr_len, 14 + 20 + 32);
    assert_eq!(o.tcp_hlen, 32);
    assert_eq!(
        o.tcp.options.elements_iter().last().unwrap().unwrap(),
        TcpOptionElement::Timestamp(101, 7)
    );
    assert_eq!(o.tcp.acknowledgment_number, 1500, "last ack");
    assert_eq!(o.payload, concat(&[a, b, c]));
    check_checksums(&out[0]);
}

#[test]
fn merges_whatever_the_input_checksum_form() {
    for (i, csum) in [Csum::Full, Csum::DataValid, Csum::Partial]
        .into_iter()
        .enumerate()
    {
        let mut h = Harness::new(linux());
        let segs = burst(&Tcp::v4(0, 1000).with(|s| s.csum = csum), 3);
        // Mixed forms within one packet too.
        let segs: Vec<Tcp> = segs
            .into_iter()
            .enumerate()
            .map(|(j, s)| {
                if j == 2 && i > 0 {
                    s.with(|s| s.csum = Csum::Full)
                } else {
                    s
                }
            })
            .collect();
        for s in &segs {
            h.feed(s);
        }
        h.flush();
        let out = h.take();
        assert_eq!(out.len(), 1, "{csum:?}");
        assert_eq!(parse(&out[0]).payload, concat(&segs));
        check_checksums(&out[0]);
    }
}

#[test]
fn a_lone_segment_is_delivered_byte_for_byte() {
    for csum in [Csum::Full, Csum::DataValid, Csum::Partial] {
        let mut h = Harness::new(linux());
        let s = Tcp::v4(0, 1448).with(|s| s.csum = csum);
        h.feed(&s);
        h.flush();
        assert_eq!(h.take(), vec![s.build()]);
    }
}

#[test]
fn ethernet_padding_is_kept_alone_and_dropped_when_merged() {
    let mut h = Harness::new(linux());
    let a = Tcp::v4(0, 2);
    let mut fa = a.build();
    fa.extend_from_slice(&[0; 4]); // padded to 60 bytes after the vnet header
    h.feed_raw(&fa);
    h.flush();
    assert_eq!(h.take(), vec![fa.clone()], "alone: untouched");

    h.feed_raw(&fa);
    h.feed(&a.next(2));
    h.flush();
    let out = h.take();
    assert_eq!(out.len(), 1);
    let o = parse(&out[0]);
    assert_eq!(o.payload, concat(&[a.clone(), a.next(2)]));
    assert_eq!(out[0].len(), 12 + 14 + o.ip_len, "no padding inside");
    check_checksums(&out[0]);
}

#[test]
fn sequence_numbers_wrap() {
    let mut h = Harness::new(linux());
    let segs = burst(&Tcp::v4(u32::MAX - 1500, 1000), 3);
    for s in &segs {
        h.feed(s);
    }
    h.flush();
    let out = h.take();
    assert_eq!(out.len(), 1);
    assert_eq!(parse(&out[0]).payload, concat(&segs));
}

#[test]
fn the_ip_packet_never_exceeds_65535_bytes() {
    let mut h = Harness::new(linux());
    // 45 * 1448 + 40 = 65200 fits; the 46th segment does not.
    let segs = burst(&Tcp::v4(0, 1448), 46);
    for s in &segs {
        h.feed(s);
    }
    let out = h.take();
    assert_eq!(out.len(), 1, "flushed when the next would not fit");
    let o = parse(&out[0]);
    assert_eq!(o.ip_len, 40 + 45 * 1448);
    assert_eq!(o.payload, concat(&segs[..45]));
    check_checksums(&out[0]);
    assert_eq!(h.rsc.counters().flush.size, 1);
    assert_eq!(h.rsc.pending_flows(), 1, "the 46th starts the next packet");
    h.flush();
    assert_eq!(h.take(), vec![segs[45].build()]);

    // IPv6: the cap counts the 40-byte header too.
    let mut h = Harness::new(linux());
    let segs = burst(&Tcp::v6(0, 1440), 46);
    for s in &segs {
        h.feed(s);
    }
    let o = parse(&h.take()[0]);
    assert_eq!(o.ip_len, 60 + 45 * 1440);
    assert!(o.ip_len <= 65535);
}

#[test]
fn max_size_caps_the_ip_packet_exactly() {
    let mut h = Harness::new(RscConfig {
        max_size: 40 + 3000,
        ..linux()
    });
    let segs = burst(&Tcp::v4(0, 1000), 7);
    for s in &segs {
        h.feed(s);
    }
    h.flush();
    let lens: Vec<usize> = h.take().iter().map(|f| parse(f).ip_len).collect();
    assert_eq!(lens, vec![3040, 3040, 1040]);
    // Larger than 65535 is clamped.
    let r = Rsc::new(RscConfig {
        max_size: 1 << 20,
        ..linux()
    });
    assert_eq!(r.cap, 65535);
}

#[test]
fn a_larger_segment_starts_a_new_packet_and_a_shorter_one_ends_it() {
    let mut h = Harness::new(linux());
    let a = Tcp::v4(0, 1000);
    let b = a.next(1000);
    let c = b.next(1200); // larger than the MSS
    let d = c.next(1200);
    let e = d.next(500); // short: the last one
    let f = e.next(1200);
    for s in [&a, &b, &c, &d, &e, &f] {
        h.feed(s);
    }
    h.flush();
    let out = h.take();
    let got: Vec<(u32, usize, u16)> = out
        .iter()
        .map(|f| {
            let o = parse(f);
            (o.tcp.sequence_number, o.payload.len(), o.vnet.gso_size)
        })
        .collect();
    assert_eq!(
        got,
        vec![(0, 2000, 1000), (2000, 2900, 1200), (4900, 1200, 0)]
    );
    let c = h.rsc.counters();
    assert_eq!((c.flush.mss, c.flush.short_segment), (1, 1));
}

#[test]
fn psh_is_merged_then_the_packet_is_flushed() {
    let mut h = Harness::new(linux());
    let a = Tcp::v4(0, 1448);
    let b = a.next(1448).with(|s| s.psh = true);
    h.feed(&a);
    h.feed(&b);
    let out = h.take();
    assert_eq!(out.len(), 1);
    let o = parse(&out[0]);
    assert!(o.tcp.psh, "the coalesced packet carries PSH");
    assert_eq!(o.payload.len(), 2896);
    assert_eq!(h.rsc.counters().flush.psh, 1);
    assert_eq!(h.rsc.pending_flows(), 0);
    // A lone PSH segment goes out at once, untouched.
    let c = b.next(100).with(|s| s.psh = true);
    h.feed(&c);
    assert_eq!(h.take(), vec![c.build()]);
}

#[test]
fn an_advancing_ack_is_merged() {
    let mut h = Harness::new(linux());
    let a = Tcp::v4(0, 1448).with(|s| s.ack = 10);
    let b = a.next(1448).with(|s| s.ack = 20);
    h.feed(&a);
    h.feed(&b);
    h.flush();
    let out = h.take();
    assert_eq!(out.len(), 1);
    assert_eq!(parse(&out[0]).tcp.acknowledgment_number, 20);
}

/// Feeds a pending packet of two segments, then `frame`; expects the
/// packet flushed, then `frame` untouched (or, with `restart`, `frame`
/// held as the next packet), and `counter` to be 1.
fn flushes_then(frame: Tcp, restart: bool, counter: impl Fn(&RscCounters) -> u64) {
    let mut h = Harness::new(linux());
    let a = Tcp::v4(0, 1448).with(|s| s.ts = frame.ts.map(|_| (5, 5)));
    let b = a.next(1448);
    h.feed(&a);
    h.feed(&b);
    h.feed(&frame);
    let mut out = h.take();
    if restart {
        assert_eq!(out.len(), 1, "{frame:?}");
        assert_eq!(h.rsc.pending_flows(), 1);
        h.flush();
        out.extend(h.take());
    }
    assert_eq!(out.len(), 2, "{frame:?}");
    let o = parse(&out[0]);
    assert_eq!(o.payload, concat(&[a, b]), "{frame:?}");
    check_checksums(&out[0]);
    assert_eq!(out[1], frame.build(), "then the frame, untouched");
    assert_eq!(counter(h.rsc.counters()), 1, "{frame:?}");
    assert_eq!(h.rsc.pending_flows(), 0);
}

#[test]
fn control_flags_flush_the_flow_first() {
    let next = || Tcp::v4(2896, 1448);
    let f = |c: &RscCounters| c.flush.tcp_flags;
    flushes_then(next().with(|s| s.fin = true), false, f);
    flushes_then(next().with(|s| s.rst = true), false, f);
    flushes_then(next().with(|s| s.urg = true), false, f);
    flushes_then(next().with(|s| s.ece = true), false, f);
    flushes_then(next().with(|s| s.cwr = true), false, f);
    flushes_then(next().with(|s| s.no_ack = true), false, f);
    flushes_then(
        Tcp::v4(2896, 0).with(|s| {
            s.fin = true;
        }),
        false,
        f,
    );
}

#[test]
fn a_pure_ack_flushes_the_flow_first() {
    flushes_then(Tcp::v4(2896, 0).with(|s| s.ack = 2000), false, |c| {
        c.flush.pure_ack
    });
    // A window update without data too.
    flushes_then(Tcp::v4(2896, 0).with(|s| s.win = 9), false, |c| {
        c.flush.pure_ack
    });
}

#[test]
fn a_duplicate_ack_is_counted_and_flushes() {
    flushes_then(Tcp::v4(2896, 0), false, |c| c.flush.dup_ack);
    flushes_then(Tcp::v4(2896, 0), false, |c| c.dup_acks);
    // With RSC_EXT the count goes in the coalesced packet's csum_offset.
    let mut h = Harness::new(windows());
    let a = Tcp::v4(0, 1448);
    h.feed(&a);
    h.feed(&a.next(1448));
    h.feed(&Tcp::v4(2896, 0));
    let out = h.take();
    let v = vnet(&out[0]);
    assert_eq!((v.csum_start, v.csum_offset), (2, 1));
}

#[test]
fn out_of_order_segments_flush_the_flow_first() {
    let f = |c: &RscCounters| c.flush.out_of_order;
    flushes_then(Tcp::v4(4000, 1448), false, f); // gap
    flushes_then(Tcp::v4(1448, 1448), false, f); // retransmission
    flushes_then(Tcp::v4(2896, 1448).with(|s| s.ack = 999), false, f); // older ack
}

#[test]
fn a_window_change_flushes_the_flow_first() {
    flushes_then(Tcp::v4(2896, 1448).with(|s| s.win = 1024), false, |c| {
        c.flush.window_change
    });
}

#[test]
fn changed_options_start_a_new_packet() {
    let f = |c: &RscCounters| c.flush.options;
    let next = || Tcp::v4(2896, 1448).with(|s| s.ts = Some((5, 5)));
    flushes_then(next().with(|s| s.ts = Some((5, 6))), true, f); // TSecr
    flushes_then(next().with(|s| s.ts = Some((4, 5))), true, f); // TSval back
    flushes_then(
        next().with(|s| {
            s.opts = vec![
                TcpOptionElement::Noop,
                TcpOptionElement::Noop,
                TcpOptionElement::SelectiveAcknowledgement((1, 2), [None, None, None]),
            ]
        }),
        true,
        f,
    );
}

#[test]
fn a_timestamp_that_comes_or_goes_starts_a_new_packet() {
    for (first, second) in [(Some((5, 5)), None), (None, Some((5, 5)))] {
        let mut h = Harness::new(linux());
        let a = Tcp::v4(0, 1436).with(|s| s.ts = first);
        let b = a.next(1436);
        let c = b.next(1436).with(|s| s.ts = second);
        for s in [&a, &b, &c] {
            h.feed(s);
        }
        h.flush();
        let out = h.take();
        assert_eq!(out.len(), 2);
        assert_eq!(out[1], c.build());
        assert_eq!(h.rsc.counters().flush.options, 1);
    }
}

#[test]
fn changed_options_without_timestamps_start_a_new_packet() {
    flushes_then(
        Tcp::v4(2896, 1448).with(|s| s.opts = vec![TcpOptionElement::Noop; 4]),
        true,
        |c| c.flush.options,
    );
}

#[test]
fn a_changed_ip_header_starts_a_new_packet() {
    let f = |c: &RscCounters| c.flush.header_change;
    flushes_then(Tcp::v4(2896, 1448).with(|s| s.ttl = 63), true, f);
    flushes_then(Tcp::v4(2896, 1448).with(|s| s.ecn = 1), true, f);
}

#[test]
fn a_pass_through_frame_of_the_flow_flushes_it_first() {
    let f = |c: &RscCounters| c.flush.pass_through_flow;
    flushes_then(Tcp::v4(2896, 1448).with(|s| s.ecn = 3), false, f);
    flushes_then(Tcp::v4(2896, 0).with(|s| s.syn = true), false, f);
    flushes_then(Tcp::v4(2896, 1448).with(|s| s.df = false), false, f);
    flushes_then(Tcp::v4(2896, 1448).with(|s| s.csum = Csum::Bad), false, f);
    flushes_then(Tcp::v4(2896, 1448).with(|s| s.ip_opts = true), false, f);
    flushes_then(Tcp::v4(2896, 1448).with(|s| s.gso_type = 1), false, f);
}

#[test]
fn frames_of_other_flows_pass_at_once_without_disturbing() {
    let mut h = Harness::new(linux());
    let a = Tcp::v4(0, 1448);
    h.feed(&a);
    h.feed(&a.next(1448));
    let others = [
        Tcp::v4(0, 0).with(|s| s.host = 2),         // pure ACK, other host
        Tcp::v4(0, 100).with(|s| s.sport = 1),      // other port
        Tcp::v6(2896, 1448).with(|s| s.fin = true), // same ports, IPv6
        Tcp::v4(2896, 1448).with(|s| s.dport = 1),  // other dport
        Tcp::v4(2896, 0).with(|s| {
            // SYN of another flow
            s.syn = true;
            s.host = 3;
        }),
    ];
    for o in &others {
        h.feed(o);
    }
    let out = h.take();
    // The data segment of a new flow (port 1) is held, the rest pass.
    let want: Vec<Vec<u8>> = [&others[0], &others[2], &others[4]]
        .iter()
        .map(|s| s.build())
        .collect();
    assert_eq!(out, want);
    assert_eq!(h.rsc.pending_flows(), 3);
    h.feed(&a.next(1448).next(1448));
    assert!(h.take().is_empty(), "flow 1 still coalescing");
    h.flush();
    let out = h.take();
    assert_eq!(out.len(), 3);
    assert_eq!(parse(&out[0]).payload.len(), 3 * 1448);
}

#[test]
fn a_flow_keeps_its_order_across_flushes() {
    let mut h = Harness::new(linux());
    let a = Tcp::v4(0, 1000);
    let b = a.next(1000);
    let fin = b.next(0).with(|s| s.fin = true);
    let c = Tcp::v4(2001, 1000); // after the FIN, seq + 1
    h.feed(&a);
    h.feed(&b);
    h.feed(&fin);
    h.feed(&c);
    h.flush();
    let seqs: Vec<u32> = h
        .take()
        .iter()
        .map(|f| parse(f).tcp.sequence_number)
        .collect();
    assert_eq!(seqs, vec![0, 2000, 2001]);
}

#[test]
fn the_oldest_flow_is_evicted_for_a_new_one() {
    let mut h = Harness::new(linux());
    for i in 0..=MAX_FLOWS {
        h.feed(&Tcp::v4(0, 100).with(|s| s.sport = 100 + i as u16));
    }
    let out = h.take();
    assert_eq!(out.len(), 1);
    assert_eq!(parse(&out[0]).sport, 100);
    assert_eq!(h.rsc.counters().flush.evicted, 1);
    assert_eq!(h.rsc.pending_flows(), MAX_FLOWS);
}

#[test]
fn the_timer_drains_expired_flows_only() {
    let mut h = Harness::new(linux());
    assert_eq!(h.rsc.next_deadline(), None);
    let a = Tcp::v4(0, 1000);
    h.feed(&a);
    let t_a = h.now + DEFAULT_INTERVAL;
    assert_eq!(h.rsc.next_deadline(), Some(t_a));
    h.advance(100);
    h.feed(&a.next(1000)); // merging does not move the deadline
    let b = Tcp::v6(0, 1000);
    h.feed(&b);
    assert_eq!(h.rsc.next_deadline(), Some(t_a));
    h.advance(199);
    h.drain();
    assert!(h.out.is_empty(), "299 µs: not yet");
    h.advance(1);
    h.drain();
    let out = h.take();
    assert_eq!(out.len(), 1);
    assert_eq!(parse(&out[0]).payload.len(), 2000);
    assert_eq!(
        h.rsc.next_deadline(),
        Some(t_a + Duration::from_micros(100))
    );
    h.advance(100);
    h.drain();
    assert_eq!(h.take(), vec![b.build()]);
    assert_eq!(h.rsc.next_deadline(), None);
    let c = h.rsc.counters();
    assert_eq!((c.flush.timer, c.timer_drains), (2, 2));
    h.drain();
    assert_eq!(
        h.rsc.counters().timer_drains,
        2,
        "nothing to drain: not counted"
    );
}

#[test]
fn input_drains_expired_flows_first() {
    let mut h = Harness::new(RscConfig {
        interval: Duration::from_millis(1),
        ..linux()
    });
    let a = Tcp::v4(0, 1000);
    h.feed(&a);
    h.advance(1000);
    let b = a.next(1000);
    h.feed(&b); // late timer: the old packet goes first, b starts anew
    let out = h.take();
    assert_eq!(out, vec![a.build()]);
    assert_eq!(h.rsc.pending_flows(), 1);
    assert_eq!(h.rsc.counters().flush.timer, 1);
}

#[test]
fn rsc_ext_header_reports_segments_and_dup_acks() {
    let mut h = Harness::new(windows());
    let segs = burst(&Tcp::v6(0, 1000), 5);
    for s in &segs {
        h.feed(s);
    }
    h.flush();
    let out = h.take();
    let v = vnet(&out[0]);
    assert_eq!(v.flags, NEEDS_CSUM | RSC_INFO);
    assert_eq!((v.gso_type, v.gso_size), (4, 1000));
    assert_eq!((v.csum_start, v.csum_offset), (5, 0));
    check_checksums(&out[0]);
}

#[test]
fn config_follows_the_acked_features() {
    use crate::virtio::net::features::*;
    let c = RscConfig::from_features(GUEST_CSUM | GUEST_TSO4 | RSC_EXT);
    assert!(c.rsc_ext && c.guest_tso4 && c.guest_csum && !c.guest_tso6);
    assert_eq!(c.interval, DEFAULT_INTERVAL);
    assert_eq!(c.max_size, 65535);
    assert_eq!(RscConfig::from_features(0), RscConfig::default());
}

#[test]
fn counters_are_serializable() {
    fn is_serialize<T: serde::Serialize>(_: &T) {}
    is_serialize(Rsc::new(linux()).counters());
}

#[test]
#[should_panic(expected = "TCP checksum")]
fn the_checksum_check_catches_a_wrong_partial_checksum() {
    let mut h = Harness::new(linux());
    let a = Tcp::v4(0, 1000);
    h.feed(&a);
    h.feed(&a.next(1000));
    h.flush();
    let mut f = h.take().remove(0);
    f[12 + 14 + 20 + 16] ^= 1;
    check_checksums(&f);
}

#[test]
#[should_panic(expected = "TCP checksum")]
fn the_checksum_check_catches_a_corrupt_payload() {
    let mut f = Tcp::v4(0, 1000).build();
    let last = f.len() - 1;
    f[last] ^= 0x10;
    check_checksums(&f);
}

#[test]
#[should_panic(expected = "IPv4 header")]
fn the_checksum_check_catches_a_corrupt_ip_header() {
    let mut h = Harness::new(linux());
    let a = Tcp::v4(0, 1000);
    h.feed(&a);
    h.feed(&a.next(1000));
    h.flush();
    let mut f = h.take().remove(0);
    f[12 + 14 + 8] ^= 1; // TTL
    check_checksums(&f);
}

#[test]
fn reconfigure_flushes_under_the_old_config_and_keeps_counting() {
    let mut h = Harness::new(windows());
    let segs = burst(&Tcp::v4(0, 1000), 3);
    for s in &segs {
        h.feed(s);
    }
    h.rsc.reconfigure(linux(), &mut h.out);
    let out = h.take();
    assert_eq!(out.len(), 1);
    assert_eq!(
        vnet(&out[0]).flags,
        NEEDS_CSUM | RSC_INFO,
        "built for the driver that negotiated RSC_EXT"
    );
    assert_eq!(h.rsc.pending_flows(), 0);
    assert!(!h.rsc.config().rsc_ext);
    let next = segs[2].next(1000);
    h.feed(&next);
    h.feed(&next.next(1000));
    h.flush();
    assert_eq!(vnet(&h.take()[0]).flags, NEEDS_CSUM, "the new config");
    let c = h.rsc.counters();
    assert_eq!((c.received, c.coalesced, c.flush.flush_all), (5, 3, 2));

    // A driver without offloads: everything passes from then on.
    h.rsc.reconfigure(RscConfig::default(), &mut h.out);
    h.feed(&next.next(1000));
    assert_eq!(h.take().len(), 1);
    assert_eq!(h.rsc.counters().pass.no_offload, 1);
}

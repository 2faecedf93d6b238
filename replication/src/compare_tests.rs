//! Tests of the compare engine, with frames built by etherparse.

use proptest::prelude::*;

use super::*;
use crate::packet::tests::{arp, echo_reply, udp, Tcp};
use crate::packet::TcpFlags;

const SYN: u8 = TcpFlags::SYN;
const FIN: u8 = TcpFlags::FIN;
/// The primary's and the secondary's ISNs in the tests.
const P_ISN: u32 = 1000;
const S_ISN: u32 = 0xffff_fff0;
const C_ISN: u32 = 7000;

struct Pair {
    c: Compare,
    t0: Instant,
    now: Instant,
    out: Vec<Action>,
}

impl Pair {
    fn new(cfg: CompareConfig) -> Pair {
        let now = Instant::now();
        Pair {
            c: Compare::new(cfg).unwrap(),
            t0: now,
            now,
            out: Vec::new(),
        }
    }

    fn default() -> Pair {
        Pair::new(CompareConfig::default())
    }

    fn p(&mut self, frame: Vec<u8>) {
        self.c.primary(frame, self.now, &mut self.out);
        self.check();
    }

    fn s(&mut self, frame: Vec<u8>) {
        self.c.secondary(&frame, self.now, &mut self.out);
        self.check();
    }

    fn at(&mut self, ms: u64) {
        self.now = self.t0 + Duration::from_millis(ms);
        self.c.tick(self.now, &mut self.out);
        self.check();
    }

    fn done(&mut self) {
        let why = self.c.pending().or(Some(Reason::Period));
        self.c.checkpoint_done(self.now, why, &mut self.out);
        self.check();
    }

    /// The actions since the last call.
    fn take(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.out)
    }

    /// The frames released since the last call (other actions dropped).
    fn released(&mut self) -> Vec<Vec<u8>> {
        self.take()
            .into_iter()
            .filter_map(|a| match a {
                Action::Release { frame, .. } => Some(frame),
                Action::Checkpoint(_) => None,
            })
            .collect()
    }

    fn check(&self) {
        check_counters(&self.c);
    }

    /// The handshake: client SYN, then both SYN-ACKs. Returns the
    /// primary's SYN-ACK once released.
    fn handshake(&mut self, v6: bool) {
        let v = |t: Tcp| if v6 { t.v6() } else { t };
        let mut syn = v(Tcp::client(C_ISN).flags(SYN).ack(None)).build(b"");
        assert!(self
            .c
            .client_to_secondary(&mut syn, Csum::Full, self.now)
            .unwrap()
            .is_some());
        let p = v(Tcp::guest(P_ISN).flags(SYN).ack(Some(C_ISN + 1))).build(b"");
        self.p(p.clone());
        assert!(self.take().is_empty());
        self.s(v(Tcp::guest(S_ISN).flags(SYN).ack(Some(C_ISN + 1))).build(b""));
        assert_eq!(self.released(), vec![p]);
    }
}

pub(crate) fn check_counters(c: &Compare) {
    let k = c.counters();
    assert_eq!(k.primary_frames, k.released + k.held + k.dropped_primary);
    assert_eq!(
        k.released,
        k.matched + k.passed_through + k.oversize + k.released_at_checkpoint
    );
    assert!(k.held <= c.config().max_queue as u64);
    assert!(k.held_secondary <= c.config().max_queue as u64);
}

/// A primary data segment at `pos` bytes into the stream.
fn p_data(pos: u32, data: &[u8]) -> Vec<u8> {
    Tcp::guest(P_ISN + 1 + pos).ack(Some(C_ISN + 1)).build(data)
}

/// The secondary's, at the same position in its own space.
fn s_data(pos: u32, data: &[u8]) -> Vec<u8> {
    Tcp::guest(S_ISN.wrapping_add(1 + pos))
        .ack(Some(C_ISN + 1))
        .build(data)
}

#[test]
fn one_segment_matched_by_two() {
    let mut x = Pair::default();
    x.handshake(false);
    let p = p_data(0, b"hello world");
    x.p(p.clone());
    x.s(s_data(0, b"hello"));
    assert!(x.take().is_empty());
    x.s(s_data(5, b" world"));
    assert_eq!(x.released(), vec![p]);
    assert_eq!(x.c.counters().matched, 2);
    assert_eq!(x.c.counters().held_secondary, 0);
}

#[test]
fn two_segments_matched_by_one_secondary_first() {
    let mut x = Pair::default();
    x.handshake(true);
    let v6 = |t: Tcp| t.v6();
    x.s(v6(Tcp::guest(S_ISN.wrapping_add(1)).ack(Some(C_ISN + 1))).build(b"abcdef"));
    assert_eq!(x.c.counters().held_secondary, 1);
    let p1 = v6(Tcp::guest(P_ISN + 1).ack(Some(C_ISN + 1))).build(b"abc");
    let p2 = v6(Tcp::guest(P_ISN + 4).ack(Some(C_ISN + 1))).build(b"def");
    x.p(p1.clone());
    assert_eq!(x.released(), vec![p1]);
    x.p(p2.clone());
    assert_eq!(x.released(), vec![p2]);
    assert_eq!(x.c.counters().held_secondary, 0);
}

#[test]
fn differing_byte_asks_a_checkpoint_and_done_releases_in_order() {
    let mut x = Pair::default();
    x.handshake(false);
    let p1 = p_data(0, b"abc");
    let p2 = p_data(3, b"def");
    x.p(p1.clone());
    x.p(p2.clone());
    x.s(s_data(0, b"abcdeX"));
    assert_eq!(x.take(), vec![Action::Checkpoint(Reason::Mismatch)]);
    assert_eq!(x.c.counters().mismatched, 1);
    assert_eq!(x.c.pending(), Some(Reason::Mismatch));
    // More mismatching input asks nothing more.
    x.s(s_data(6, b"zzz"));
    assert!(x.take().is_empty());
    let arp = arp();
    x.p(arp.clone());
    assert_eq!(x.released(), vec![arp]);
    x.done();
    let out = x.take();
    let ids: Vec<_> = out
        .iter()
        .map(|a| match a {
            Action::Release { id, .. } => *id,
            Action::Checkpoint(r) => panic!("{r:?}"),
        })
        .collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    let frames: Vec<_> = out
        .into_iter()
        .filter_map(|a| match a {
            Action::Release { frame, .. } => Some(frame),
            Action::Checkpoint(_) => None,
        })
        .collect();
    assert_eq!(frames, vec![p1, p2]);
    assert_eq!(x.c.counters().released_at_checkpoint, 2);
    assert_eq!(x.c.counters().held_secondary, 0);
    assert_eq!(x.c.pending(), None);
    // The secondary is a copy now: its segments are in the primary's space.
    let p3 = p_data(6, b"ghi");
    x.p(p3.clone());
    x.s(p_data(6, b"ghi"));
    assert_eq!(x.released(), vec![p3]);
}

#[test]
fn timeout() {
    let mut x = Pair::default();
    x.handshake(false);
    x.p(p_data(0, b"late"));
    x.at(3000);
    assert!(x.take().is_empty());
    x.at(3001);
    assert_eq!(x.take(), vec![Action::Checkpoint(Reason::Timeout)]);
    x.at(9000);
    assert!(x.take().is_empty());
    assert_eq!(x.c.counters().timed_out, 1);
    x.done();
    assert_eq!(x.released().len(), 1);
}

fn small(policy: QueueFull) -> Pair {
    Pair::new(CompareConfig {
        max_queue: 2,
        queue_full: policy,
        ..Default::default()
    })
}

#[test]
fn full_queue_drops_and_counts() {
    let mut x = small(QueueFull::Drop);
    for i in 0..5 {
        x.p(udp(false, &[i]));
    }
    assert!(x.take().is_empty());
    let k = x.c.counters();
    assert_eq!((k.held, k.dropped_full, k.dropped_primary), (2, 3, 3));
    for i in 0..5 {
        x.s(udp(false, &[9, i]));
    }
    // The first mismatches; the flow is diverged, the rest ignored.
    assert_eq!(x.take(), vec![Action::Checkpoint(Reason::Mismatch)]);
    assert_eq!(x.c.counters().held_secondary, 0);
}

#[test]
fn full_secondary_queue_drops() {
    let mut x = small(QueueFull::Drop);
    x.handshake(false);
    for i in 0..4 {
        x.s(s_data(i, b"a"));
    }
    let k = x.c.counters();
    assert_eq!(
        (k.held_secondary, k.dropped_full, k.dropped_primary),
        (2, 2, 0)
    );
}

#[test]
fn full_queue_checkpoint_policy() {
    let mut x = small(QueueFull::Checkpoint);
    x.p(udp(false, b"1"));
    assert!(x.take().is_empty());
    x.p(udp(false, b"2"));
    assert_eq!(x.take(), vec![Action::Checkpoint(Reason::Queue)]);
    x.p(udp(false, b"3"));
    assert!(x.take().is_empty());
    let k = x.c.counters();
    assert_eq!((k.queue_full, k.dropped_full, k.held), (1, 1, 2));
    x.done();
    assert_eq!(x.released(), vec![udp(false, b"1"), udp(false, b"2")]);
}

#[test]
fn udp_and_icmp_fifo() {
    let mut x = Pair::default();
    x.s(udp(true, b"a"));
    x.p(udp(true, b"a"));
    x.p(udp(true, b"b"));
    assert_eq!(x.released(), vec![udp(true, b"a")]);
    x.s(udp(true, b"b"));
    assert_eq!(x.released(), vec![udp(true, b"b")]);
    for v6 in [false, true] {
        x.p(echo_reply(v6, 1, 1, b"ping"));
        x.s(echo_reply(v6, 1, 1, b"ping"));
        assert_eq!(x.released(), vec![echo_reply(v6, 1, 1, b"ping")]);
    }
    x.p(echo_reply(false, 1, 2, b"ping"));
    x.s(echo_reply(false, 1, 3, b"ping"));
    assert_eq!(x.take(), vec![Action::Checkpoint(Reason::Mismatch)]);
}

#[test]
fn holds_are_timed_by_what_released_them_and_mismatches_by_protocol() {
    let mut x = Pair::default();
    x.p(echo_reply(false, 1, 1, b"ping"));
    x.at(4);
    x.s(echo_reply(false, 1, 1, b"ping"));
    assert_eq!(x.released().len(), 1);
    x.p(echo_reply(false, 1, 2, b"ping"));
    x.s(echo_reply(false, 1, 3, b"ping"));
    x.at(30);
    x.done();
    assert_eq!(x.released().len(), 1);
    let h = x.c.holds();
    assert_eq!(h.matched.count(), 1);
    assert_eq!(h.matched.max(), Duration::from_millis(4));
    assert_eq!(h.checkpoint.count(), 1);
    assert_eq!(h.checkpoint.max(), Duration::from_millis(26));
    assert_eq!(h.checkpoint_by_reason.mismatch, 1);
    assert_eq!(h.checkpoint_by_reason.period, 0);
    let by = &x.c.counters().mismatched_by;
    assert_eq!((by.tcp, by.udp, by.icmp), (0, 0, 1));
    let (m, c) = (&h.matched_by_protocol, &h.checkpoint_by_protocol);
    assert_eq!((m.icmp, c.icmp, m.tcp + m.udp + c.tcp + c.udp), (1, 1, 0));
}

#[test]
fn the_next_deadline_is_the_oldest_frames_timeout() {
    let mut x = Pair::default();
    assert_eq!(x.c.next_deadline(x.now), None);
    x.p(echo_reply(false, 1, 1, b"ping"));
    x.at(1000);
    x.p(echo_reply(false, 1, 2, b"ping"));
    assert_eq!(x.c.next_deadline(x.now), Some(Duration::from_millis(2000)));
    x.at(3001);
    assert_eq!(x.take(), vec![Action::Checkpoint(Reason::Timeout)]);
    assert_eq!(x.c.next_deadline(x.now), None);
}

#[test]
fn arp_and_garbage_pass_through() {
    let mut x = Pair::default();
    x.p(arp());
    x.p(vec![1, 2, 3]);
    x.p(vec![0; MAX_FRAME_PLUS]);
    assert_eq!(x.released().len(), 3);
    let k = x.c.counters();
    assert_eq!((k.passed_through, k.oversize, k.held), (2, 1, 0));
}

const MAX_FRAME_PLUS: usize = crate::packet::MAX_FRAME + 1;

#[test]
fn pure_ack_waits_for_the_secondary_ack() {
    let mut x = Pair::default();
    x.handshake(false);
    let ack = Tcp::guest(P_ISN + 1).ack(Some(C_ISN + 101)).build(b"");
    x.p(ack.clone());
    x.s(Tcp::guest(S_ISN.wrapping_add(1))
        .ack(Some(C_ISN + 51))
        .build(b""));
    assert!(x.take().is_empty());
    x.s(Tcp::guest(S_ISN.wrapping_add(1))
        .ack(Some(C_ISN + 201))
        .build(b""));
    assert_eq!(x.released(), vec![ack]);
}

#[test]
fn fin_matches_fin() {
    let mut x = Pair::default();
    x.handshake(false);
    let fin = Tcp::guest(P_ISN + 1).flags(FIN).build(b"bye");
    x.p(fin.clone());
    x.s(Tcp::guest(S_ISN.wrapping_add(1)).build(b"bye"));
    assert!(x.take().is_empty());
    x.s(Tcp::guest(S_ISN.wrapping_add(4)).flags(FIN).build(b""));
    assert_eq!(x.released(), vec![fin]);
}

#[test]
fn secondary_syn_ack_first_waits_for_the_primary() {
    let mut x = Pair::default();
    x.s(Tcp::guest(S_ISN).flags(SYN).ack(Some(C_ISN + 1)).build(b""));
    x.s(s_data(0, b"banner"));
    assert_eq!(x.c.counters().held_secondary, 2);
    let syn_ack = Tcp::guest(P_ISN).flags(SYN).ack(Some(C_ISN + 1)).build(b"");
    x.p(syn_ack.clone());
    assert_eq!(x.released(), vec![syn_ack]);
    let banner = p_data(0, b"banner");
    x.p(banner.clone());
    assert_eq!(x.released(), vec![banner]);
    assert_eq!(x.c.counters().held_secondary, 0);
}

#[test]
fn client_ack_moved_to_the_secondary_space() {
    let mut x = Pair::default();
    x.handshake(false);
    let mut f = Tcp::client(C_ISN + 1).ack(Some(P_ISN + 1)).build(b"GET");
    let off = x.c.client_to_secondary(&mut f, Csum::Full, x.now).unwrap();
    assert_eq!(off, Some(P_ISN.wrapping_sub(S_ISN)));
    match crate::packet::parse(&f) {
        Frame::Tcp(seg) => assert_eq!(seg.ack, S_ISN.wrapping_add(1)),
        other => panic!("{other:?}"),
    }
    assert!(x
        .c
        .client_to_secondary(&mut arp(), Csum::Full, x.now)
        .unwrap()
        .is_none());
}

#[test]
fn retransmission_released_without_compare() {
    let mut x = Pair::default();
    x.handshake(false);
    let p = p_data(0, b"abc");
    x.p(p.clone());
    x.s(s_data(0, b"abc"));
    assert_eq!(x.released(), vec![p.clone()]);
    x.p(p.clone());
    assert_eq!(x.released(), vec![p]);
}

#[test]
fn zero_queue_refused() {
    let cfg = CompareConfig {
        max_queue: 0,
        ..Default::default()
    };
    assert_eq!(Compare::new(cfg).unwrap_err(), CompareError::NoQueue);
}

#[test]
fn counters_serialize() {
    // serde derive compiles into a Serialize impl; check it is there.
    fn is_serialize<T: Serialize>(_: &T) {}
    is_serialize(Pair::default().c.counters());
}

proptest! {
    #[test]
    fn any_split_matches(
        data in proptest::collection::vec(any::<u8>(), 1..300),
        p_cuts in proptest::collection::vec(1usize..50, 1..10),
        s_cuts in proptest::collection::vec(1usize..50, 1..10),
        secondary_first in any::<bool>(),
    ) {
        let mut x = Pair::default();
        x.handshake(false);
        let split = |cuts: &[usize]| {
            let mut pieces = Vec::new();
            let mut at = 0;
            for c in cuts.iter().cycle() {
                if at >= data.len() {
                    break;
                }
                let end = (at + c).min(data.len());
                pieces.push((at as u32, data[at..end].to_vec()));
                at = end;
            }
            pieces
        };
        let ps: Vec<_> = split(&p_cuts).into_iter().map(|(at, d)| p_data(at, &d)).collect();
        let ss: Vec<_> = split(&s_cuts).into_iter().map(|(at, d)| s_data(at, &d)).collect();
        if secondary_first {
            ss.iter().for_each(|f| x.s(f.clone()));
            ps.iter().for_each(|f| x.p(f.clone()));
        } else {
            ps.iter().for_each(|f| x.p(f.clone()));
            ss.iter().for_each(|f| x.s(f.clone()));
        }
        prop_assert_eq!(x.released(), ps);
        prop_assert_eq!(x.c.counters().held_secondary, 0);
    }

    #[test]
    fn hostile_events_keep_the_invariants(
        events in proptest::collection::vec(
            (0u8..4, proptest::collection::vec(any::<u8>(), 0..120), 0u64..2000), 0..60),
    ) {
        let mut x = small(QueueFull::Drop);
        let mut ms = 0;
        for (kind, bytes, dt) in events {
            ms += dt;
            x.now = x.t0 + Duration::from_millis(ms);
            match kind {
                0 => x.p(bytes),
                1 => x.s(bytes),
                2 => {
                    // A well-formed segment carrying the random bytes.
                    let seq = u32::from(bytes.first().copied().unwrap_or(0));
                    x.p(p_data(seq, &bytes));
                    x.s(s_data(seq, &bytes));
                }
                _ => x.done(),
            }
            x.at(ms);
        }
    }
}

#[test]
fn many_connections_stay_bounded() {
    let cfg = CompareConfig {
        max_queue: 4,
        conntrack: ConnTrackConfig {
            max_entries: 2,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut x = Pair::new(cfg);
    for port in 0..1000u16 {
        let t = Tcp {
            dport: 1000 + port,
            ..Tcp::guest(P_ISN + 1)
        };
        x.p(t.build(b"x"));
        x.s(t.build(b"x"));
        assert!(x.c.streams.len() <= 2 * (2 + 2 * 4));
    }
    assert_eq!(x.released().len(), 1000);
    assert_eq!(x.c.counters().conn_evictions, 998);
}

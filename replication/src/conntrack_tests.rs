//! Tests of the connection table.

use super::*;
use crate::packet::tests::Tcp;
use crate::packet::{parse, Frame};

fn seg(t: Tcp) -> TcpSeg {
    match parse(&t.build(b"")) {
        Frame::Tcp(s) => s,
        other => panic!("{other:?}"),
    }
}

fn table(max: usize) -> ConnTrack {
    ConnTrack::new(ConnTrackConfig {
        max_entries: max,
        ..Default::default()
    })
    .unwrap()
}

const SYN: u8 = TcpFlags::SYN;

#[test]
fn offset_from_the_syn_acks() {
    let mut t = table(8);
    let now = Instant::now();
    let syn = seg(Tcp::client(5000).flags(SYN).ack(None));
    t.observe(&syn, Side::Client, now);
    assert_eq!(t.get(&syn.conn).unwrap().state, TcpState::SynSeen);
    assert_eq!(t.offset(&syn.conn), Some(0));
    // The secondary answers first: its segments wait for the primary's ISN.
    t.observe(
        &seg(Tcp::guest(100).flags(SYN).ack(Some(5001))),
        Side::Secondary,
        now,
    );
    assert_eq!(t.offset(&syn.conn), None);
    t.observe(
        &seg(Tcp::guest(50).flags(SYN).ack(Some(5001))),
        Side::Primary,
        now,
    );
    assert_eq!(t.offset(&syn.conn), Some(50u32.wrapping_sub(100)));
    t.observe(&seg(Tcp::client(5001).ack(Some(51))), Side::Client, now);
    assert_eq!(t.get(&syn.conn).unwrap().state, TcpState::Established);
    t.checkpoint_done();
    assert_eq!(t.offset(&syn.conn), Some(0));
}

#[test]
fn guest_initiated_syn() {
    let mut t = table(8);
    let now = Instant::now();
    let p = seg(Tcp::guest(7).flags(SYN).ack(None));
    t.observe(&p, Side::Primary, now);
    t.observe(
        &seg(Tcp::guest(3).flags(SYN).ack(None)),
        Side::Secondary,
        now,
    );
    assert_eq!(t.offset(&p.conn), Some(4));
}

#[test]
fn close_linger_and_reuse() {
    let mut t = table(8);
    let t0 = Instant::now();
    let fin = TcpFlags::FIN;
    let g = seg(Tcp::guest(1).flags(fin));
    t.observe(&g, Side::Primary, t0);
    assert_eq!(t.get(&g.conn).unwrap().state, TcpState::Closing);
    t.observe(&seg(Tcp::client(1).flags(fin)), Side::Client, t0);
    assert_eq!(t.get(&g.conn).unwrap().state, TcpState::Closed);
    t.observe(&seg(Tcp::client(2)), Side::Client, t0);
    assert_eq!(t.get(&g.conn).unwrap().state, TcpState::Closed);
    assert_eq!(t.expire(t0 + Duration::from_secs(1)), 0);
    // A new SYN on the same ports starts over.
    t.observe(&seg(Tcp::client(9).flags(SYN).ack(None)), Side::Client, t0);
    assert_eq!(t.get(&g.conn).unwrap().state, TcpState::SynSeen);
    t.observe(&seg(Tcp::client(1).flags(TcpFlags::RST)), Side::Client, t0);
    assert_eq!(t.expire(t0 + Duration::from_secs(11)), 1);
    assert!(t.is_empty());
}

#[test]
fn idle_expiry() {
    let mut t = table(8);
    let t0 = Instant::now();
    t.observe(&seg(Tcp::guest(1)), Side::Primary, t0);
    assert_eq!(t.expire(t0 + Duration::from_secs(599)), 0);
    assert_eq!(t.expire(t0 + Duration::from_secs(600)), 1);
}

#[test]
fn full_table_evicts_least_recently_seen() {
    let mut t = table(2);
    let now = Instant::now();
    let port = |p: u16| {
        seg(Tcp {
            dport: p,
            ..Tcp::guest(1)
        })
    };
    t.observe(&port(1), Side::Primary, now);
    t.observe(&port(2), Side::Primary, now);
    t.observe(&port(1), Side::Primary, now);
    t.observe(&port(3), Side::Primary, now);
    assert_eq!(t.len(), 2);
    assert_eq!(t.evictions(), 1);
    assert!(t.get(&port(1).conn).is_some());
    assert!(t.get(&port(2).conn).is_none());
    assert!(t.get(&port(3).conn).is_some());
}

#[test]
fn zero_entries_refused() {
    assert_eq!(table_err(), ConnTrackError::NoRoom);
}

fn table_err() -> ConnTrackError {
    ConnTrack::new(ConnTrackConfig {
        max_entries: 0,
        ..Default::default()
    })
    .unwrap_err()
}

//! Tests of the rewrite: against a checksum computed from scratch, and
//! there and back.

use proptest::prelude::*;

use super::*;
use crate::packet::tests::Tcp;
use crate::packet::{parse, Frame};

fn seg_of(frame: &[u8]) -> TcpSeg {
    match parse(frame) {
        Frame::Tcp(seg) => seg,
        other => panic!("not TCP: {other:?}"),
    }
}

fn sum16(sum: &mut u32, bytes: &[u8]) {
    for pair in bytes.chunks(2) {
        let hi = u32::from(pair[0]) << 8;
        *sum += hi | pair.get(1).map_or(0, |&b| u32::from(b));
    }
}

/// The TCP checksum from scratch (no VLAN, no IPv6 extension header):
/// the pseudo-header, then the segment with its checksum field zeroed.
fn reference_checksum(frame: &[u8], v6: bool) -> u16 {
    let seg = seg_of(frame);
    let tcp = &frame[seg.header..seg.payload.end];
    let mut sum = 0u32;
    if v6 {
        sum16(&mut sum, &frame[14 + 8..14 + 40]);
    } else {
        sum16(&mut sum, &frame[14 + 12..14 + 20]);
    }
    sum += 6 + u32::try_from(tcp.len()).unwrap();
    sum16(&mut sum, &tcp[..16]);
    sum16(&mut sum, &tcp[18..]);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).unwrap()
}

fn checksum_field(frame: &[u8]) -> u16 {
    let h = seg_of(frame).header;
    u16::from_be_bytes([frame[h + 16], frame[h + 17]])
}

#[test]
fn builder_checksum_is_the_reference() {
    for v6 in [false, true] {
        let t = if v6 {
            Tcp::guest(5).v6()
        } else {
            Tcp::guest(5)
        };
        let f = t.build(b"abc");
        assert_eq!(checksum_field(&f), reference_checksum(&f, v6));
    }
}

#[test]
fn seq_rewrite_keeps_checksum_right() {
    for v6 in [false, true] {
        for (seq, delta) in [
            (1, 0x1234_5678),
            (0xffff_fff0, 0x20),
            (77, 0),
            (0, u32::MAX),
        ] {
            let t = if v6 {
                Tcp::guest(seq).v6()
            } else {
                Tcp::guest(seq)
            };
            let mut f = t.build(b"payload!");
            let seg = seg_of(&f);
            secondary_to_primary(&mut f, &seg, delta, Csum::Full).unwrap();
            let after = seg_of(&f);
            assert_eq!(after.seq, seq.wrapping_add(delta));
            assert_eq!(after.ack, seg.ack);
            assert_eq!(checksum_field(&f), reference_checksum(&f, v6));
        }
    }
}

#[test]
fn ack_rewrite_keeps_checksum_right() {
    for v6 in [false, true] {
        let t = if v6 {
            Tcp::client(9).v6()
        } else {
            Tcp::client(9)
        };
        let mut f = t.ack(Some(0x8000_0001)).build(b"q");
        let seg = seg_of(&f);
        client_to_secondary(&mut f, &seg, 0x10, Csum::Full).unwrap();
        assert_eq!(seg_of(&f).ack, 0x7fff_fff1);
        assert_eq!(seg_of(&f).seq, 9);
        assert_eq!(checksum_field(&f), reference_checksum(&f, v6));
    }
}

#[test]
fn no_ack_flag_no_ack_rewrite() {
    let mut f = Tcp::client(9)
        .ack(None)
        .flags(crate::packet::TcpFlags::SYN)
        .build(b"");
    let before = f.clone();
    let seg = seg_of(&f);
    client_to_secondary(&mut f, &seg, 0x10, Csum::Full).unwrap();
    assert_eq!(f, before);
}

#[test]
fn partial_checksum_is_left_alone() {
    let mut f = Tcp::guest(1).build(b"x");
    let seg = seg_of(&f);
    let hc = checksum_field(&f);
    shift_seq(&mut f, &seg, 1000, Csum::Partial).unwrap();
    assert_eq!(checksum_field(&f), hc);
    assert_eq!(seg_of(&f).seq, 1001);
}

#[test]
fn short_frame_is_an_error() {
    let f = Tcp::guest(1).build(b"");
    let seg = seg_of(&f);
    let mut short = f[..seg.header + 10].to_vec();
    assert_eq!(
        shift_seq(&mut short, &seg, 1, Csum::Full),
        Err(RewriteError::Truncated {
            len: seg.header + 10,
            header: seg.header
        })
    );
}

proptest! {
    #[test]
    fn there_and_back(
        seq in any::<u32>(),
        ack in any::<u32>(),
        delta in any::<u32>(),
        v6 in any::<bool>(),
        payload in proptest::collection::vec(any::<u8>(), 0..40),
    ) {
        let t = Tcp::guest(seq).ack(Some(ack));
        let t = if v6 { t.v6() } else { t };
        let orig = t.build(&payload);
        let seg = seg_of(&orig);
        let mut f = orig.clone();
        shift_seq(&mut f, &seg, delta, Csum::Full).unwrap();
        shift_ack(&mut f, &seg, delta, Csum::Full).unwrap();
        prop_assert_eq!(checksum_field(&f), reference_checksum(&f, v6));
        shift_seq(&mut f, &seg, delta.wrapping_neg(), Csum::Full).unwrap();
        shift_ack(&mut f, &seg, delta.wrapping_neg(), Csum::Full).unwrap();
        prop_assert_eq!(f, orig);
    }
}

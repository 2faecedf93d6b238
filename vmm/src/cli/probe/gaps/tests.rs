use super::*;

fn triple(id: u64, end_us: u64, gap_us: u64) -> Triple {
    Triple { id, end_us, gap_us }
}

#[test]
fn parses_a_datagram() {
    let r = parse(b"TJ1 7 5000000 1234 15000 2 3 4000000 12000 4 4900000 300000\n").unwrap();
    assert_eq!(
        r,
        Report {
            seq: 7,
            now_us: 5_000_000,
            loops: 1234,
            max_gap_us: 15_000,
            gaps: vec![triple(3, 4_000_000, 12_000), triple(4, 4_900_000, 300_000)],
        }
    );
    let r = parse(b"TJ1 0 10 1 0 0").unwrap();
    assert!(r.gaps.is_empty());
    assert_eq!(r.now_us, 10);
}

#[test]
fn takes_32_gaps_not_33() {
    let datagram = |n: u64| {
        let mut s = format!("TJ1 1 1000000 5 0 {n}");
        for id in 0..n {
            s += &format!(" {id} {} 20000", 1000 * id);
        }
        s
    };
    assert_eq!(parse(datagram(32).as_bytes()).unwrap().gaps.len(), 32);
    assert_eq!(parse(datagram(33).as_bytes()), Err(ParseError::TooMany(33)));
    assert_eq!(
        parse(b"TJ1 1 1 1 1 18446744073709551615"),
        Err(ParseError::TooMany(u64::MAX))
    );
}

#[test]
fn refuses_malformed_datagrams() {
    let cases: &[(&[u8], ParseError)] = &[
        (b"", ParseError::Magic),
        (b"TJ2 1 2 3 4 0", ParseError::Magic),
        (b"tj1 1 2 3 4 0", ParseError::Magic),
        (b"TJ1", ParseError::Truncated),
        (b"TJ1 1 2 3", ParseError::Truncated),
        (b"TJ1 1 2 3 4", ParseError::Truncated),
        // n does not match what follows.
        (b"TJ1 1 2000 3 4 1 9 1000", ParseError::Count(1)),
        (b"TJ1 1 2000 3 4 1 9 1000 5 6", ParseError::Count(1)),
        (b"TJ1 1 2000 3 4 0 9", ParseError::Count(0)),
        // Not unsigned decimal.
        (b"TJ1 -1 2 3 4 0", ParseError::Number(1)),
        (b"TJ1 1 +2 3 4 0", ParseError::Number(2)),
        (b"TJ1 1 2 0x3 4 0", ParseError::Number(3)),
        (b"TJ1 1 2 3 4.5 0", ParseError::Number(4)),
        (b"TJ1 1 2000 3 4 1 9 1e3 5", ParseError::Number(7)),
        (b"TJ1 1 2000 3 4 1 9 100 x", ParseError::Number(8)),
        // Too big for u64 (2^64).
        (b"TJ1 18446744073709551616 2 3 4 0", ParseError::Number(1)),
        (
            b"TJ1 1 2 3 4 00000000000000000000000000099",
            ParseError::TooMany(99),
        ),
        // Non-ASCII, binary.
        ("TJ1 1 2 3 4 0 \u{e9}".as_bytes(), ParseError::NotAscii),
        (b"TJ1 1 2 3 4 0 \xff", ParseError::NotAscii),
        (b"TJ1\x001 2 3 4 0", ParseError::Magic),
        // A gap that ends after the datagram was sent.
        (b"TJ1 1 2000 3 4 1 9 2001 5", ParseError::Future),
    ];
    for (datagram, want) in cases {
        assert_eq!(
            parse(datagram).as_ref().err(),
            Some(want),
            "{:?}",
            String::from_utf8_lossy(datagram)
        );
    }
    let long = format!("TJ1 1 2 3 4 0{}", " ".repeat(MAX_DATAGRAM));
    assert_eq!(parse(long.as_bytes()), Err(ParseError::TooLong));
    let flood = format!("TJ1 1 2 3 4 1 1 1 1{}", " 7".repeat(1000));
    assert_eq!(parse(flood.as_bytes()), Err(ParseError::Count(1)));
}

#[test]
fn largest_numbers_parse() {
    let m = u64::MAX;
    let r = parse(format!("TJ1 {m} {m} {m} {m} 1 {m} {m} {m}").as_bytes()).unwrap();
    assert_eq!(r.gaps, vec![triple(m, m, m)]);
    assert_eq!(r.seq, m);
    // And map onto the timeline without overflow.
    let mut log = GapLog::default();
    log.add(&r, 100.0);
    assert_eq!(log.gaps.len(), 1);
    assert_eq!(log.gaps[0].t_ms, 100.0);
    assert!(log.gaps[0].gap_ms > 1e15);
}

#[test]
fn maps_gaps_by_each_datagrams_arrival() {
    let mut log = GapLog::default();
    // Sent at guest time 10 s, arrived at host 500 ms: a gap that ended
    // 120 ms before sending ended at host 380 ms.
    log.take(b"TJ1 0 10000000 100 250000 1 1 9880000 250000", 500.0);
    assert_eq!(
        log.gaps,
        vec![Gap {
            t_ms: 380.0,
            gap_ms: 250.0,
            id: 1
        }]
    );
    assert_eq!(log.by_report, vec![(500.0, 250.0)]);
    // The guest's clock jumped (a migration): the next datagram says its
    // own time, mapped by its own arrival.
    log.take(
        b"TJ1 1 99000000 200 30000 2 1 9880000 250000 2 98990000 30000",
        600.0,
    );
    assert_eq!(log.gaps.len(), 2, "gap 1 again is a duplicate");
    assert_eq!(
        log.gaps[1],
        Gap {
            t_ms: 590.0,
            gap_ms: 30.0,
            id: 2
        }
    );
    assert_eq!((log.reports, log.bad, log.loops), (2, 0, 200));
}

#[test]
fn duplicates_count_once_and_stale_loops_are_ignored() {
    let mut log = GapLog::default();
    let d = b"TJ1 5 1000000 50 12000 2 7 900000 12000 8 950000 11000";
    log.take(d, 1000.0);
    log.take(d, 1001.0); // the network duplicated it
    log.take(b"TJ1 4 990000 40 0 1 6 980000 15000", 1002.0); // reordered, older
    log.take(b"garbage", 1003.0);
    log.done();
    let ids: Vec<u64> = log.gaps.iter().map(|g| g.id).collect();
    assert_eq!(ids, vec![7, 8, 6], "in time order once done");
    assert_eq!((log.reports, log.bad), (3, 1));
    assert_eq!(log.loops, 50, "from the newest seq, not the last to arrive");
}

#[test]
fn gaps_ending_before_the_probe_are_dropped() {
    let mut log = GapLog::default();
    log.take(
        b"TJ1 0 5000000 10 0 2 1 1000000 20000 2 4990000 20000",
        100.0,
    );
    assert_eq!(log.gaps.len(), 1);
    assert_eq!(log.gaps[0].id, 2);
    assert_eq!(log.gaps[0].t_ms, 90.0);
}

#[test]
fn caps_what_it_keeps() {
    let mut log = GapLog::default();
    for i in 0..(MAX_GAPS as u64 / 32 + 2) {
        let mut s = format!("TJ1 {i} 100000000 1 0 32");
        for j in 0..32 {
            s += &format!(" {} 99000000 20000", i * 32 + j);
        }
        log.take(s.as_bytes(), 1000.0);
    }
    assert_eq!(log.gaps.len(), MAX_GAPS);
    assert_eq!(log.seen.len(), MAX_GAPS);
    assert!(log.overflow > 0);
}

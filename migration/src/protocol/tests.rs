//! The receiver on hostile streams: truncated, flipped, reordered,
//! oversized and foreign input is refused with an error, never a panic or
//! an allocation beyond MAX_PAYLOAD.

use super::*;
use crate::manifest::{DeviceConfig, Manifest};

fn manifest() -> Manifest {
    Manifest {
        tandem_version: "test".into(),
        mem_bytes: 128 << 20,
        vcpus: 1,
        firmware: None,
        devices: vec![DeviceConfig::Serial { id: "com1".into() }],
    }
}

fn batch() -> MemoryBatch {
    MemoryBatch {
        ranges: vec![
            PageRange {
                gpa: 0x1000,
                pages: 2,
                zero: false,
            },
            PageRange {
                gpa: 0x10_0000,
                pages: 100,
                zero: true,
            },
            PageRange {
                gpa: 0x20_0000,
                pages: 1,
                zero: false,
            },
        ],
        data: (0..3 * 4096).map(|i| (i % 251) as u8).collect(),
    }
}

fn stream(msgs: &[Message]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in msgs {
        write_message(&mut out, m).unwrap();
    }
    out
}

fn all() -> Vec<Message> {
    vec![
        Message::Hello { version: VERSION },
        Message::Config(manifest()),
        Message::Accept,
        Message::Memory(batch()),
        Message::State(vec![1, 2, 3]),
        Message::Ready,
        Message::Go,
        Message::Abandon("no".into()),
        Message::Streams(streams::Streams {
            count: 3,
            token: [9; streams::TOKEN_BYTES],
        }),
        Message::Join(streams::Join {
            index: 2,
            token: [9; streams::TOKEN_BYTES],
        }),
        Message::Postcopy(vec![colo::Span {
            gpa: 0x2000,
            pages: 3,
        }]),
        Message::PageRequest(0x7000),
        Message::Done(postcopy::Stalls {
            faults: 3,
            ..Default::default()
        }),
    ]
}

fn read_all(mut bytes: &[u8]) -> std::result::Result<Vec<Message>, ProtocolError> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        out.push(read_message(&mut bytes)?);
    }
    Ok(out)
}

#[test]
fn every_message_round_trips() {
    let msgs = all();
    assert_eq!(read_all(&stream(&msgs)).unwrap(), msgs);
}

#[test]
fn a_batch_yields_its_ranges_with_their_bytes() {
    let b = batch();
    let parts: Vec<_> = b.iter().map(|(r, d)| (r.gpa, d.map(<[u8]>::len))).collect();
    assert_eq!(
        parts,
        vec![
            (0x1000, Some(8192)),
            (0x10_0000, None),
            (0x20_0000, Some(4096))
        ]
    );
    assert_eq!(b.pages(), 103);
}

#[test]
fn every_truncation_is_refused() {
    let bytes = stream(&all());
    let mut ends = vec![0];
    let mut at: &[u8] = &bytes;
    while !at.is_empty() {
        read_message(&mut at).unwrap();
        ends.push(bytes.len() - at.len());
    }
    for cut in 1..bytes.len() {
        if ends.contains(&cut) {
            continue;
        }
        assert!(read_all(&bytes[..cut]).is_err(), "cut at {cut} accepted");
    }
}

#[test]
fn every_flipped_byte_is_refused() {
    let one = stream(&[Message::Memory(batch())]);
    for i in 0..one.len() {
        let mut bad = one.clone();
        bad[i] ^= 0x40;
        if let Ok(m) = read_all(&bad) {
            panic!("byte {i} flipped, read {} messages", m.len());
        }
    }
}

#[test]
fn an_oversized_frame_is_refused_before_it_is_allocated() {
    let mut bad = vec![0xff, 0xff, 0xff, 0x7f, Command::State as u8];
    bad.extend_from_slice(&[0; 16]);
    let e = read_message(&mut bad.as_slice()).unwrap_err();
    assert!(matches!(e, ProtocolError::Oversized(_)), "{e}");
}

#[test]
fn a_foreign_or_other_version_hello_is_refused() {
    let mut foreign = stream(&[Message::Hello { version: VERSION }]);
    foreign[5] = b'X';
    let len = foreign.len();
    let crc = crc32fast::hash(&foreign[4..len - 4]);
    foreign[len - 4..].copy_from_slice(&crc.to_le_bytes());
    let e = read_message(&mut foreign.as_slice()).unwrap_err();
    assert!(matches!(e, ProtocolError::Foreign), "{e}");
    let other = read_message(&mut stream(&[Message::Hello { version: 9 }]).as_slice()).unwrap();
    let e = check_hello(&other).unwrap_err();
    assert_eq!(
        e.to_string(),
        "migration protocol version 9, this tandem speaks 1"
    );
    // An HTTP request is not a migration stream: its "length" is over the limit.
    assert!(read_message(&mut &b"GET / HTTP/1.1\r\n\r\n"[..]).is_err());
}

#[test]
fn reordered_messages_are_refused_where_they_come() {
    let bytes = stream(&[
        Message::Memory(batch()),
        Message::Hello { version: VERSION },
    ]);
    let e = expect(&mut bytes.as_slice(), Command::Hello).unwrap_err();
    assert_eq!(e.to_string(), "expected Hello, got Memory");
    let bytes = stream(&[Message::Abandon("disk full".into())]);
    let e = expect(&mut bytes.as_slice(), Command::Accept).unwrap_err();
    assert_eq!(e.to_string(), "the peer abandoned the migration: disk full");
}

/// A frame with `payload` under `command`, its checksum right.
fn frame(command: Command, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_le_bytes().to_vec();
    f.push(command as u8);
    f.extend_from_slice(payload);
    let crc = crc32fast::hash(&f[4..]);
    f.extend_from_slice(&crc.to_le_bytes());
    f
}

#[test]
fn a_batch_that_lies_about_its_data_is_refused() {
    let good = encode_batch(&batch()).unwrap();
    // One data byte short, one too many.
    for p in [
        &good[..good.len() - 1],
        &[&good[..], &[0u8][..]].concat()[..],
    ] {
        let e = read_message(&mut frame(Command::Memory, p).as_slice()).unwrap_err();
        assert!(matches!(e, ProtocolError::Malformed { .. }), "{e}");
    }
    // More ranges than a batch takes, a table cut short, an empty range.
    let mut many = ((BATCH_RANGES + 1) as u32).to_le_bytes().to_vec();
    many.extend_from_slice(&[0; 13]);
    let mut empty = 1u32.to_le_bytes().to_vec();
    empty.extend_from_slice(&[0; 8]);
    empty.extend_from_slice(&0u32.to_le_bytes());
    empty.push(1);
    for p in [&many[..], &good[..20], &empty[..]] {
        let e = read_message(&mut frame(Command::Memory, p).as_slice()).unwrap_err();
        assert!(matches!(e, ProtocolError::Malformed { .. }), "{e}");
    }
    // Trailing bytes after an empty message.
    let e = read_message(&mut frame(Command::Go, b"x").as_slice()).unwrap_err();
    assert!(matches!(e, ProtocolError::Malformed { .. }), "{e}");
    let e = read_message(&mut frame(Command::Memory, &[]).as_slice()).unwrap_err();
    assert!(matches!(e, ProtocolError::Malformed { .. }), "{e}");
    let e = read_message(&mut frame(Command::Config, b"{}").as_slice()).unwrap_err();
    assert!(matches!(e, ProtocolError::Malformed { .. }), "{e}");
    let mut unknown = frame(Command::Go, &[]);
    unknown[4] = 99;
    let n = unknown.len();
    let crc = crc32fast::hash(&unknown[4..n - 4]);
    unknown[n - 4..].copy_from_slice(&crc.to_le_bytes());
    let e = read_message(&mut unknown.as_slice()).unwrap_err();
    assert!(matches!(e, ProtocolError::UnknownCommand(99)), "{e}");
}

#[test]
fn a_batch_outside_the_layout_is_refused() {
    let layout = [(0, 0x30_0000)];
    batch().check(&layout).unwrap();
    for r in [
        PageRange {
            gpa: 0x2f_f000,
            pages: 2,
            zero: true,
        },
        PageRange {
            gpa: 0x1001,
            pages: 1,
            zero: true,
        },
        PageRange {
            gpa: !0xfff,
            pages: u32::MAX,
            zero: true,
        },
        PageRange {
            gpa: 0x40_0000,
            pages: 1,
            zero: true,
        },
    ] {
        let b = MemoryBatch {
            ranges: vec![r],
            data: vec![],
        };
        let e = b.check(&layout).unwrap_err();
        assert!(matches!(e, ProtocolError::OutsideMemory { .. }), "{e}");
    }
    // Two regions: a range across the gap between them is outside.
    let two = [(0, 0x10_0000), (0x20_0000, 0x10_0000)];
    let across = MemoryBatch {
        ranges: vec![PageRange {
            gpa: 0xf_f000,
            pages: 2,
            zero: true,
        }],
        data: vec![],
    };
    assert!(across.check(&two).is_err());
}

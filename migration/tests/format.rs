//! The snapshot container: round trips, and refusal of damaged, truncated, foreign, newer
//! and forged files.

mod common;

use std::io::{BufWriter, Write};

use common::{build, forge, open, reseal, Raw};
use migration::format::{
    FormatError, SectionKind, SnapshotWriter, FORMAT_VERSION, MAX_STATE_SECTION,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Thing {
    name: String,
    values: Vec<u64>,
}

fn thing() -> Thing {
    Thing {
        name: "net0".into(),
        values: vec![1, 2, u64::MAX],
    }
}

/// A small snapshot with two state sections and a raw memory section.
fn small() -> Vec<u8> {
    build(|w| {
        w.write_state("manifest", &thing()).unwrap();
        w.write_state("vcpu.0", &vec![7u32; 5]).unwrap();
        w.write_section("memory", SectionKind::Memory, &[0xaa; 40])
            .unwrap();
    })
}

#[test]
fn round_trip_keeps_sections_in_order() {
    let file = small();
    let mut r = open(&file).unwrap();
    let names: Vec<&str> = r.sections().iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["manifest", "vcpu.0", "memory"]);
    assert_eq!(r.file_len(), file.len() as u64);
    assert_eq!(r.read_state::<Thing>("manifest").unwrap(), thing());
    assert_eq!(r.read_state::<Vec<u32>>("vcpu.0").unwrap(), vec![7u32; 5]);
    let (len, mut body) = r.section_reader("memory", SectionKind::Memory).unwrap();
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut body, &mut bytes).unwrap();
    assert_eq!((len, bytes), (40, vec![0xaa; 40]));
}

#[test]
fn empty_snapshot_round_trips() {
    let file = build(|_| {});
    assert_eq!(file.len(), 16 + 17);
    assert!(open(&file).unwrap().sections().is_empty());
}

#[test]
fn snapshot_streams_to_and_from_a_real_file() {
    let path = std::env::temp_dir().join(format!("tandem-format-{}.snap", std::process::id()));
    let file = std::fs::File::create(&path).unwrap();
    let mut w = SnapshotWriter::new(BufWriter::new(file)).unwrap();
    w.write_state("manifest", &thing()).unwrap();
    w.write_section_with("memory", SectionKind::Memory, 3 << 20, |out| {
        for i in 0..3u8 {
            out.write_all(&vec![i; 1 << 20])?;
        }
        Ok(())
    })
    .unwrap();
    w.finish().unwrap().flush().unwrap();
    let mut r = migration::SnapshotReader::open(std::fs::File::open(&path).unwrap()).unwrap();
    assert_eq!(r.read_state::<Thing>("manifest").unwrap(), thing());
    assert_eq!(r.section("memory").unwrap().len, 3 << 20);
    std::fs::remove_file(&path).unwrap();
}

/// [`small`] as format version 2 wrote it.
fn small_v2() -> Vec<u8> {
    let mut w = SnapshotWriter::with_version(Vec::new(), 2).unwrap();
    w.write_state("manifest", &thing()).unwrap();
    w.write_state("vcpu.0", &vec![7u32; 5]).unwrap();
    w.write_section("memory", SectionKind::Memory, &[0xaa; 40])
        .unwrap();
    w.finish().unwrap()
}

/// Version 2 checks the CRC first: every flip past the version is damage.
#[test]
fn every_damaged_byte_is_refused_with_the_right_error() {
    let file = small_v2();
    for at in 0..file.len() {
        let mut bad = file.clone();
        bad[at] ^= 0x5a;
        let err = open(&bad)
            .err()
            .unwrap_or_else(|| panic!("flip at {at} accepted"));
        match at {
            0..8 => assert!(matches!(err, FormatError::NotASnapshot), "{at}: {err}"),
            8..12 => assert!(matches!(err, FormatError::Version { .. }), "{at}: {err}"),
            _ => assert!(
                matches!(err, FormatError::Crc { .. }),
                "flip at {at} gave {err}"
            ),
        }
    }
}

/// Version 3 walks the structure first (its CRC skips the pages bodies the
/// walk finds): every flip is refused, a flip inside a section's body is
/// damage, and one in the structure may read as malformed or truncated.
#[test]
fn every_damaged_byte_of_a_version_3_file_is_refused() {
    let file = small();
    let bodies: Vec<(usize, usize)> = open(&file)
        .unwrap()
        .sections()
        .iter()
        .map(|s| (s.offset as usize, (s.offset + s.len) as usize))
        .collect();
    for at in 0..file.len() {
        let mut bad = file.clone();
        bad[at] ^= 0x5a;
        let err = open(&bad)
            .err()
            .unwrap_or_else(|| panic!("flip at {at} accepted"));
        if bodies.iter().any(|&(from, to)| (from..to).contains(&at)) {
            assert!(
                matches!(err, FormatError::Crc { .. }),
                "flip at {at} gave {err}"
            );
        }
    }
}

#[test]
fn damage_message_says_the_file_is_damaged() {
    let mut file = small();
    let body = file.len() / 2;
    file[body] ^= 1;
    let msg = open(&file).err().unwrap().to_string();
    assert!(
        msg.starts_with("CRC mismatch: the file is damaged"),
        "{msg}"
    );
}

#[test]
fn truncation_at_every_length_is_refused() {
    let file = small();
    for n in 0..file.len() {
        let err = open(&file[..n])
            .err()
            .unwrap_or_else(|| panic!("{n} bytes accepted"));
        if n == 0 {
            assert!(matches!(err, FormatError::NotASnapshot));
        } else {
            assert!(
                matches!(err, FormatError::Truncated { at, .. } if at == n as u64),
                "{n} bytes gave {err}"
            );
            assert!(err
                .to_string()
                .starts_with(&format!("truncated at byte {n}")));
        }
    }
}

#[test]
fn foreign_files_are_refused() {
    let mut elf = vec![0x7f, b'E', b'L', b'F', 2, 1, 1, 0];
    elf.resize(64, 0);
    let mut state = 0x1234_5678_9abc_def0u64;
    let random: Vec<u8> = (0..4096)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let foreign: [&[u8]; 5] = [
        b"",
        &elf,
        &random,
        b"{\"mem\": 128}\n",
        b"TANDEMSX\x01\0\0\0\0\0\0\0",
    ];
    for f in foreign {
        let err = open(f).err().unwrap();
        assert!(matches!(err, FormatError::NotASnapshot), "{err}");
        assert!(err.to_string().starts_with("not a tandem snapshot"));
    }
}

#[test]
fn other_format_versions_are_refused() {
    assert_eq!(FORMAT_VERSION, 3);
    for version in [0, 1, 4, u32::MAX] {
        let file = forge(version, &[]);
        let err = open(&file).err().unwrap();
        assert_eq!(
            err.to_string(),
            format!("snapshot format version {version}, this tandem reads 2 and 3")
        );
    }
    // Version 2 files still open, and the writer still makes them on request.
    open(&forge(2, &[])).unwrap();
    let mut w = SnapshotWriter::with_version(Vec::new(), 2).unwrap();
    w.write_state("manifest", &1).unwrap();
    assert_eq!(open(&w.finish().unwrap()).unwrap().version(), 2);
    assert!(SnapshotWriter::with_version(Vec::new(), 1).is_err());
}

#[test]
fn pages_sections_are_page_aligned_and_outside_the_crc() {
    let pages = vec![0x5au8; 2 * 4096];
    let mut w = SnapshotWriter::new(Vec::new()).unwrap();
    w.write_state("manifest", &"m").unwrap();
    w.write_section("p", SectionKind::Pages, &pages).unwrap();
    w.write_state("after", &2).unwrap();
    let mut file = w.finish().unwrap();
    let r = open(&file).unwrap();
    let s = r.section("p").unwrap().clone();
    let after = r.section("after").unwrap().offset as usize;
    drop(r);
    assert_eq!((s.offset % 4096, s.len), (0, 8192));
    assert_eq!(&file[s.offset as usize..][..8192], &pages[..]);
    // A damaged page leaves the file's CRC whole (its owner checks it) ...
    file[s.offset as usize + 100] ^= 1;
    open(&file).unwrap();
    // ... a damaged byte anywhere else does not.
    file[after] ^= 1;
    assert!(matches!(
        open(&file).err().unwrap(),
        FormatError::Crc { .. }
    ));
    // The writer refuses a pages section of a version 2 file, or of a length that is
    // not a page multiple.
    let mut w = SnapshotWriter::with_version(Vec::new(), 2).unwrap();
    assert!(w.write_section("p", SectionKind::Pages, &pages).is_err());
    let mut w = SnapshotWriter::new(Vec::new()).unwrap();
    assert!(w
        .write_section("p", SectionKind::Pages, &pages[..100])
        .is_err());
}

#[test]
fn forged_pages_sections_are_refused() {
    let raw = |len, body| Raw {
        kind: 3,
        name: "p",
        len,
        body,
    };
    // Not in a version 2 file.
    let err = open(&forge(2, &[raw(0, b"")])).err().unwrap();
    assert!(matches!(err, FormatError::Malformed { .. }), "{err}");
    // Not of a length that is not a page multiple.
    let err = open(&forge(3, &[raw(100, &[0; 100])])).err().unwrap();
    assert!(matches!(err, FormatError::Malformed { .. }), "{err}");
    // Not past the end of the file.
    let err = open(&forge(3, &[raw(1 << 40, b"")])).err().unwrap();
    assert!(matches!(err, FormatError::Malformed { .. }), "{err}");
}

#[test]
fn hostile_section_lengths_are_refused_without_allocating() {
    for (kind, len) in [(1u8, u64::MAX), (2, u64::MAX), (1, 1 << 40), (2, 100)] {
        let file = forge(
            FORMAT_VERSION,
            &[Raw {
                kind,
                name: "x",
                len,
                body: b"{}",
            }],
        );
        let err = open(&file).err().unwrap();
        assert!(matches!(err, FormatError::Malformed { .. }), "{len}: {err}");
    }
    // The same lengths in a file whose trailer is cut off read as truncation.
    let mut file = forge(
        FORMAT_VERSION,
        &[Raw {
            kind: 2,
            name: "x",
            len: u64::MAX,
            body: b"",
        }],
    );
    file.truncate(file.len() - 17);
    assert!(matches!(
        open(&file).err().unwrap(),
        FormatError::Truncated { .. }
    ));
}

#[test]
fn state_sections_over_the_cap_are_refused() {
    let big = vec![b' '; MAX_STATE_SECTION as usize + 1];
    let file = forge(
        FORMAT_VERSION,
        &[Raw {
            kind: 1,
            name: "vm",
            len: big.len() as u64,
            body: &big,
        }],
    );
    assert!(matches!(
        open(&file).err().unwrap(),
        FormatError::StateTooLarge { .. }
    ));
    let mut w = SnapshotWriter::new(Vec::new()).unwrap();
    assert!(matches!(
        w.write_section("vm", SectionKind::State, &big),
        Err(FormatError::StateTooLarge { .. })
    ));
    // Refused before anything was written: the writer is still usable.
    w.write_state("vm", &1).unwrap();
    w.finish().unwrap();
}

#[test]
fn trailing_garbage_is_refused() {
    let mut file = small();
    let end = file.len() as u64;
    file.extend_from_slice(b"junk");
    let err = open(&file).err().unwrap();
    assert!(
        matches!(err, FormatError::TrailingGarbage { end: e, len } if e == end && len == end + 4),
        "{err}"
    );
}

#[test]
fn forged_structures_are_refused() {
    let raw = |kind, name| Raw {
        kind,
        name,
        len: 2,
        body: b"{}",
    };
    let cases = [
        forge(FORMAT_VERSION, &[raw(9, "x")]),
        forge(FORMAT_VERSION, &[raw(1, "a b")]),
        forge(FORMAT_VERSION, &[raw(1, "x"), raw(1, "x")]),
    ];
    for file in cases {
        let err = open(&file).err().unwrap();
        assert!(matches!(err, FormatError::Malformed { .. }), "{err}");
    }
    // A trailer that miscounts the sections.
    let mut file = forge(FORMAT_VERSION, &[raw(1, "x")]);
    file.truncate(file.len() - 4);
    let count_at = file.len() - 12;
    file[count_at] = 2;
    assert!(matches!(
        open(&reseal(file)).err().unwrap(),
        FormatError::Malformed { .. }
    ));
    // A nonzero reserved header field.
    let mut file = forge(FORMAT_VERSION, &[]);
    file.truncate(file.len() - 4);
    file[12] = 1;
    assert!(matches!(
        open(&reseal(file)).err().unwrap(),
        FormatError::Malformed { at: 12, .. }
    ));
}

#[test]
fn writer_refuses_bad_names_duplicates_and_wrong_lengths() {
    let mut w = SnapshotWriter::new(Vec::new()).unwrap();
    for name in ["", "a b", "é", &"x".repeat(65)] {
        assert!(matches!(
            w.write_state(name, &1),
            Err(FormatError::BadName(_))
        ));
    }
    w.write_state(&"x".repeat(64), &1).unwrap();
    w.write_state("vcpu.0", &1).unwrap();
    assert!(matches!(
        w.write_state("vcpu.0", &2),
        Err(FormatError::DuplicateName(_))
    ));
    let short = w.write_section_with("memory", SectionKind::Memory, 10, |out| {
        out.write_all(&[1; 9])
    });
    assert!(matches!(
        short,
        Err(FormatError::LengthMismatch {
            written: 9,
            declared: 10,
            ..
        })
    ));
    assert!(matches!(w.write_state("y", &1), Err(FormatError::Poisoned)));
    assert!(matches!(w.finish(), Err(FormatError::Poisoned)));

    let mut w = SnapshotWriter::new(Vec::new()).unwrap();
    let long = w.write_section_with("m", SectionKind::Memory, 10, |out| out.write_all(&[1; 11]));
    assert!(matches!(long, Err(FormatError::Io(_))));
    assert!(matches!(w.finish(), Err(FormatError::Poisoned)));
}

#[test]
fn sections_are_found_by_name_and_kind() {
    let file = small();
    let mut r = open(&file).unwrap();
    assert!(matches!(
        r.read_state::<Thing>("vm"),
        Err(FormatError::MissingSection(_))
    ));
    assert!(matches!(
        r.read_state::<Thing>("memory"),
        Err(FormatError::WrongKind { .. })
    ));
    assert!(matches!(
        r.section_reader("manifest", SectionKind::Memory),
        Err(FormatError::WrongKind { .. })
    ));
    let err = r.read_state::<Thing>("vcpu.0").err().unwrap();
    assert!(matches!(err, FormatError::Decode { .. }));
    assert!(err
        .to_string()
        .starts_with("state section \"vcpu.0\" does not decode"));
}

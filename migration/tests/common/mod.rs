//! Helpers shared by the migration crate's tests: snapshots in memory and forged files.

#![allow(dead_code)]

use std::io::Cursor;

use migration::format::{FormatError, SnapshotReader, SnapshotWriter};

/// Opens a snapshot held in memory.
pub fn open(bytes: &[u8]) -> Result<SnapshotReader<Cursor<&[u8]>>, FormatError> {
    SnapshotReader::open(Cursor::new(bytes))
}

/// Writes a snapshot into memory through `f`.
pub fn build(f: impl FnOnce(&mut SnapshotWriter<Vec<u8>>)) -> Vec<u8> {
    let mut w = SnapshotWriter::new(Vec::new()).unwrap();
    f(&mut w);
    w.finish().unwrap()
}

/// A raw section for [`forge`]: kind code, name, declared length, body bytes.
pub struct Raw<'a> {
    pub kind: u8,
    pub name: &'a str,
    pub len: u64,
    pub body: &'a [u8],
}

/// Lays out a file by hand (any version, any lengths) with a correct trailer and CRC, as
/// a forger would.
pub fn forge(version: u32, sections: &[Raw<'_>]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(b"TANDEMSN");
    f.extend_from_slice(&version.to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    for s in sections {
        f.push(b'S');
        f.push(s.kind);
        f.push(s.name.len() as u8);
        f.extend_from_slice(s.name.as_bytes());
        f.extend_from_slice(&s.len.to_le_bytes());
        f.extend_from_slice(s.body);
    }
    f.push(b'E');
    f.extend_from_slice(&(sections.len() as u32).to_le_bytes());
    let total = f.len() as u64 + 8 + 4;
    f.extend_from_slice(&total.to_le_bytes());
    reseal(f)
}

/// Appends the CRC of `f`.
pub fn reseal(mut f: Vec<u8>) -> Vec<u8> {
    let crc = crc32fast::hash(&f);
    f.extend_from_slice(&crc.to_le_bytes());
    f
}

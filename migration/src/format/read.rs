//! Reading a snapshot file: [`SnapshotReader::open`] verifies it completely (see the
//! parent module for the order) and keeps an index of its sections. Runs on whichever
//! thread restores; reads only, never writes; every length in the file is checked
//! against the file's real size before it is used.

use std::collections::HashSet;
use std::io::{self, Read, Seek, SeekFrom};
use std::ops::ControlFlow;

use serde::de::DeserializeOwned;

use super::{
    check_name, pad_to_page, FormatError, Result, SectionKind, FORMAT_VERSION, HEADER_LEN,
    IO_CHUNK, MAGIC, MAX_NAME_LEN, MAX_STATE_SECTION, OLDEST_VERSION, PAGE_ALIGN, SECTION_TAG,
    TRAILER_LEN, TRAILER_TAG,
};

/// Where one verified section lies in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SectionInfo {
    /// The section's name.
    pub name: String,
    /// What it holds.
    pub kind: SectionKind,
    /// Offset of its body in the file.
    pub offset: u64,
    /// Length of its body.
    pub len: u64,
}

/// How a walk over the section structure ended.
enum Walk {
    /// A trailer at `at`, ending exactly at the end of the file.
    Whole {
        sections: Vec<SectionInfo>,
        count: u32,
        total: u64,
        at: u64,
    },
    /// The structure asks for bytes past the end of the file.
    Truncated(&'static str),
    /// A trailer that ends before the end of the file.
    Garbage { end: u64, inside: &'static str },
    /// Something that cannot be part of a snapshot.
    Bad(FormatError),
}

/// A verified snapshot: an index of its sections over the reader it came from.
pub struct SnapshotReader<R: Read + Seek> {
    inner: R,
    version: u32,
    len: u64,
    sections: Vec<SectionInfo>,
}

impl<R: Read + Seek> SnapshotReader<R> {
    /// Verifies the whole file (see the module doc for the order) and indexes its sections.
    pub fn open(mut inner: R) -> Result<Self> {
        let len = inner.seek(SeekFrom::End(0))?;
        let version = read_version(&mut inner, len)?;
        let trailer_looks_whole = len >= HEADER_LEN + TRAILER_LEN && {
            let mut t = [0u8; TRAILER_LEN as usize];
            inner.seek(SeekFrom::Start(len - TRAILER_LEN))?;
            inner.read_exact(&mut t)?;
            t[0] == TRAILER_TAG && u64_at(&t, 5) == len
        };
        // Version 2's CRC covers every byte, so it is checked first; version 3's skips
        // the pages bodies, which only the walk locates.
        let early_crc = version < 3;
        if trailer_looks_whole && early_crc {
            check_crc(&mut inner, len, &[])?;
        }
        let walk = walk(&mut inner, len, version)?;
        let (sections, count, total, at) = match walk {
            Walk::Whole {
                sections,
                count,
                total,
                at,
            } => (sections, count, total, at),
            // Only reached when the trailer did not state the file's length.
            // A whole-looking trailer with a correct CRC: the lengths inside are forged.
            Walk::Truncated(inside) | Walk::Garbage { inside, .. } if trailer_looks_whole => {
                return Err(FormatError::Malformed {
                    at: HEADER_LEN,
                    reason: format!("the {inside} does not end where the trailer says"),
                })
            }
            Walk::Truncated(inside) => return Err(FormatError::Truncated { at: len, inside }),
            Walk::Garbage { end, .. } => return Err(FormatError::TrailingGarbage { end, len }),
            Walk::Bad(e) => {
                if !trailer_looks_whole && early_crc {
                    check_crc(&mut inner, len, &[])?;
                }
                return Err(e);
            }
        };
        // Version 3 always checks here, version 2 when it could not check first
        // (for version 2 there are no pages bodies to skip).
        if !early_crc || !trailer_looks_whole {
            check_crc(&mut inner, len, &pages_bodies(&sections, version))?;
        }
        if !trailer_looks_whole {
            // The walk found a trailer at the end whose length field is wrong.
            return Err(FormatError::Malformed {
                at: at + 5,
                reason: format!("trailer gives a total length of {total}, the file has {len}"),
            });
        }
        if count as usize != sections.len() {
            return Err(FormatError::Malformed {
                at: at + 1,
                reason: format!(
                    "trailer counts {count} sections, the file has {}",
                    sections.len()
                ),
            });
        }
        Ok(SnapshotReader {
            inner,
            version,
            len,
            sections,
        })
    }

    /// The file's length in bytes.
    pub fn file_len(&self) -> u64 {
        self.len
    }

    /// The file's format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The reader the file is read through (e.g. the `File`, to map pages from it).
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// All sections, in file order.
    pub fn sections(&self) -> &[SectionInfo] {
        &self.sections
    }

    /// The section called `name`, if there is one.
    pub fn section(&self, name: &str) -> Option<&SectionInfo> {
        self.sections.iter().find(|s| s.name == name)
    }

    /// The section called `name`, which must be of `kind`.
    pub fn expect_section(&self, name: &str, kind: SectionKind) -> Result<SectionInfo> {
        let s = self
            .section(name)
            .ok_or_else(|| FormatError::MissingSection(name.to_string()))?;
        if s.kind != kind {
            return Err(FormatError::WrongKind {
                name: name.to_string(),
                found: s.kind,
                expected: kind,
            });
        }
        Ok(s.clone())
    }

    /// Reads a state section's bytes (at most [`MAX_STATE_SECTION`], checked by `open`).
    pub fn read_state_bytes(&mut self, name: &str) -> Result<Vec<u8>> {
        let s = self.expect_section(name, SectionKind::State)?;
        let mut body = vec![0u8; s.len as usize];
        self.inner.seek(SeekFrom::Start(s.offset))?;
        self.inner.read_exact(&mut body)?;
        Ok(body)
    }

    /// Reads a state section and decodes it as `T`.
    pub fn read_state<T: DeserializeOwned>(&mut self, name: &str) -> Result<T> {
        let body = self.read_state_bytes(name)?;
        serde_json::from_slice(&body).map_err(|source| FormatError::Decode {
            name: name.to_string(),
            source,
        })
    }

    /// A reader over the body of section `name`, which must be of `kind`, and its length.
    pub fn section_reader(
        &mut self,
        name: &str,
        kind: SectionKind,
    ) -> Result<(u64, io::Take<&mut R>)> {
        let s = self.expect_section(name, kind)?;
        self.inner.seek(SeekFrom::Start(s.offset))?;
        Ok((s.len, (&mut self.inner).take(s.len)))
    }
}

/// Checks the magic and reads the format version (one this build reads).
fn read_version<R: Read + Seek>(inner: &mut R, len: u64) -> Result<u32> {
    inner.seek(SeekFrom::Start(0))?;
    let mut head = [0u8; HEADER_LEN as usize];
    let got = read_up_to(inner, &mut head)?;
    if got == 0 || head[..got.min(8)] != MAGIC[..got.min(8)] {
        return Err(FormatError::NotASnapshot);
    }
    if got < HEADER_LEN as usize {
        return Err(FormatError::Truncated {
            at: len,
            inside: "header",
        });
    }
    let version = u32_at(&head, 8);
    if !(OLDEST_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(FormatError::Version {
            found: version,
            oldest: OLDEST_VERSION,
            supported: FORMAT_VERSION,
        });
    }
    Ok(version)
}

/// Reads as much of `buf` as the input has; returns how much that was.
fn read_up_to<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// The CRC a well-formed file of this structure must end with: over every
/// byte before the last four, less the bodies of pages sections (version
/// 3). For tools that rewrite a file (and the fuzz harness, which reseals
/// mutated files); `None` when the structure does not walk to a trailer.
pub fn expected_crc<R: Read + Seek>(r: &mut R) -> Result<Option<u32>> {
    let len = r.seek(SeekFrom::End(0))?;
    let mut head = [0u8; HEADER_LEN as usize];
    r.seek(SeekFrom::Start(0))?;
    if read_up_to(r, &mut head)? < head.len() || len < HEADER_LEN + TRAILER_LEN {
        return Ok(None);
    }
    let version = u32_at(&head, 8);
    let Walk::Whole { sections, .. } = walk(r, len, version)? else {
        return Ok(None);
    };
    crc_over(r, len, &pages_bodies(&sections, version)).map(Some)
}

/// The `(offset, length)` of each pages body, which the file's CRC skips.
fn pages_bodies(sections: &[SectionInfo], version: u32) -> Vec<(u64, u64)> {
    sections
        .iter()
        .filter(|s| version >= 3 && s.kind == SectionKind::Pages)
        .map(|s| (s.offset, s.len))
        .collect()
}

/// The CRC of the file's bytes before its last four, leaving out the `skip`
/// ranges (`(offset, length)`, ascending, disjoint, inside the file).
fn crc_over<R: Read + Seek>(r: &mut R, len: u64, skip: &[(u64, u64)]) -> Result<u32> {
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; IO_CHUNK];
    let mut from = 0;
    let ends = skip
        .iter()
        .map(|&(at, n)| (at, at + n))
        .chain(std::iter::once((len - 4, len - 4)));
    for (until, resume) in ends {
        r.seek(SeekFrom::Start(from))?;
        let mut left = until.saturating_sub(from);
        while left > 0 {
            let n = left.min(IO_CHUNK as u64) as usize;
            r.read_exact(&mut buf[..n])?;
            hasher.update(&buf[..n]);
            left -= n as u64;
        }
        from = resume.max(from);
    }
    Ok(hasher.finalize())
}

/// Compares [`crc_over`] with the CRC in the file's last four bytes.
fn check_crc<R: Read + Seek>(r: &mut R, len: u64, skip: &[(u64, u64)]) -> Result<()> {
    let computed = crc_over(r, len, skip)?;
    r.seek(SeekFrom::Start(len - 4))?;
    let mut stored = [0u8; 4];
    r.read_exact(&mut stored)?;
    let stored = u32::from_le_bytes(stored);
    if stored != computed {
        return Err(FormatError::Crc { stored, computed });
    }
    Ok(())
}

fn malformed(at: u64, reason: String) -> FormatError {
    FormatError::Malformed { at, reason }
}

/// Walks section headers from the start, seeking over bodies; reads no body.
fn walk<R: Read + Seek>(r: &mut R, len: u64, version: u32) -> Result<Walk> {
    r.seek(SeekFrom::Start(8 + 4))?;
    let mut reserved = [0u8; 4];
    r.read_exact(&mut reserved)?;
    if reserved != [0; 4] {
        return Ok(Walk::Bad(malformed(
            12,
            "reserved header field is not zero".to_string(),
        )));
    }
    let mut pos = HEADER_LEN;
    let mut sections: Vec<SectionInfo> = Vec::new();
    let mut names = HashSet::new();
    loop {
        let mut tag = [0u8; 1];
        if pos + 1 > len {
            return Ok(Walk::Truncated("section list"));
        }
        r.seek(SeekFrom::Start(pos))?;
        r.read_exact(&mut tag)?;
        match tag[0] {
            TRAILER_TAG => return read_trailer(r, pos, len, sections),
            SECTION_TAG => {}
            other => {
                return Ok(Walk::Bad(malformed(
                    pos,
                    format!("expected a section (0x53) or the trailer (0x45), found {other:#04x}"),
                )))
            }
        }
        let section = match read_section_header(r, pos, len, version)? {
            ControlFlow::Continue(section) => section,
            ControlFlow::Break(end) => return Ok(end),
        };
        if !names.insert(section.name.clone()) {
            return Ok(Walk::Bad(malformed(
                pos + 3,
                format!("duplicate section name {:?}", section.name),
            )));
        }
        pos = section.offset + section.len;
        sections.push(section);
    }
}

/// [`walk`] at the trailer's tag (at `pos`, already read): the whole file's
/// outcome, given the `sections` walked before it.
fn read_trailer<R: Read + Seek>(
    r: &mut R,
    pos: u64,
    len: u64,
    sections: Vec<SectionInfo>,
) -> Result<Walk> {
    if len - pos < TRAILER_LEN {
        return Ok(Walk::Truncated("trailer"));
    }
    let mut t = [0u8; TRAILER_LEN as usize - 1];
    r.read_exact(&mut t)?;
    let end = pos + TRAILER_LEN;
    if end != len {
        return Ok(Walk::Garbage {
            end,
            inside: "trailer",
        });
    }
    Ok(Walk::Whole {
        sections,
        count: u32_at(&t, 0),
        total: u64_at(&t, 4),
        at: pos,
    })
}

/// [`walk`] at a section's tag (at `pos`, already read): the rest of its
/// header, checked; `Break` with the walk's outcome where it is bad or cut.
fn read_section_header<R: Read + Seek>(
    r: &mut R,
    pos: u64,
    len: u64,
    version: u32,
) -> Result<ControlFlow<Walk, SectionInfo>> {
    if len - pos < 3 {
        return Ok(ControlFlow::Break(Walk::Truncated("section header")));
    }
    let mut kn = [0u8; 2];
    r.read_exact(&mut kn)?;
    let known = SectionKind::from_code(kn[0]).filter(|k| *k != SectionKind::Pages || version >= 3);
    let Some(kind) = known else {
        return Ok(ControlFlow::Break(Walk::Bad(malformed(
            pos + 1,
            format!("unknown section kind {}", kn[0]),
        ))));
    };
    let name_len = u64::from(kn[1]);
    if name_len == 0 || name_len > MAX_NAME_LEN as u64 {
        return Ok(ControlFlow::Break(Walk::Bad(malformed(
            pos + 2,
            format!("section name length {name_len} is not 1..={MAX_NAME_LEN}"),
        ))));
    }
    if len - pos < 3 + name_len + 8 {
        return Ok(ControlFlow::Break(Walk::Truncated("section header")));
    }
    let mut name = vec![0u8; name_len as usize];
    r.read_exact(&mut name)?;
    let name = match String::from_utf8(name) {
        Ok(n) if check_name(&n).is_ok() => n,
        _ => {
            return Ok(ControlFlow::Break(Walk::Bad(malformed(
                pos + 3,
                "section name has characters outside A-Z a-z 0-9 . _ -".to_string(),
            ))))
        }
    };
    let mut body_len = [0u8; 8];
    r.read_exact(&mut body_len)?;
    let body_len = u64::from_le_bytes(body_len);
    let mut offset = pos + 3 + name_len + 8;
    if kind == SectionKind::Pages {
        if !body_len.is_multiple_of(PAGE_ALIGN) {
            return Ok(ControlFlow::Break(Walk::Bad(malformed(
                offset - 8,
                format!("pages section of {body_len} bytes, not a multiple of {PAGE_ALIGN}"),
            ))));
        }
        offset += pad_to_page(offset);
        if offset > len {
            return Ok(ControlFlow::Break(Walk::Truncated("section header")));
        }
    }
    if body_len > len - offset {
        return Ok(ControlFlow::Break(Walk::Truncated("section body")));
    }
    if kind == SectionKind::State && body_len > MAX_STATE_SECTION {
        return Ok(ControlFlow::Break(Walk::Bad(FormatError::StateTooLarge {
            name,
            len: body_len,
            max: MAX_STATE_SECTION,
        })));
    }
    Ok(ControlFlow::Continue(SectionInfo {
        name,
        kind,
        offset,
        len: body_len,
    }))
}

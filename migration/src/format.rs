//! The snapshot file format: a versioned container of named sections, closed by a CRC.
//!
//! This module owns the byte layout of a tandem snapshot file: it writes one as a stream
//! ([`SnapshotWriter`], to any `Write`: a file, a pipe, a socket) and verifies one completely
//! before anything in it is handed out ([`SnapshotReader::open`], from any `Read + Seek`).
//! It knows nothing of what a section holds beyond its kind; state sections are JSON (see
//! [`SnapshotWriter::write_state`]) and the memory image is encoded by [`crate::memory`].
//! A snapshot file is hostile input: nothing here panics on it, and no length read from it
//! is used for an allocation before it has been checked against the file's real size and
//! the caps below.
//!
//! # Byte layout, format version 2
//!
//! All integers are little-endian.
//!
//! ```text
//! offset  size  field
//! 0       8     magic: the ASCII bytes "TANDEMSN"
//! 8       4     format version (u32): 2
//! 12      4     reserved (u32): 0
//! 16            sections, one after another, each:
//!                 1  tag: 0x53 ('S')
//!                 1  kind: 1 = state (a JSON document, at most 16 MiB),
//!                          2 = memory image (see crate::memory)
//!                 1  name length n, 1..=64
//!                 n  name: ASCII letters, digits, '.', '_', '-'; unique in the file
//!                 8  body length L (u64)
//!                 L  body
//!               then the trailer, which ends the file:
//!                 1  tag: 0x45 ('E')
//!                 4  number of sections (u32)
//!                 8  total length of the file in bytes, trailer and CRC included (u64)
//!                 4  CRC32 (IEEE 802.3, as computed by crc32fast) of every byte before it
//! ```
//!
//! Version history: 1, the first; 2, the same container, with the `vm` and `vcpu.N`
//! sections holding kvm-bindings' encodings of the KVM structures and each vCPU's CPUID
//! entries and TSC frequency added. A file of another version is refused with
//! "snapshot format version N, this tandem reads 2".
//!
//! The section count and total length sit in a trailer rather than a header so that the
//! writer streams: it never seeks, holds no section in memory, and computes the CRC as the
//! bytes go out. A 16 GiB guest is written in one pass through a small buffer.
//!
//! # Verification order
//!
//! [`SnapshotReader::open`] streams the whole file once through the CRC and walks the
//! section headers (seeking over bodies), in constant memory, checking in this order:
//! 1. magic (a foreign or empty file: [`FormatError::NotASnapshot`]), then the format
//!    version (any other: [`FormatError::Version`]) — other versions may lay out the rest
//!    differently, so nothing after them is read;
//! 2. if the last 17 bytes are a trailer that states the file's real length, the CRC over
//!    the whole file ([`FormatError::Crc`]: the file is damaged), then the section
//!    structure (which a correct CRC makes a writer bug or a forged file:
//!    [`FormatError::Malformed`]);
//! 3. otherwise the structure is walked from the start to tell a truncated file
//!    ([`FormatError::Truncated`]), one with bytes after its trailer
//!    ([`FormatError::TrailingGarbage`]) and a damaged one (CRC mismatch) apart.
//!
//! Only then is an index of sections (name, kind, offset, length) kept, and sections are
//! read from it on request. The file must not be changed while a reader has it open.

use std::collections::HashSet;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::ops::ControlFlow;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// The eight bytes every tandem snapshot starts with.
pub const MAGIC: [u8; 8] = *b"TANDEMSN";
/// The format version this tandem writes and reads.
pub const FORMAT_VERSION: u32 = 2;
/// The largest state section accepted, in bytes.
pub const MAX_STATE_SECTION: u64 = 16 << 20;
/// The longest section name, in bytes.
pub const MAX_NAME_LEN: usize = 64;

const HEADER_LEN: u64 = 16;
const SECTION_TAG: u8 = b'S';
const TRAILER_TAG: u8 = b'E';
const TRAILER_LEN: u64 = 1 + 4 + 8 + 4;
const IO_CHUNK: usize = 256 << 10;

/// Errors of the snapshot container.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// Reading or writing the underlying file failed.
    #[error("snapshot I/O: {0}")]
    Io(#[from] io::Error),
    /// The file does not start with [`MAGIC`].
    #[error("not a tandem snapshot (the file does not start with \"TANDEMSN\")")]
    NotASnapshot,
    /// The file is a tandem snapshot of another format version.
    #[error("snapshot format version {found}, this tandem reads {supported}")]
    Version {
        /// The version in the file.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// The file ends before the snapshot does.
    #[error("truncated at byte {at}: the snapshot ends inside its {inside}")]
    Truncated {
        /// The file's length: where its bytes run out.
        at: u64,
        /// What was being read when they did.
        inside: &'static str,
    },
    /// The CRC does not match the bytes.
    #[error(
        "CRC mismatch: the file is damaged (stored {stored:#010x}, computed {computed:#010x})"
    )]
    Crc {
        /// The CRC stored in the file.
        stored: u32,
        /// The CRC of the bytes actually read.
        computed: u32,
    },
    /// Bytes follow the trailer.
    #[error("trailing garbage: the snapshot ends at byte {end} but the file has {len} bytes")]
    TrailingGarbage {
        /// Where the snapshot's trailer ends.
        end: u64,
        /// The file's length.
        len: u64,
    },
    /// The CRC matches but the structure is wrong (a writer bug or a forged file).
    #[error("malformed snapshot at byte {at}: {reason}")]
    Malformed {
        /// Offset of the offending field.
        at: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// A state section is larger than [`MAX_STATE_SECTION`].
    #[error("state section {name:?} is {len} bytes, over the cap of {max} bytes")]
    StateTooLarge {
        /// The section's name.
        name: String,
        /// Its length.
        len: u64,
        /// The cap.
        max: u64,
    },
    /// A section name is empty, too long or has characters outside the allowed set.
    #[error("invalid section name {0:?}: 1 to 64 of A-Z a-z 0-9 . _ -")]
    BadName(String),
    /// A writer was asked for a second section of the same name.
    #[error("duplicate section name {0:?}")]
    DuplicateName(String),
    /// A section body did not have the length declared for it.
    #[error("section {name:?}: {written} bytes written, {declared} declared")]
    LengthMismatch {
        /// The section's name.
        name: String,
        /// Bytes the body writer produced.
        written: u64,
        /// Bytes declared in the section header.
        declared: u64,
    },
    /// An earlier write failed, so the output is unusable.
    #[error("the snapshot writer failed earlier; its output is incomplete")]
    Poisoned,
    /// The snapshot has no section of that name.
    #[error("the snapshot has no section {0:?}")]
    MissingSection(String),
    /// The section exists but is of another kind.
    #[error("section {name:?} is a {found:?} section, not a {expected:?} section")]
    WrongKind {
        /// The section's name.
        name: String,
        /// Its kind in the file.
        found: SectionKind,
        /// The kind asked for.
        expected: SectionKind,
    },
    /// A state section does not serialize.
    #[error("state section {name:?} does not encode: {source}")]
    Encode {
        /// The section's name.
        name: String,
        /// The serializer's error.
        source: serde_json::Error,
    },
    /// A state section does not deserialize into the type asked for.
    #[error("state section {name:?} does not decode: {source}")]
    Decode {
        /// The section's name.
        name: String,
        /// The deserializer's error.
        source: serde_json::Error,
    },
}

type Result<T> = std::result::Result<T, FormatError>;

/// What a section holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SectionKind {
    /// A JSON document of at most [`MAX_STATE_SECTION`] bytes.
    State,
    /// A guest memory image ([`crate::memory`]); bounded only by the file.
    Memory,
}

impl SectionKind {
    fn code(self) -> u8 {
        match self {
            SectionKind::State => 1,
            SectionKind::Memory => 2,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(SectionKind::State),
            2 => Some(SectionKind::Memory),
            _ => None,
        }
    }
}

/// Checks a section name against the rules of the layout.
fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(FormatError::BadName(name.to_string()))
    }
}

/// Writes to the output and feeds the CRC, counting bytes.
struct CrcOut<W: Write> {
    out: W,
    crc: crc32fast::Hasher,
    offset: u64,
}

impl<W: Write> CrcOut<W> {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.crc.update(bytes);
        self.offset += bytes.len() as u64;
        Ok(())
    }
}

/// The body of one section being written; refuses bytes past the declared length.
struct BodyWriter<'a, W: Write> {
    out: &'a mut CrcOut<W>,
    left: u64,
}

impl<W: Write> Write for BodyWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.len() as u64 > self.left {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "section body longer than declared",
            ));
        }
        self.out.put(buf)?;
        self.left -= buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.out.flush()
    }
}

/// Streams a snapshot to any `Write`: header, sections, then [`SnapshotWriter::finish`].
///
/// Give it a buffered writer (`BufWriter<File>`): bodies are written in page-sized pieces.
/// If any call fails the writer is poisoned and the output has no valid trailer, so it can
/// never be mistaken for a whole snapshot.
pub struct SnapshotWriter<W: Write> {
    out: CrcOut<W>,
    count: u32,
    names: HashSet<String>,
    poisoned: bool,
}

impl<W: Write> SnapshotWriter<W> {
    /// Starts a snapshot: writes the header.
    pub fn new(out: W) -> Result<Self> {
        let mut w = SnapshotWriter {
            out: CrcOut {
                out,
                crc: crc32fast::Hasher::new(),
                offset: 0,
            },
            count: 0,
            names: HashSet::new(),
            poisoned: true,
        };
        w.out.put(&MAGIC)?;
        w.out.put(&FORMAT_VERSION.to_le_bytes())?;
        w.out.put(&0u32.to_le_bytes())?;
        w.poisoned = false;
        Ok(w)
    }

    /// Bytes written so far.
    pub fn offset(&self) -> u64 {
        self.out.offset
    }

    /// Writes `state` as a JSON state section.
    pub fn write_state<T: Serialize>(&mut self, name: &str, state: &T) -> Result<()> {
        let body = serde_json::to_vec(state).map_err(|source| FormatError::Encode {
            name: name.to_string(),
            source,
        })?;
        self.write_section(name, SectionKind::State, &body)
    }

    /// Writes a section whose body is already in memory.
    pub fn write_section(&mut self, name: &str, kind: SectionKind, body: &[u8]) -> Result<()> {
        self.write_section_with(name, kind, body.len() as u64, |w| w.write_all(body))
    }

    /// Writes a section of `len` bytes whose body `fill` streams into the writer it is given.
    ///
    /// `fill` must write exactly `len` bytes; more is refused as it happens, fewer is an
    /// error afterwards. Either way the writer is then poisoned.
    pub fn write_section_with<F>(
        &mut self,
        name: &str,
        kind: SectionKind,
        len: u64,
        fill: F,
    ) -> Result<()>
    where
        F: FnOnce(&mut dyn Write) -> io::Result<()>,
    {
        if self.poisoned {
            return Err(FormatError::Poisoned);
        }
        check_name(name)?;
        if self.names.contains(name) {
            return Err(FormatError::DuplicateName(name.to_string()));
        }
        if kind == SectionKind::State && len > MAX_STATE_SECTION {
            return Err(FormatError::StateTooLarge {
                name: name.to_string(),
                len,
                max: MAX_STATE_SECTION,
            });
        }
        // From here on a failure leaves a partial section in the output.
        self.poisoned = true;
        let mut head = Vec::with_capacity(3 + name.len() + 8);
        head.push(SECTION_TAG);
        head.push(kind.code());
        head.push(name.len() as u8);
        head.extend_from_slice(name.as_bytes());
        head.extend_from_slice(&len.to_le_bytes());
        self.out.put(&head)?;
        let mut body = BodyWriter {
            out: &mut self.out,
            left: len,
        };
        fill(&mut body)?;
        if body.left != 0 {
            return Err(FormatError::LengthMismatch {
                name: name.to_string(),
                written: len - body.left,
                declared: len,
            });
        }
        self.count = self
            .count
            .checked_add(1)
            .ok_or_else(|| io::Error::other("too many sections"))?;
        self.names.insert(name.to_string());
        self.poisoned = false;
        Ok(())
    }

    /// Writes the trailer and CRC, flushes, and gives the output back.
    pub fn finish(mut self) -> Result<W> {
        if self.poisoned {
            return Err(FormatError::Poisoned);
        }
        let total = self.out.offset + TRAILER_LEN;
        let mut trailer = Vec::with_capacity(TRAILER_LEN as usize);
        trailer.push(TRAILER_TAG);
        trailer.extend_from_slice(&self.count.to_le_bytes());
        trailer.extend_from_slice(&total.to_le_bytes());
        self.out.put(&trailer)?;
        let crc = self.out.crc.clone().finalize();
        self.out.out.write_all(&crc.to_le_bytes())?;
        self.out.out.flush()?;
        Ok(self.out.out)
    }
}

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
    len: u64,
    sections: Vec<SectionInfo>,
}

impl<R: Read + Seek> SnapshotReader<R> {
    /// Verifies the whole file (see the module doc for the order) and indexes its sections.
    pub fn open(mut inner: R) -> Result<Self> {
        let len = inner.seek(SeekFrom::End(0))?;
        inner.seek(SeekFrom::Start(0))?;
        let mut head = [0u8; HEADER_LEN as usize];
        let got = read_up_to(&mut inner, &mut head)?;
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
        if version != FORMAT_VERSION {
            return Err(FormatError::Version {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let trailer_looks_whole = len >= HEADER_LEN + TRAILER_LEN && {
            let mut t = [0u8; TRAILER_LEN as usize];
            inner.seek(SeekFrom::Start(len - TRAILER_LEN))?;
            inner.read_exact(&mut t)?;
            t[0] == TRAILER_TAG && u64_at(&t, 5) == len
        };
        if trailer_looks_whole {
            check_crc(&mut inner, len)?;
        }
        let walk = walk(&mut inner, len)?;
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
                if !trailer_looks_whole {
                    check_crc(&mut inner, len)?;
                }
                return Err(e);
            }
        };
        if !trailer_looks_whole {
            // The walk found a trailer at the end whose length field is wrong.
            check_crc(&mut inner, len)?;
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
            len,
            sections,
        })
    }

    /// The file's length in bytes.
    pub fn file_len(&self) -> u64 {
        self.len
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

/// Streams the file through the CRC and compares with the last four bytes.
fn check_crc<R: Read + Seek>(r: &mut R, len: u64) -> Result<()> {
    r.seek(SeekFrom::Start(0))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; IO_CHUNK];
    let mut left = len - 4;
    while left > 0 {
        let n = left.min(IO_CHUNK as u64) as usize;
        r.read_exact(&mut buf[..n])?;
        hasher.update(&buf[..n]);
        left -= n as u64;
    }
    let mut stored = [0u8; 4];
    r.read_exact(&mut stored)?;
    let stored = u32::from_le_bytes(stored);
    let computed = hasher.finalize();
    if stored != computed {
        return Err(FormatError::Crc { stored, computed });
    }
    Ok(())
}

fn malformed(at: u64, reason: String) -> FormatError {
    FormatError::Malformed { at, reason }
}

/// Walks section headers from the start, seeking over bodies; reads no body.
fn walk<R: Read + Seek>(r: &mut R, len: u64) -> Result<Walk> {
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
        let section = match read_section_header(r, pos, len)? {
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
) -> Result<ControlFlow<Walk, SectionInfo>> {
    if len - pos < 3 {
        return Ok(ControlFlow::Break(Walk::Truncated("section header")));
    }
    let mut kn = [0u8; 2];
    r.read_exact(&mut kn)?;
    let Some(kind) = SectionKind::from_code(kn[0]) else {
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
    let offset = pos + 3 + name_len + 8;
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

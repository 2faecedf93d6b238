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
//! # Byte layout, format version 3
//!
//! All integers are little-endian.
//!
//! ```text
//! offset  size  field
//! 0       8     magic: the ASCII bytes "TANDEMSN"
//! 8       4     format version (u32): 3
//! 12      4     reserved (u32): 0
//! 16            sections, one after another, each:
//!                 1  tag: 0x53 ('S')
//!                 1  kind: 1 = state (a JSON document, at most 16 MiB),
//!                          2 = memory image table (see crate::memory),
//!                          3 = pages (raw guest pages, see below)
//!                 1  name length n, 1..=64
//!                 n  name: ASCII letters, digits, '.', '_', '-'; unique in the file
//!                 8  body length L (u64); a multiple of 4096 for pages
//!                 p  pages only: zero bytes up to the next multiple of 4096 in the file
//!                 L  body
//!               then the trailer, which ends the file:
//!                 1  tag: 0x45 ('E')
//!                 4  number of sections (u32)
//!                 8  total length of the file in bytes, trailer and CRC included (u64)
//!                 4  CRC32 (IEEE 802.3, as computed by crc32fast) of every byte before
//!                    it except the bodies of pages sections
//! ```
//!
//! A pages section's body starts on a 4 KiB boundary of the file, so that a restore can
//! map it straight into guest memory (`MAP_PRIVATE`) without reading it. For the same
//! reason the file's CRC leaves those bodies out: checking it must not read them. Their
//! own CRC is kept by whoever owns them (the memory image's table holds it, see
//! [`crate::memory`]), and is checked by every reader that copies the pages.
//!
//! Version history: 1, the first; 2, the same container, with the `vm` and `vcpu.N`
//! sections holding kvm-bindings' encodings of the KVM structures and each vCPU's CPUID
//! entries and TSC frequency added; 3, pages sections (kind 3) added, and the memory
//! image split into a table and its pages. Versions 2 and 3 are read; a file of another
//! version is refused with "snapshot format version N, this tandem reads 2 and 3".
//! [`SnapshotWriter::with_version`] still writes version 2, for tests and tools.
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
//!    [`FormatError::Malformed`]); in version 3 the structure comes first, since the CRC
//!    skips the pages bodies that the structure locates, so a damaged header there reads
//!    as malformed;
//! 3. otherwise the structure is walked from the start to tell a truncated file
//!    ([`FormatError::Truncated`]), one with bytes after its trailer
//!    ([`FormatError::TrailingGarbage`]) and a damaged one (CRC mismatch) apart.
//!
//! Only then is an index of sections (name, kind, offset, length) kept, and sections are
//! read from it on request. The file must not be changed while a reader has it open.

use std::collections::HashSet;
use std::io::{self, Write};

use serde::Serialize;

mod read;

pub use read::{expected_crc, SectionInfo, SnapshotReader};

/// The eight bytes every tandem snapshot starts with.
pub const MAGIC: [u8; 8] = *b"TANDEMSN";
/// The format version this tandem writes.
pub const FORMAT_VERSION: u32 = 3;
/// The oldest format version this tandem reads.
pub const OLDEST_VERSION: u32 = 2;
/// Pages sections start on multiples of this, in the file.
pub const PAGE_ALIGN: u64 = 4096;
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
    #[error("snapshot format version {found}, this tandem reads {oldest} and {supported}")]
    Version {
        /// The version in the file.
        found: u32,
        /// The oldest version this build reads.
        oldest: u32,
        /// The newest version this build reads.
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
    /// Raw pages, page-aligned in the file and outside its CRC (version 3).
    Pages,
}

impl SectionKind {
    fn code(self) -> u8 {
        match self {
            SectionKind::State => 1,
            SectionKind::Memory => 2,
            SectionKind::Pages => 3,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(SectionKind::State),
            2 => Some(SectionKind::Memory),
            3 => Some(SectionKind::Pages),
            _ => None,
        }
    }
}

/// Zero bytes from `offset` to the next multiple of [`PAGE_ALIGN`].
pub fn pad_to_page(offset: u64) -> u64 {
    (PAGE_ALIGN - offset % PAGE_ALIGN) % PAGE_ALIGN
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

    /// Writes bytes the CRC does not cover (a pages body).
    fn put_uncovered(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.offset += bytes.len() as u64;
        Ok(())
    }
}

/// The body of one section being written; refuses bytes past the declared length.
struct BodyWriter<'a, W: Write> {
    out: &'a mut CrcOut<W>,
    left: u64,
    /// A pages body: outside the CRC.
    uncovered: bool,
}

impl<W: Write> Write for BodyWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.len() as u64 > self.left {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "section body longer than declared",
            ));
        }
        if self.uncovered {
            self.out.put_uncovered(buf)?;
        } else {
            self.out.put(buf)?;
        }
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
    version: u32,
    count: u32,
    names: HashSet<String>,
    poisoned: bool,
}

impl<W: Write> SnapshotWriter<W> {
    /// Starts a snapshot of [`FORMAT_VERSION`]: writes the header.
    pub fn new(out: W) -> Result<Self> {
        Self::with_version(out, FORMAT_VERSION)
    }

    /// Starts a snapshot of `version` (2 or 3; 2 has no pages sections, for tests and
    /// tools that need a file as an older tandem wrote it).
    pub fn with_version(out: W, version: u32) -> Result<Self> {
        if !(OLDEST_VERSION..=FORMAT_VERSION).contains(&version) {
            return Err(FormatError::Version {
                found: version,
                oldest: OLDEST_VERSION,
                supported: FORMAT_VERSION,
            });
        }
        let mut w = SnapshotWriter {
            out: CrcOut {
                out,
                crc: crc32fast::Hasher::new(),
                offset: 0,
            },
            version,
            count: 0,
            names: HashSet::new(),
            poisoned: true,
        };
        w.out.put(&MAGIC)?;
        w.out.put(&version.to_le_bytes())?;
        w.out.put(&0u32.to_le_bytes())?;
        w.poisoned = false;
        Ok(w)
    }

    /// Bytes written so far.
    pub fn offset(&self) -> u64 {
        self.out.offset
    }

    /// The format version being written.
    pub fn version(&self) -> u32 {
        self.version
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
        if kind == SectionKind::Pages && (self.version < 3 || !len.is_multiple_of(PAGE_ALIGN)) {
            return Err(FormatError::Malformed {
                at: self.out.offset,
                reason: format!(
                    "a pages section of {len} bytes in a version {} file",
                    self.version
                ),
            });
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
        let pages = kind == SectionKind::Pages;
        if pages {
            let pad = pad_to_page(self.out.offset);
            self.out.put(&vec![0u8; pad as usize])?;
        }
        let mut body = BodyWriter {
            out: &mut self.out,
            left: len,
            uncovered: pages,
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

//! The guest memory image: runs of non-zero 4 KiB pages in a memory section.
//!
//! This module owns the encoding of guest RAM inside a snapshot. The writer scans the
//! guest's regions (a [`PageSource`]: the vmm copies out of its guest memory through
//! vm-memory's accessors, paused), skips zero pages, and streams the rest; the reader checks every run against the
//! restoring VM's memory layout before a single byte is handed to the caller's sink, which
//! writes it into guest memory. Pages absent from the image are zero: restore into fresh
//! (zero-filled) guest memory. This module never touches guest memory itself.
//!
//! # Layout, format version 3: a pages section, then a table section
//!
//! All integers are little-endian. An image called `memory` is two sections:
//!
//! ```text
//! memory.pages (kind pages, page-aligned in the file, outside the file's CRC):
//!          the pages of run 0, then of run 1, ...: P × 4096 bytes each
//! memory (kind memory):
//! 4        page size (u32): 4096
//! 4        number of runs N (u32)
//! 4        CRC32 of the whole body of memory.pages (u32)
//! 4        reserved (u32): 0
//! N × 12   run table, in ascending guest-physical order, runs never overlapping:
//!            8  guest physical address of the run's first page (u64, page-aligned)
//!            4  number of pages P >= 1 (u32)
//! ```
//!
//! The pages come first because their CRC is known only once they are written; the
//! table is read first. Because the pages lie page-aligned in the file, a restore may map
//! them into guest memory ([`plan_mapping`]) instead of reading them: the pages' CRC is
//! then not checked, which is why the file's own CRC leaves them out. Every reader that
//! copies them ([`read_memory`], [`verify_pages`]) checks it.
//!
//! # Layout, format version 2: one memory section
//!
//! ```text
//! 4        page size (u32): 4096
//! 4        number of runs N (u32)
//! N × 12   run table, as above
//! ...      the pages of run 0, then of run 1, ...: P × 4096 bytes each
//! ```
//!
//! In both, the whole table is validated (addresses, overlaps, totals, and the lengths:
//! `4096 Σ P` of pages, exactly) before the sink sees anything. The writer scans memory
//! once for zero pages to build the table (small: one entry per run) and once more to
//! copy the non-zero pages.

use std::io::{self, Read, Seek, Write};

use crate::format::{FormatError, SectionKind, SnapshotReader, SnapshotWriter};

/// The page size of the image.
pub const PAGE_SIZE: u64 = 4096;
const PAGE: usize = PAGE_SIZE as usize;
const RUN_ENTRY: u64 = 12;
/// The table's header in version 2: page size, run count.
const BODY_HEADER_V2: u64 = 8;
/// The table's header in version 3: page size, run count, pages CRC, reserved.
const BODY_HEADER_V3: u64 = 16;
/// Pages handed to the sink at once, at most.
const SINK_PAGES: usize = 256;

/// Errors of the memory image.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The container failed (I/O, missing section, ...).
    #[error(transparent)]
    Format(#[from] FormatError),
    /// Reading the section body failed.
    #[error("memory image I/O: {0}")]
    Io(#[from] io::Error),
    /// A guest region to save is not page-aligned.
    #[error("guest region at {gpa:#x} of {len:#x} bytes is not 4 KiB-aligned")]
    Unaligned {
        /// The region's guest physical address.
        gpa: u64,
        /// Its length.
        len: u64,
    },
    /// Two guest regions (to save, or of the restoring VM's layout) overlap.
    #[error("guest regions at {first:#x} and {second:#x} overlap")]
    RegionsOverlap {
        /// The lower region's address.
        first: u64,
        /// The address of the region that overlaps it.
        second: u64,
    },
    /// The image is not laid out as the format says.
    #[error("memory image is malformed: {0}")]
    Malformed(String),
    /// A run lies (partly) outside every region of the restoring VM's memory.
    #[error("memory image has {pages} page(s) at {gpa:#x}, outside this VM's memory ({layout})")]
    OutsideLayout {
        /// The run's first address.
        gpa: u64,
        /// Its page count.
        pages: u32,
        /// The restoring VM's regions, for the message.
        layout: String,
    },
    /// A run starts below the end of the previous one.
    #[error("memory image run at {gpa:#x} overlaps or precedes the run ending at {prev_end:#x}")]
    Overlap {
        /// The run's first address.
        gpa: u64,
        /// Where the previous run ends.
        prev_end: u64,
    },
    /// The image holds more pages than the restoring VM has.
    #[error("memory image holds {pages} pages, this VM has {max}")]
    TooManyPages {
        /// Pages in the image.
        pages: u64,
        /// Pages in the restoring VM's memory.
        max: u64,
    },
    /// The pages do not match the CRC the table holds for them.
    #[error(
        "memory pages CRC mismatch: the file is damaged (stored {stored:#010x}, computed {computed:#010x})"
    )]
    PagesCrc {
        /// The CRC in the table.
        stored: u32,
        /// The CRC of the pages as read.
        computed: u32,
    },
    /// The caller's sink refused a chunk.
    #[error("writing the memory image to guest memory at {gpa:#x}: {source}")]
    Sink {
        /// Where the refused chunk starts.
        gpa: u64,
        /// The sink's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

type Result<T> = std::result::Result<T, MemoryError>;

/// A run of consecutive non-zero pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Guest physical address of the first page.
    pub gpa: u64,
    /// Number of pages.
    pub pages: u32,
}

impl Run {
    fn end(self) -> u64 {
        self.gpa + u64::from(self.pages) * PAGE_SIZE
    }
}

/// What an image holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ImageStats {
    /// Runs in the image.
    pub runs: u64,
    /// Non-zero pages stored.
    pub pages: u64,
    /// Length of the section body in bytes.
    pub body_len: u64,
}

/// Whether a page (or any slice) is all zero bytes; compares 64 bytes per step as u64 words.
pub fn is_zero(bytes: &[u8]) -> bool {
    let (blocks, rest) = bytes.as_chunks::<64>();
    blocks.iter().all(|block| {
        let (words, _) = block.as_chunks::<8>();
        words
            .iter()
            .fold(0u64, |acc, w| acc | u64::from_ne_bytes(*w))
            == 0
    }) && rest.iter().all(|&b| b == 0)
}

/// Sorts regions by address and checks they are page-aligned and disjoint.
fn sorted_regions<T: Copy>(
    mut regions: Vec<(u64, T)>,
    len_of: impl Fn(T) -> u64,
) -> Result<Vec<(u64, T)>> {
    regions.sort_by_key(|r| r.0);
    let mut prev: Option<(u64, u64)> = None;
    for &(gpa, r) in &regions {
        let len = len_of(r);
        if !gpa.is_multiple_of(PAGE_SIZE)
            || !len.is_multiple_of(PAGE_SIZE)
            || gpa.checked_add(len).is_none()
        {
            return Err(MemoryError::Unaligned { gpa, len });
        }
        if let Some((first, end)) = prev {
            if gpa < end {
                return Err(MemoryError::RegionsOverlap { first, second: gpa });
            }
        }
        prev = Some((gpa, gpa + len));
    }
    Ok(regions)
}

/// Guest memory as the image writer reads it: copied out a chunk at a time through the
/// owner's accessors (the vmm: vm-memory's volatile copies), never borrowed as plain slices
/// of memory that a guest or a device may write.
pub trait PageSource {
    /// The regions, as `(guest physical address, length in bytes)`.
    fn regions(&self) -> Vec<(u64, u64)>;
    /// Copies the guest bytes at `gpa` into `buf` (within one region).
    fn read_at(&self, gpa: u64, buf: &mut [u8]) -> io::Result<()>;
}

/// Plain byte slices as `(guest physical address, bytes)` (tests and tools).
impl PageSource for [(u64, &[u8])] {
    fn regions(&self) -> Vec<(u64, u64)> {
        self.iter().map(|(gpa, b)| (*gpa, b.len() as u64)).collect()
    }

    fn read_at(&self, gpa: u64, buf: &mut [u8]) -> io::Result<()> {
        let bytes = self.iter().find_map(|&(start, bytes)| {
            let off = usize::try_from(gpa.checked_sub(start)?).ok()?;
            bytes.get(off..off.checked_add(buf.len())?)
        });
        let bytes =
            bytes.ok_or_else(|| io::Error::other(format!("{gpa:#x} is outside the regions")))?;
        buf.copy_from_slice(bytes);
        Ok(())
    }
}

/// Pages copied out of guest memory at once (a buffer that stays in the cache).
const CHUNK_PAGES: u64 = 16;

/// Finds the runs of non-zero pages in the regions (sorted and checked).
pub fn scan_runs(regions: &[(u64, &[u8])]) -> Vec<Run> {
    let layout: Vec<(u64, u64)> = regions.regions();
    scan_source(regions, &layout).unwrap_or_default()
}

/// Finds the runs of non-zero pages of `src` in `layout` (its regions, sorted and checked).
fn scan_source<S: PageSource + ?Sized>(src: &S, layout: &[(u64, u64)]) -> io::Result<Vec<Run>> {
    let mut runs: Vec<Run> = Vec::new();
    let mut buf = vec![0u8; (CHUNK_PAGES * PAGE_SIZE) as usize];
    for &(gpa, len) in layout {
        let mut current: Option<Run> = None;
        let mut off = 0;
        while off < len {
            let n = (len - off).min(CHUNK_PAGES * PAGE_SIZE);
            let chunk = &mut buf[..n as usize];
            src.read_at(gpa + off, chunk)?;
            for (i, page) in chunk.chunks_exact(PAGE).enumerate() {
                let page_gpa = gpa + off + i as u64 * PAGE_SIZE;
                if is_zero(page) {
                    runs.extend(current.take());
                    continue;
                }
                match current.as_mut() {
                    Some(run) if run.pages < u32::MAX => run.pages += 1,
                    _ => {
                        runs.extend(current.take());
                        current = Some(Run {
                            gpa: page_gpa,
                            pages: 1,
                        });
                    }
                }
            }
            off += n;
        }
        runs.extend(current);
    }
    Ok(runs)
}

/// Total pages of `runs`.
fn total_pages(runs: &[Run]) -> u64 {
    runs.iter().map(|r| u64::from(r.pages)).sum()
}

/// The name of the pages section of image `name` (version 3).
pub fn pages_section(name: &str) -> String {
    format!("{name}.pages")
}

/// Writes guest memory as memory section `name`, skipping zero pages.
///
/// `regions` are `(guest physical address, bytes)`, page-aligned and disjoint, in any
/// order. See [`write_memory_from`].
pub fn write_memory<'a, W, I>(
    writer: &mut SnapshotWriter<W>,
    name: &str,
    regions: I,
) -> Result<ImageStats>
where
    W: Write,
    I: IntoIterator<Item = (u64, &'a [u8])>,
{
    let regions: Vec<(u64, &[u8])> = regions.into_iter().collect();
    write_memory_from(writer, name, regions.as_slice())
}

/// Writes the memory of `src` as image `name` (in version 3, sections `name.pages` and
/// `name`), skipping zero pages. Its regions must be page-aligned and disjoint, in any
/// order. The guest must be paused: the pages are read twice (scan, then copy).
pub fn write_memory_from<W, S>(
    writer: &mut SnapshotWriter<W>,
    name: &str,
    src: &S,
) -> Result<ImageStats>
where
    W: Write,
    S: PageSource + ?Sized,
{
    let layout = sorted_regions(src.regions(), |len: u64| len)?;
    let runs = scan_source(src, &layout)?;
    let run_count = u32::try_from(runs.len())
        .map_err(|_| MemoryError::Malformed(format!("{} runs do not fit a u32", runs.len())))?;
    let mut table = Vec::with_capacity(16 + runs.len() * RUN_ENTRY as usize);
    table.extend_from_slice(&(PAGE_SIZE as u32).to_le_bytes());
    table.extend_from_slice(&run_count.to_le_bytes());
    let pages_len = total_pages(&runs) * PAGE_SIZE;
    let body_len = if writer.version() >= 3 {
        let pages_crc = write_pages_section(writer, name, src, &runs, pages_len)?;
        table.extend_from_slice(&pages_crc.to_le_bytes());
        table.extend_from_slice(&0u32.to_le_bytes());
        push_runs(&mut table, &runs);
        writer.write_section(name, SectionKind::Memory, &table)?;
        table.len() as u64
    } else {
        push_runs(&mut table, &runs);
        let len = table.len() as u64 + pages_len;
        writer.write_section_with(name, SectionKind::Memory, len, |w| {
            w.write_all(&table)?;
            copy_runs(src, &runs, w).map(|_| ())
        })?;
        len
    };
    Ok(ImageStats {
        runs: runs.len() as u64,
        pages: total_pages(&runs),
        body_len,
    })
}

fn push_runs(table: &mut Vec<u8>, runs: &[Run]) {
    for run in runs {
        table.extend_from_slice(&run.gpa.to_le_bytes());
        table.extend_from_slice(&run.pages.to_le_bytes());
    }
}

/// Writes the pages of `runs` as the pages section of image `name`; returns their CRC.
fn write_pages_section<W: Write, S: PageSource + ?Sized>(
    writer: &mut SnapshotWriter<W>,
    name: &str,
    src: &S,
    runs: &[Run],
    len: u64,
) -> Result<u32> {
    let mut crc = 0;
    writer.write_section_with(&pages_section(name), SectionKind::Pages, len, |w| {
        crc = copy_runs(src, runs, w)?;
        Ok(())
    })?;
    Ok(crc)
}

/// Copies the pages of `runs` from `src` to `w`; returns their CRC.
fn copy_runs<S: PageSource + ?Sized>(src: &S, runs: &[Run], w: &mut dyn Write) -> io::Result<u32> {
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; (CHUNK_PAGES * PAGE_SIZE) as usize];
    for run in runs {
        let (mut gpa, end) = (run.gpa, run.end());
        while gpa < end {
            let n = (end - gpa).min(CHUNK_PAGES * PAGE_SIZE);
            let chunk = &mut buf[..n as usize];
            src.read_at(gpa, chunk)?;
            w.write_all(chunk)?;
            hasher.update(chunk);
            gpa += n;
        }
    }
    Ok(hasher.finalize())
}

fn describe(layout: &[(u64, u64)]) -> String {
    let parts: Vec<String> = layout
        .iter()
        .map(|(gpa, len)| format!("{:#x}..{:#x}", gpa, gpa + len))
        .collect();
    if parts.is_empty() {
        "no memory".to_string()
    } else {
        parts.join(", ")
    }
}

/// A validated image: its runs and where its pages are.
struct Image {
    runs: Vec<Run>,
    /// Version 3: the pages section (body offset in the file) and the CRC the table
    /// holds for it. Version 2: `None`, the pages follow the table in its body.
    pages: Option<(u64, u32)>,
    body_len: u64,
}

/// Where the pages of a version 3 image lie in the file, to be mapped rather than read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// The runs, validated against the layout, in ascending order.
    pub runs: Vec<Run>,
    /// File offset of the first run's first page (page-aligned); each run's pages follow
    /// the previous run's.
    pub offset: u64,
}

/// Reads and checks the run table of image `name` against `layout`, the restoring VM's
/// `(guest physical address, length)` regions. Reads no page data.
fn open_image<R: Read + Seek>(
    reader: &mut SnapshotReader<R>,
    name: &str,
    layout: &[(u64, u64)],
) -> Result<Image> {
    let v3 = reader.version() >= 3;
    reader.expect_section(name, SectionKind::Memory)?;
    let pages = if v3 {
        let p = reader.expect_section(&pages_section(name), SectionKind::Pages)?;
        Some((p.offset, p.len))
    } else {
        None
    };
    let (len, mut body) = reader.section_reader(name, SectionKind::Memory)?;
    let header = if v3 { BODY_HEADER_V3 } else { BODY_HEADER_V2 };
    let (runs, crc) = read_table(&mut body, len, layout, header)?;
    let stored = total_pages(&runs) * PAGE_SIZE;
    let (expected, found) = match pages {
        Some((_, pages_len)) => (stored, pages_len),
        None => (header + RUN_ENTRY * runs.len() as u64 + stored, len),
    };
    if expected != found {
        return Err(MemoryError::Malformed(format!(
            "run table accounts for {expected} bytes of pages, the file has {found}"
        )));
    }
    Ok(Image {
        pages: pages.map(|(offset, _)| (offset, crc)),
        runs,
        body_len: len,
    })
}

/// Reads and checks the run table of image `name` against `layout`, the restoring VM's
/// `(guest physical address, length)` regions. Reads no page data.
pub fn validate_memory<R: Read + Seek>(
    reader: &mut SnapshotReader<R>,
    name: &str,
    layout: &[(u64, u64)],
) -> Result<Vec<Run>> {
    open_image(reader, name, layout).map(|i| i.runs)
}

/// Where the pages of image `name` lie in the file, validated against `layout`: `None`
/// for a version 2 file, whose pages are not page-aligned (copy them instead). Reads no
/// page data, so their CRC is not checked (see [`verify_pages`]).
pub fn plan_mapping<R: Read + Seek>(
    reader: &mut SnapshotReader<R>,
    name: &str,
    layout: &[(u64, u64)],
) -> Result<Option<Mapping>> {
    let image = open_image(reader, name, layout)?;
    Ok(image.pages.map(|(offset, _)| Mapping {
        runs: image.runs,
        offset,
    }))
}

/// Reads every page of image `name` and checks their CRC (version 3; a version 2 file's
/// pages were checked with the whole file when it was opened).
pub fn verify_pages<R: Read + Seek>(
    reader: &mut SnapshotReader<R>,
    name: &str,
    layout: &[(u64, u64)],
) -> Result<()> {
    read_memory(reader, name, layout, |_, _: &[u8]| {
        Ok::<(), std::convert::Infallible>(())
    })
    .map(|_| ())
}

fn read_table<R: Read>(
    body: &mut R,
    len: u64,
    layout: &[(u64, u64)],
    header: u64,
) -> Result<(Vec<Run>, u32)> {
    let layout = sorted_regions(layout.to_vec(), |len| len)?;
    let max_pages: u64 = layout.iter().map(|(_, len)| len / PAGE_SIZE).sum();
    if len < header {
        return Err(MemoryError::Malformed(format!(
            "body of {len} bytes is shorter than its header"
        )));
    }
    let mut head = [0u8; BODY_HEADER_V3 as usize];
    let head = &mut head[..header as usize];
    body.read_exact(head)?;
    let word = |at: usize| u32::from_le_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
    let (page_size, count) = (word(0), word(4));
    let crc = if header == BODY_HEADER_V3 { word(8) } else { 0 };
    if header == BODY_HEADER_V3 && word(12) != 0 {
        return Err(MemoryError::Malformed(
            "reserved table field is not zero".to_string(),
        ));
    }
    if u64::from(page_size) != PAGE_SIZE {
        return Err(MemoryError::Malformed(format!(
            "page size {page_size}, expected {PAGE_SIZE}"
        )));
    }
    // Each run holds at least one page, so a count over these bounds is refused before
    // anything is allocated for it.
    let count = u64::from(count);
    if count * RUN_ENTRY > len - header {
        return Err(MemoryError::Malformed(format!(
            "{count} runs do not fit a body of {len} bytes"
        )));
    }
    if count > max_pages {
        return Err(MemoryError::TooManyPages {
            pages: count,
            max: max_pages,
        });
    }
    let runs = read_runs(body, count, &layout, max_pages)?;
    Ok((runs, crc))
}

/// The `count` entries of a run table, each checked against `layout` and the one before.
fn read_runs<R: Read>(
    body: &mut R,
    count: u64,
    layout: &[(u64, u64)],
    max_pages: u64,
) -> Result<Vec<Run>> {
    let mut runs = Vec::with_capacity(count.min(4096) as usize);
    let mut total: u64 = 0;
    let mut prev_end = 0u64;
    let mut entry = [0u8; RUN_ENTRY as usize];
    for _ in 0..count {
        body.read_exact(&mut entry)?;
        let (gpa, pages) = entry.split_at(8);
        let mut g = [0u8; 8];
        g.copy_from_slice(gpa);
        let gpa = u64::from_le_bytes(g);
        let pages = u32::from_le_bytes([pages[0], pages[1], pages[2], pages[3]]);
        let run = Run { gpa, pages };
        if pages == 0 || !gpa.is_multiple_of(PAGE_SIZE) {
            return Err(MemoryError::Malformed(format!(
                "run at {gpa:#x} of {pages} pages (runs are page-aligned and non-empty)"
            )));
        }
        let inside = gpa
            .checked_add(u64::from(pages) * PAGE_SIZE)
            .is_some_and(|end| layout.iter().any(|&(r, l)| gpa >= r && end <= r + l));
        if !inside {
            return Err(MemoryError::OutsideLayout {
                gpa,
                pages,
                layout: describe(layout),
            });
        }
        if !runs.is_empty() && gpa < prev_end {
            return Err(MemoryError::Overlap { gpa, prev_end });
        }
        total += u64::from(pages);
        if total > max_pages {
            return Err(MemoryError::TooManyPages {
                pages: total,
                max: max_pages,
            });
        }
        prev_end = run.end();
        runs.push(run);
    }
    Ok(runs)
}

/// Restores image `name`: validates it all against `layout` (see [`validate_memory`]),
/// then hands every stored run to `sink` as `(gpa, bytes)` chunks of at most 1 MiB, in
/// ascending order. Pages not handed out are zero in the snapshot. In version 3 the
/// pages' CRC is checked as they go; a mismatch is an error after the last chunk (so a
/// caller that must not write damaged pages calls [`verify_pages`] first).
pub fn read_memory<R, F, E>(
    reader: &mut SnapshotReader<R>,
    name: &str,
    layout: &[(u64, u64)],
    mut sink: F,
) -> Result<ImageStats>
where
    R: Read + Seek,
    F: FnMut(u64, &[u8]) -> std::result::Result<(), E>,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let image = open_image(reader, name, layout)?;
    let mut body: Box<dyn Read + '_> = match image.pages {
        // The table was just read: a version 2 body goes on with the pages.
        None => Box::new(reader.section_reader(name, SectionKind::Memory)?.1),
        Some(_) => Box::new(
            reader
                .section_reader(&pages_section(name), SectionKind::Pages)?
                .1,
        ),
    };
    if image.pages.is_none() {
        let table = BODY_HEADER_V2 + RUN_ENTRY * image.runs.len() as u64;
        io::copy(&mut (&mut body).take(table), &mut io::sink())?;
    }
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; SINK_PAGES * PAGE];
    for run in &image.runs {
        let mut gpa = run.gpa;
        let mut left = u64::from(run.pages);
        while left > 0 {
            let n = left.min(SINK_PAGES as u64) as usize;
            let chunk = &mut buf[..n * PAGE];
            body.read_exact(chunk)?;
            hasher.update(chunk);
            sink(gpa, chunk).map_err(|e| MemoryError::Sink {
                gpa,
                source: e.into(),
            })?;
            gpa += n as u64 * PAGE_SIZE;
            left -= n as u64;
        }
    }
    if let Some((_, stored)) = image.pages {
        let computed = hasher.finalize();
        if computed != stored {
            return Err(MemoryError::PagesCrc { stored, computed });
        }
    }
    Ok(ImageStats {
        runs: image.runs.len() as u64,
        pages: total_pages(&image.runs),
        body_len: image.body_len,
    })
}

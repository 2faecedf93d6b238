//! The guest memory image: runs of non-zero 4 KiB pages in a memory section.
//!
//! This module owns the encoding of guest RAM inside a snapshot. The writer scans the
//! guest's regions (a [`PageSource`]: the vmm copies out of its guest memory through
//! vm-memory's accessors, paused), skips zero pages, and streams the rest; the reader checks every run against the
//! restoring VM's memory layout before a single byte is handed to the caller's sink, which
//! writes it into guest memory. Pages absent from the image are zero: restore into fresh
//! (zero-filled) guest memory. This module never touches guest memory itself.
//!
//! # Body layout of a memory section
//!
//! All integers are little-endian.
//!
//! ```text
//! 4        page size (u32): 4096
//! 4        number of runs N (u32)
//! N × 12   run table, in ascending guest-physical order, runs never overlapping:
//!            8  guest physical address of the run's first page (u64, page-aligned)
//!            4  number of pages P >= 1 (u32)
//! ...      the pages of run 0, then of run 1, ...: P × 4096 bytes each
//! ```
//!
//! The table comes first so that the whole image is validated (addresses, overlaps,
//! totals, and the body length, which must equal `8 + 12 N + 4096 Σ P` exactly) before the
//! sink sees anything. The writer scans memory once for zero pages to build the table
//! (small: one entry per run) and once more to copy the non-zero pages.

use std::io::{self, Read, Seek, Write};

use crate::format::{FormatError, SectionKind, SnapshotReader, SnapshotWriter};

/// The page size of the image.
pub const PAGE_SIZE: u64 = 4096;
const PAGE: usize = PAGE_SIZE as usize;
const RUN_ENTRY: u64 = 12;
const BODY_HEADER: u64 = 8;
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

/// The body length of an image holding `runs`.
fn body_len(runs: &[Run]) -> u64 {
    let pages: u64 = runs.iter().map(|r| u64::from(r.pages)).sum();
    BODY_HEADER + RUN_ENTRY * runs.len() as u64 + pages * PAGE_SIZE
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

/// Writes the memory of `src` as memory section `name`, skipping zero pages. Its regions
/// must be page-aligned and disjoint, in any order. The guest must be paused: the pages
/// are read twice (scan, then copy).
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
    let len = body_len(&runs);
    writer.write_section_with(name, SectionKind::Memory, len, |w| {
        w.write_all(&(PAGE_SIZE as u32).to_le_bytes())?;
        w.write_all(&run_count.to_le_bytes())?;
        let mut table = Vec::with_capacity(runs.len() * RUN_ENTRY as usize);
        for run in &runs {
            table.extend_from_slice(&run.gpa.to_le_bytes());
            table.extend_from_slice(&run.pages.to_le_bytes());
        }
        w.write_all(&table)?;
        let mut buf = vec![0u8; (CHUNK_PAGES * PAGE_SIZE) as usize];
        for run in &runs {
            let (mut gpa, end) = (run.gpa, run.end());
            while gpa < end {
                let n = (end - gpa).min(CHUNK_PAGES * PAGE_SIZE);
                let chunk = &mut buf[..n as usize];
                src.read_at(gpa, chunk)?;
                w.write_all(chunk)?;
                gpa += n;
            }
        }
        Ok(())
    })?;
    Ok(ImageStats {
        runs: runs.len() as u64,
        pages: runs.iter().map(|r| u64::from(r.pages)).sum(),
        body_len: len,
    })
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

/// Reads and checks the run table of memory section `name` against `layout`, the
/// restoring VM's `(guest physical address, length)` regions. Reads no page data.
pub fn validate_memory<R: Read + Seek>(
    reader: &mut SnapshotReader<R>,
    name: &str,
    layout: &[(u64, u64)],
) -> Result<Vec<Run>> {
    let (len, mut body) = reader.section_reader(name, SectionKind::Memory)?;
    read_table(&mut body, len, layout)
}

fn read_table<R: Read>(body: &mut R, len: u64, layout: &[(u64, u64)]) -> Result<Vec<Run>> {
    let layout = sorted_regions(layout.to_vec(), |len| len)?;
    let max_pages: u64 = layout.iter().map(|(_, len)| len / PAGE_SIZE).sum();
    if len < BODY_HEADER {
        return Err(MemoryError::Malformed(format!(
            "body of {len} bytes is shorter than its header"
        )));
    }
    let mut head = [0u8; BODY_HEADER as usize];
    body.read_exact(&mut head)?;
    let (page_size, count) = head.split_at(4);
    let page_size = u32::from_le_bytes([page_size[0], page_size[1], page_size[2], page_size[3]]);
    let count = u32::from_le_bytes([count[0], count[1], count[2], count[3]]);
    if u64::from(page_size) != PAGE_SIZE {
        return Err(MemoryError::Malformed(format!(
            "page size {page_size}, expected {PAGE_SIZE}"
        )));
    }
    // Each run holds at least one page, so a count over these bounds is refused before
    // anything is allocated for it.
    let count = u64::from(count);
    if count * RUN_ENTRY > len - BODY_HEADER {
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
                layout: describe(&layout),
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
    let expected = BODY_HEADER + RUN_ENTRY * count + total * PAGE_SIZE;
    if expected != len {
        return Err(MemoryError::Malformed(format!(
            "run table accounts for {expected} bytes, the section has {len}"
        )));
    }
    Ok(runs)
}

/// Restores memory section `name`: validates it all against `layout` (see
/// [`validate_memory`]), then hands every stored run to `sink` as `(gpa, bytes)` chunks of
/// at most 1 MiB, in ascending order. Pages not handed out are zero in the snapshot.
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
    let (len, mut body) = reader.section_reader(name, SectionKind::Memory)?;
    let runs = read_table(&mut body, len, layout)?;
    let mut buf = vec![0u8; SINK_PAGES * PAGE];
    let mut pages = 0u64;
    for run in &runs {
        let mut gpa = run.gpa;
        let mut left = u64::from(run.pages);
        while left > 0 {
            let n = left.min(SINK_PAGES as u64) as usize;
            let chunk = &mut buf[..n * PAGE];
            body.read_exact(chunk)?;
            sink(gpa, chunk).map_err(|e| MemoryError::Sink {
                gpa,
                source: e.into(),
            })?;
            gpa += n as u64 * PAGE_SIZE;
            left -= n as u64;
        }
        pages += u64::from(run.pages);
    }
    Ok(ImageStats {
        runs: runs.len() as u64,
        pages,
        body_len: len,
    })
}

//! The secondary's disk (design.md §6, Disk): the primary's writes
//! journaled until a checkpoint commits, the secondary guest's own writes
//! in an overlay dropped at each checkpoint and merged at failover.
//!
//! Owns the journal (the primary's forwarded writes, in order, bounded by
//! a byte cap), the overlay (sparse 4 KiB blocks over the image as of the
//! last checkpoint) and the [`BlockImage`] beneath them. Run by the
//! secondary's block device thread (the replication stream hands it the
//! primary's writes and the commit in stream order). It never lets the
//! secondary guest see the primary's uncommitted writes, never writes the
//! secondary's own writes into the image before a failover, never
//! allocates from a length it has not checked against the image size, and
//! never panics on a request: an out-of-range request is an error.
//!
//! The layers, top first, as the secondary guest reads them:
//! overlay block if present, else the image (= the last checkpoint's disk;
//! the journal is not applied yet and is invisible to the guest).
//!
//! - `commit_checkpoint`: apply the journal to the image in order, flush,
//!   drop the overlay, clear the journal. If it fails part-way the journal
//!   and overlay stay (a retry re-applies the journal from the start,
//!   which gives the same image) and the image is between two checkpoints:
//!   a failover from it is refused until a commit succeeds.
//! - `failover`: drop the uncommitted journal, write the overlay into the
//!   image, flush; from then on the disk is plain: guest writes go to the
//!   image and primary writes are refused.

use std::collections::btree_map::Entry as MapEntry;
use std::collections::BTreeMap;
use std::io;

use serde::Serialize;

/// The overlay's block size.
pub const BLOCK_SIZE: usize = 4096;
const BLOCK: u64 = BLOCK_SIZE as u64;

/// The default journal cap: 64 MiB of the primary's writes per checkpoint.
pub const DEFAULT_JOURNAL_CAP: u64 = 64 << 20;

/// The disk file beneath (vmm implements it on the image file).
pub trait BlockImage {
    /// Fills `buf` from `offset`; the range is within `len()`.
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes `buf` at `offset`; the range is within `len()`.
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes the writes so far durable.
    fn flush(&mut self) -> io::Result<()>;
    /// The image's size in bytes (fixed).
    fn len(&self) -> u64;
    /// Whether the image is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An in-memory image (tests, and a RAM-backed disk).
impl BlockImage for Vec<u8> {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let range = mem_range(self.as_slice(), offset, buf.len())?;
        buf.copy_from_slice(&self[range]);
        Ok(())
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        let range = mem_range(self.as_slice(), offset, buf.len())?;
        self[range].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn len(&self) -> u64 {
        self.as_slice().len() as u64
    }
}

fn mem_range(v: &[u8], offset: u64, len: usize) -> io::Result<std::ops::Range<usize>> {
    usize::try_from(offset)
        .ok()
        .and_then(|start| Some(start..start.checked_add(len)?))
        .filter(|r| r.end <= v.len())
        .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "beyond the image"))
}

/// Errors of the secondary disk, keeping the I/O source.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{len} bytes at offset {offset} are beyond the disk's {size} bytes")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    /// The caller turns this into "checkpoint now" (or a failure).
    #[error("journal full: {used} of {cap} bytes used, {len} more asked")]
    JournalFull { used: u64, cap: u64, len: u64 },
    #[error("the disk failed over: no more primary writes or checkpoints")]
    FailedOver,
    #[error("a checkpoint commit did not complete: the image is between checkpoints")]
    CommitIncomplete,
    #[error("disk I/O failed during {during}")]
    Io {
        during: &'static str,
        #[source]
        source: io::Error,
    },
}

fn io_err(during: &'static str) -> impl FnOnce(io::Error) -> JournalError {
    move |source| JournalError::Io { during, source }
}

/// The secondary disk's figures, as reported (JSON).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DiskStats {
    /// Bytes of primary writes in the journal now.
    pub journal_bytes: u64,
    /// Primary writes in the journal now.
    pub journal_entries: u64,
    /// Overlay blocks held now.
    pub overlay_blocks: u64,
    /// The journal cap.
    pub journal_cap: u64,
    /// Checkpoints committed.
    pub commits: u64,
    /// Primary writes refused because the journal was full.
    pub journal_full: u64,
    /// Whether the disk failed over (plain disk from then on).
    pub failed_over: bool,
}

/// One primary write waiting for the next commit.
#[derive(Debug, Clone)]
struct Entry {
    offset: u64,
    data: Vec<u8>,
}

/// The secondary's disk; see the module doc.
#[derive(Debug)]
pub struct SecondaryDisk<I: BlockImage> {
    image: I,
    journal: Vec<Entry>,
    journal_bytes: u64,
    cap: u64,
    /// Block index → the block as the secondary guest sees it.
    overlay: BTreeMap<u64, Box<[u8]>>,
    failed_over: bool,
    commit_incomplete: bool,
    commits: u64,
    journal_full: u64,
}

impl<I: BlockImage> SecondaryDisk<I> {
    /// A disk over `image` (the image as of the initial sync), the journal
    /// capped at `journal_cap` bytes.
    pub fn new(image: I, journal_cap: u64) -> Self {
        SecondaryDisk {
            image,
            journal: Vec::new(),
            journal_bytes: 0,
            cap: journal_cap,
            overlay: BTreeMap::new(),
            failed_over: false,
            commit_incomplete: false,
            commits: 0,
            journal_full: 0,
        }
    }

    /// The image beneath (as of the last checkpoint, or after failover).
    pub fn image(&self) -> &I {
        &self.image
    }

    /// Gives the image back (after failover, to serve from it directly).
    pub fn into_image(self) -> I {
        self.image
    }

    /// The disk's size in bytes.
    pub fn len(&self) -> u64 {
        self.image.len()
    }

    /// Whether the disk is empty.
    pub fn is_empty(&self) -> bool {
        self.image.len() == 0
    }

    fn check(&self, offset: u64, len: usize) -> Result<(), JournalError> {
        let size = self.image.len();
        let len = len as u64;
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(JournalError::OutOfRange { offset, len, size }),
        }
    }

    /// A write of the primary's guest, forwarded: journaled until the next
    /// commit. `JournalFull` when it would pass the cap (nothing kept).
    pub fn journal_primary_write(&mut self, offset: u64, data: &[u8]) -> Result<(), JournalError> {
        if self.failed_over {
            return Err(JournalError::FailedOver);
        }
        self.check(offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let len = data.len() as u64;
        if self.journal_bytes.saturating_add(len) > self.cap {
            self.journal_full += 1;
            return Err(JournalError::JournalFull {
                used: self.journal_bytes,
                cap: self.cap,
                len,
            });
        }
        self.journal.push(Entry {
            offset,
            data: data.to_vec(),
        });
        self.journal_bytes += len;
        Ok(())
    }

    /// The valid length of block `index` (the last one may be short).
    fn block_len(&self, index: u64) -> usize {
        let start = index * BLOCK;
        // Bounded by BLOCK, so the cast cannot truncate.
        self.image.len().saturating_sub(start).min(BLOCK) as usize
    }

    /// The overlay block `index`, read from the image on first use unless
    /// it is about to be overwritten whole.
    fn overlay_block(&mut self, index: u64, whole: bool) -> Result<&mut [u8], JournalError> {
        let len = self.block_len(index);
        match self.overlay.entry(index) {
            MapEntry::Occupied(block) => Ok(block.into_mut()),
            MapEntry::Vacant(slot) => {
                let mut block = vec![0u8; len].into_boxed_slice();
                if !whole {
                    self.image
                        .read_at(&mut block, index * BLOCK)
                        .map_err(io_err("an overlay block read"))?;
                }
                Ok(slot.insert(block))
            }
        }
    }

    /// A write of the secondary's own guest: into the overlay (before a
    /// failover), into the image (after).
    pub fn guest_write(&mut self, offset: u64, data: &[u8]) -> Result<(), JournalError> {
        self.check(offset, data.len())?;
        if self.failed_over {
            return self
                .image
                .write_at(data, offset)
                .map_err(io_err("a guest write"));
        }
        let mut done = 0usize;
        while done < data.len() {
            let pos = offset + done as u64;
            let index = pos / BLOCK;
            // Both below BLOCK_SIZE.
            let within = (pos % BLOCK) as usize;
            let n = (self.block_len(index) - within).min(data.len() - done);
            let whole = within == 0 && n == self.block_len(index);
            let block = self.overlay_block(index, whole)?;
            block[within..within + n].copy_from_slice(&data[done..done + n]);
            done += n;
        }
        Ok(())
    }

    /// A read of the secondary's own guest: the overlay where it has the
    /// block, else the image (the last checkpoint's disk).
    pub fn guest_read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), JournalError> {
        self.check(offset, buf.len())?;
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let index = pos / BLOCK;
            let within = (pos % BLOCK) as usize;
            let n = (self.block_len(index) - within).min(buf.len() - done);
            if let Some(block) = self.overlay.get(&index) {
                buf[done..done + n].copy_from_slice(&block[within..within + n]);
                done += n;
                continue;
            }
            // A run of blocks without overlay: one image read.
            let mut run = n;
            let mut next = index + 1;
            while done + run < buf.len() && !self.overlay.contains_key(&next) {
                run += (self.block_len(next)).min(buf.len() - done - run);
                next += 1;
            }
            self.image
                .read_at(&mut buf[done..done + run], pos)
                .map_err(io_err("a guest read"))?;
            done += run;
        }
        Ok(())
    }

    /// The checkpoint is committed: apply the journal to the image in
    /// order, flush, drop the overlay and the journal.
    pub fn commit_checkpoint(&mut self) -> Result<(), JournalError> {
        if self.failed_over {
            return Err(JournalError::FailedOver);
        }
        self.commit_incomplete = true;
        for entry in &self.journal {
            self.image
                .write_at(&entry.data, entry.offset)
                .map_err(io_err("the journal's application"))?;
        }
        self.image.flush().map_err(io_err("the commit's flush"))?;
        self.commit_incomplete = false;
        self.journal.clear();
        self.journal_bytes = 0;
        self.overlay.clear();
        self.commits += 1;
        Ok(())
    }

    /// The primary is lost and this side takes over: drop the uncommitted
    /// journal, write the overlay into the image, flush. A retry after an
    /// error writes the overlay again.
    pub fn failover(&mut self) -> Result<(), JournalError> {
        if self.commit_incomplete {
            return Err(JournalError::CommitIncomplete);
        }
        self.journal.clear();
        self.journal_bytes = 0;
        for (index, block) in &self.overlay {
            self.image
                .write_at(block, index * BLOCK)
                .map_err(io_err("the overlay's merge"))?;
        }
        self.image.flush().map_err(io_err("the failover's flush"))?;
        self.overlay.clear();
        self.failed_over = true;
        Ok(())
    }

    /// The disk's figures.
    pub fn stats(&self) -> DiskStats {
        DiskStats {
            journal_bytes: self.journal_bytes,
            journal_entries: self.journal.len() as u64,
            overlay_blocks: self.overlay.len() as u64,
            journal_cap: self.cap,
            commits: self.commits,
            journal_full: self.journal_full,
            failed_over: self.failed_over,
        }
    }
}

#[cfg(test)]
#[path = "journal_tests.rs"]
mod tests;

//! Guest pages onto the migration stream: all of RAM (round 0) or the
//! pages of a dirty bitmap, in batches, zero pages as markers, within the
//! bandwidth cap; with several streams (`--connections`), one stream's
//! [`Share`] of them.
//!
//! Runs on the migration thread (and, with several streams, on one
//! `migration-tx` thread per other stream). Reads guest memory through vm-memory's
//! accessors (`read_slice`: a volatile copy), never as `&[u8]` over the
//! running guest's RAM. Never does: take a lock a vCPU or the device thread
//! takes, or clear a page in KVM's log that it is not about to send.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use migration::protocol::{self, MemoryBatch, Message, PageRange, BATCH_PAGES, BATCH_RANGES};
use vm_memory::{Bytes, GuestAddress};

use super::inline::Slicer;
use super::status::Params;
use super::MigrateError;
use crate::streams::endpoint::Conn;
use crate::vstate::memory::{DirtyBitmap, GuestRam};

const PAGE: usize = protocol::PAGE_SIZE as usize;
/// Bitmap words handled per KVM_CLEAR_DIRTY_LOG (256 pages).
const SPAN_WORDS: usize = 4;
/// Pages of a memory slot that go on one stream together (a multiple of
/// [`BATCH_PAGES`] and of a span's 256).
pub const RUN_PAGES: u64 = 512;

/// Which pages one stream of `of` carries: run `r` (of [`RUN_PAGES`]
/// pages, counted from its memory slot's start) goes on stream `r % of`,
/// for the whole migration, so that a page sent twice arrives in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    pub index: usize,
    pub of: usize,
}

impl Share {
    /// Every page: one stream.
    pub const WHOLE: Share = Share { index: 0, of: 1 };

    /// Whether page `page` of a slot (counted from the slot's start) is
    /// this share's.
    pub fn holds(self, page: u64) -> bool {
        self.of <= 1 || (page / RUN_PAGES) % self.of as u64 == self.index as u64
    }
}

/// When to give up sending: a cancel, or the migration's time limit.
pub struct Stop<'a> {
    pub cancel: &'a AtomicBool,
    /// Set when another stream of the same round failed: stop too.
    pub others_failed: Option<&'a AtomicBool>,
    /// Told what has been sent after each batch (the progress shown).
    pub progress: &'a dyn Fn(&Sent),
    /// The time limit and its value in seconds (for the message); `None`
    /// for the stop-and-copy, which is never cut short.
    pub until: Option<(Instant, u64)>,
    /// Where slices end in `--mode inline` (nothing for the thread).
    pub slicer: &'a Slicer<'a>,
}

impl Stop<'_> {
    pub fn check(&self) -> Result<(), MigrateError> {
        if self.others_failed.is_some_and(|f| f.load(Ordering::SeqCst)) {
            return Err(MigrateError::OtherStream);
        }
        if self.until.is_none() {
            return Ok(());
        }
        if self.cancel.load(Ordering::SeqCst) {
            return Err(MigrateError::Cancelled);
        }
        match self.until {
            Some((t, secs)) if Instant::now() >= t => Err(MigrateError::Timeout(secs)),
            _ => Ok(()),
        }
    }
}

/// What has been sent so far, and when it started (for the rate and cap).
#[derive(Debug, Clone, Default)]
pub struct Sent {
    bytes: u64,
    pages: u64,
    zero: u64,
    first: Option<Instant>,
}

impl Sent {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    pub fn pages(&self) -> u64 {
        self.pages
    }
    pub fn zero_pages(&self) -> u64 {
        self.zero
    }

    /// Bytes per second since the first batch (or since `fallback`).
    pub fn rate(&self, fallback: Instant) -> f64 {
        let secs = self.first.unwrap_or(fallback).elapsed().as_secs_f64();
        if secs > 0.0 {
            self.bytes as f64 / secs
        } else {
            0.0
        }
    }

    /// Adds what another stream sent.
    pub fn absorb(&mut self, other: &Sent) {
        self.bytes += other.bytes;
        self.pages += other.pages;
        self.zero += other.zero;
        self.first = match (self.first, other.first) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// How long to sleep because sending has run ahead of the cap
    /// (`cap` bytes/s).
    fn ahead(&self, cap: Option<f64>) -> Option<Duration> {
        let (Some(cap), Some(first)) = (cap, self.first) else {
            return None;
        };
        let due = self.bytes as f64 / cap;
        let ahead = due - first.elapsed().as_secs_f64();
        (ahead > 0.0).then(|| Duration::from_secs_f64(ahead.min(1.0)))
    }
}

/// A batch being filled, then written out.
struct Batcher<'a> {
    conn: &'a mut Conn,
    progress: &'a dyn Fn(&Sent),
    slicer: &'a Slicer<'a>,
    /// This stream's part of the cap, bytes/s.
    cap: Option<f64>,
    sent: &'a mut Sent,
    batch: MemoryBatch,
    data_pages: usize,
}

impl Batcher<'_> {
    fn page(&mut self, gpa: u64, bytes: &[u8]) -> Result<(), MigrateError> {
        let zero = migration::memory::is_zero(bytes);
        match self.batch.ranges.last_mut() {
            Some(r)
                if r.zero == zero
                    && r.gpa + u64::from(r.pages) * protocol::PAGE_SIZE == gpa
                    && r.pages < u32::MAX =>
            {
                r.pages += 1
            }
            _ => self.batch.ranges.push(PageRange {
                gpa,
                pages: 1,
                zero,
            }),
        }
        if zero {
            self.sent.zero += 1;
        } else {
            self.batch.data.extend_from_slice(bytes);
            self.data_pages += 1;
        }
        self.sent.pages += 1;
        if self.data_pages >= BATCH_PAGES || self.batch.ranges.len() >= BATCH_RANGES {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), MigrateError> {
        if self.batch.ranges.is_empty() {
            return Ok(());
        }
        self.sent.first.get_or_insert_with(Instant::now);
        let batch = std::mem::take(&mut self.batch);
        let bytes = 4 + 13 * batch.ranges.len() + batch.data.len();
        protocol::write_message(self.conn, &Message::Memory(batch))?;
        self.sent.bytes += bytes as u64;
        self.data_pages = 0;
        (self.progress)(self.sent);
        if let Some(sleep) = self.sent.ahead(self.cap) {
            // Inline, the device loop runs while the cap holds us back.
            self.slicer.release();
            std::thread::sleep(sleep);
        }
        Ok(())
    }
}

/// A batcher for `share`, which gets its part of the cap.
fn batcher<'a>(
    conn: &'a mut Conn,
    params: &Params,
    share: Share,
    sent: &'a mut Sent,
    stop: &'a Stop,
) -> Batcher<'a> {
    let mib = f64::from(1 << 20);
    Batcher {
        conn,
        progress: stop.progress,
        slicer: stop.slicer,
        cap: params
            .bandwidth_mib
            .map(|c| c as f64 * mib / share.of.max(1) as f64),
        sent,
        batch: MemoryBatch::default(),
        data_pages: 0,
    }
}

/// Sends every page of guest RAM in `share` (round 0; the dirty log is
/// already on). A log that started all dirty is cleared (so
/// write-protected) chunk by chunk, each just before its copy.
pub fn send_all(
    ram: &GuestRam,
    conn: &mut Conn,
    params: &Params,
    share: Share,
    sent: &mut Sent,
    stop: &Stop,
) -> Result<(), MigrateError> {
    let mut b = batcher(conn, params, share, sent, stop);
    let mut buf = vec![0u8; PAGE * BATCH_PAGES];
    let clear = ram.log_started_all_dirty();
    for s in ram.slots() {
        let mut off = 0u64;
        while off < s.bytes {
            stop.check()?;
            stop.slicer.point();
            let n = (s.bytes - off).min(buf.len() as u64) as usize;
            // A chunk is never split between shares (RUN_PAGES is a
            // multiple of BATCH_PAGES, and so is `off` in pages).
            if !share.holds(off / PAGE as u64) {
                off += n as u64;
                continue;
            }
            let chunk = &mut buf[..n];
            if clear {
                // `off` is a multiple of BATCH_PAGES pages (so of KVM's 64).
                ram.clear_dirty(s.id, off / PAGE as u64, n as u64 / PAGE as u64)?;
            }
            ram.mem()
                .read_slice(chunk, GuestAddress(s.gpa + off))
                .map_err(|e| MigrateError::Read(s.gpa + off, e))?;
            for (i, page) in chunk.chunks_exact(PAGE).enumerate() {
                b.page(s.gpa + off + (i * PAGE) as u64, page)?;
            }
            off += n as u64;
        }
    }
    b.flush()
}

/// Sends the pages of `dirty` in `share`, clearing each span's pages in
/// KVM's log just before they are copied.
pub fn send_dirty(
    ram: &GuestRam,
    conn: &mut Conn,
    dirty: &[DirtyBitmap],
    params: &Params,
    share: Share,
    sent: &mut Sent,
    stop: &Stop,
) -> Result<(), MigrateError> {
    let mut b = batcher(conn, params, share, sent, stop);
    let mut page = vec![0u8; PAGE];
    for d in dirty {
        for (span, words) in d.bits.chunks(SPAN_WORDS).enumerate() {
            let first = (span * SPAN_WORDS * 64) as u64;
            if words.iter().all(|&w| w == 0) || !share.holds(first) {
                continue;
            }
            stop.check()?;
            stop.slicer.point();
            ram.clear_dirty_mask(d.slot, first, words)?;
            for (w, &word) in words.iter().enumerate() {
                let mut bits = word;
                while bits != 0 {
                    let bit = u64::from(bits.trailing_zeros());
                    bits &= bits - 1;
                    let index = first + w as u64 * 64 + bit;
                    if index >= d.pages {
                        continue;
                    }
                    let gpa = d.gpa + index * protocol::PAGE_SIZE;
                    ram.mem()
                        .read_slice(&mut page, GuestAddress(gpa))
                        .map_err(|e| MigrateError::Read(gpa, e))?;
                    b.page(gpa, &page)?;
                }
            }
        }
    }
    b.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_page_is_in_one_share_and_a_run_stays_together() {
        for of in 1..=5 {
            for page in (0..20 * RUN_PAGES).step_by(37) {
                let holders: Vec<usize> = (0..of)
                    .filter(|&index| Share { index, of }.holds(page))
                    .collect();
                assert_eq!(holders.len(), 1, "page {page} of {of} shares");
                let run_start = page / RUN_PAGES * RUN_PAGES;
                assert!(Share {
                    index: holders[0],
                    of
                }
                .holds(run_start));
            }
        }
        assert!(Share::WHOLE.holds(u64::MAX));
    }
}

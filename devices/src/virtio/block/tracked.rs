//! A disk that notes which byte ranges its guest changed, while asked to:
//! a COLO primary's, whose writes are forwarded to the secondary
//! (design.md §6, Disk). The ranges are coalesced and handed out in
//! order; the forwarder reads their content back from the image, so a
//! range written twice is sent once, with its last content.
//!
//! [`Tracked`] is called where the wrapped backend is (the device thread
//! for requests); the [`WriteLog`] is read from the COLO thread. A range is
//! noted only after the write that made it completed, so a reader that
//! takes the ranges and then reads the image sees at least that content
//! (a later write notes the range again). It never notes a failed write,
//! and while the log is off it costs one atomic load per write.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use vm_memory::GuestAddress;

use super::backend::DiskBackend;
use crate::GuestMemoryMmap;

/// Disjoint, non-adjacent byte ranges `start → end`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RangeSet(BTreeMap<u64, u64>);

impl RangeSet {
    /// Adds `start..end`, merged with the ranges it touches.
    pub fn insert(&mut self, mut start: u64, mut end: u64) {
        if start >= end {
            return;
        }
        // A range that starts before and reaches `start` absorbs it.
        if let Some((&s, &e)) = self.0.range(..=start).next_back() {
            if e >= start {
                start = s;
                end = end.max(e);
                self.0.remove(&s);
            }
        }
        // Ranges that start within absorb into it.
        while let Some((&s, &e)) = self.0.range(start..=end).next() {
            end = end.max(e);
            self.0.remove(&s);
        }
        self.0.insert(start, end);
    }

    /// Bytes in all ranges.
    pub fn bytes(&self) -> u64 {
        self.0.iter().map(|(s, e)| e - s).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Takes ranges from the lowest up to `budget` bytes in all (the last
    /// one split if needed); the rest stays.
    pub fn take(&mut self, budget: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut left = budget;
        while left > 0 {
            let Some((&s, &e)) = self.0.iter().next() else {
                break;
            };
            self.0.remove(&s);
            let end = e.min(s.saturating_add(left));
            if end < e {
                self.0.insert(end, e);
            }
            left -= end - s;
            out.push((s, end));
        }
        out
    }
}

/// The ranges a [`Tracked`] disk's guest changed since it was last asked.
#[derive(Debug, Default)]
pub struct WriteLog {
    on: AtomicBool,
    ranges: Mutex<RangeSet>,
}

impl WriteLog {
    /// Starts (or stops) noting writes; either way the ranges noted so far
    /// are dropped.
    pub fn set(&self, on: bool) {
        let mut r = crate::sync::lock(&self.ranges);
        self.on.store(on, Ordering::SeqCst);
        *r = RangeSet::default();
    }

    /// Takes up to `budget` bytes of the noted ranges, lowest first.
    pub fn take(&self, budget: u64) -> Vec<(u64, u64)> {
        crate::sync::lock(&self.ranges).take(budget)
    }

    /// Bytes noted and not taken yet.
    pub fn pending(&self) -> u64 {
        crate::sync::lock(&self.ranges).bytes()
    }

    /// Notes that `len` bytes at `offset` changed (if the log is on).
    pub fn note(&self, offset: u64, len: u64) {
        if self.on.load(Ordering::SeqCst) {
            crate::sync::lock(&self.ranges).insert(offset, offset.saturating_add(len));
        }
    }
}

/// See the module doc.
pub struct Tracked<B> {
    inner: B,
    log: Arc<WriteLog>,
}

impl<B: DiskBackend> Tracked<B> {
    /// `inner`, its log off.
    pub fn new(inner: B) -> (Tracked<B>, Arc<WriteLog>) {
        let log = Arc::new(WriteLog::default());
        (
            Tracked {
                inner,
                log: log.clone(),
            },
            log,
        )
    }

    fn noted(&self, r: io::Result<()>, offset: u64, len: u64) -> io::Result<()> {
        if r.is_ok() {
            self.log.note(offset, len);
        }
        r
    }
}

impl<B: DiskBackend> DiskBackend for Tracked<B> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn readonly(&self) -> bool {
        self.inner.readonly()
    }
    fn read_to_guest(
        &self,
        mem: &GuestMemoryMmap,
        addr: GuestAddress,
        len: usize,
        offset: u64,
    ) -> io::Result<()> {
        self.inner.read_to_guest(mem, addr, len, offset)
    }
    fn write_from_guest(
        &self,
        mem: &GuestMemoryMmap,
        addr: GuestAddress,
        len: usize,
        offset: u64,
    ) -> io::Result<()> {
        let r = self.inner.write_from_guest(mem, addr, len, offset);
        self.noted(r, offset, len as u64)
    }
    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }
    fn hold_lock(&self, held: bool) -> io::Result<()> {
        self.inner.hold_lock(held)
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let r = self.inner.discard(offset, len);
        self.noted(r, offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        let r = self.inner.write_zeroes(offset, len, unmap);
        self.noted(r, offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::super::backend::tests::MemDisk;
    use super::*;

    fn set(ranges: &[(u64, u64)]) -> RangeSet {
        let mut s = RangeSet::default();
        for &(a, b) in ranges {
            s.insert(a, b);
        }
        s
    }

    #[test]
    fn ranges_merge_when_they_touch_or_overlap() {
        let mut s = set(&[(10, 20), (30, 40), (50, 60)]);
        s.insert(20, 30);
        assert_eq!(s.take(u64::MAX), vec![(10, 40), (50, 60)]);
        let mut s = set(&[(10, 20), (30, 40), (50, 60)]);
        s.insert(15, 55);
        assert_eq!(s.take(u64::MAX), vec![(10, 60)]);
        let mut s = set(&[(10, 20)]);
        s.insert(12, 14);
        s.insert(5, 5);
        assert_eq!(s.bytes(), 10);
        s.insert(0, 10);
        assert_eq!(s.take(u64::MAX), vec![(0, 20)]);
    }

    #[test]
    fn take_splits_at_the_budget_and_keeps_the_rest() {
        let mut s = set(&[(0, 100), (200, 300)]);
        assert_eq!(s.take(150), vec![(0, 100), (200, 250)]);
        assert_eq!(s.bytes(), 50);
        assert_eq!(s.take(0), vec![]);
        assert_eq!(s.take(1000), vec![(250, 300)]);
        assert!(s.is_empty());
    }

    #[test]
    fn only_completed_writes_are_noted_and_only_while_on() {
        let (d, log) = Tracked::new(MemDisk::new(8192, 0, false));
        d.write_zeroes(0, 512, false).unwrap();
        assert_eq!(log.pending(), 0, "off: nothing noted");
        log.set(true);
        d.write_zeroes(512, 512, false).unwrap();
        d.discard(4096, 1024).unwrap();
        assert!(d.write_zeroes(8000, 1024, false).is_err());
        assert_eq!(log.take(u64::MAX), vec![(512, 1024), (4096, 5120)]);
        d.write_zeroes(0, 512, false).unwrap();
        log.set(false);
        assert_eq!(log.pending(), 0, "stopping drops what was noted");
    }
}

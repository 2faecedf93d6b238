//! Post-copy at the source: after `Go`, the pages the destination lacks
//! ([`Needed`]) go out in the background, in address order, while the
//! pages its guest faults on (`PageRequest`) jump the queue; then `Commit`
//! (every page sent) and the destination's `Done` with what its guest
//! waited.
//!
//! Runs on the migration thread, with one scoped `migration-rx` thread
//! reading the destination's requests. The source's guest is paused for
//! good, so its memory does not change under the reads. Everything read is
//! hostile: a request outside guest memory fails the migration. Never
//! does: resume the guest (it ran at the destination since the switch),
//! or wait on the destination past the stream timeout.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use migration::protocol::colo::Span;
use migration::protocol::postcopy::{self, Stalls};
use migration::protocol::{self, MemoryBatch, Message, PageRange, ProtocolError, PAGE_SIZE};
use vm_memory::{Bytes, GuestAddress};

use super::super::MigrateError;
use crate::streams::endpoint::Conn;
use crate::vstate::memory::{DirtyBitmap, GuestRam};

/// Pages per background batch: small, so that a requested page waits
/// little behind one.
const BACKGROUND_PAGES: usize = 32;
/// Spans per `Postcopy` message, at most.
const SPANS_PER_MESSAGE: usize = 1 << 16;

/// The pages the destination lacks: a bitmap per memory slot, cleared as
/// pages go out.
pub struct Needed {
    maps: Vec<DirtyBitmap>,
    left: u64,
    /// The background's next page: (bitmap, page).
    cursor: (usize, u64),
}

impl Needed {
    pub fn new(maps: Vec<DirtyBitmap>) -> Needed {
        let left = maps.iter().map(|d| d.count()).sum();
        Needed {
            maps,
            left,
            cursor: (0, 0),
        }
    }

    /// Pages not sent yet.
    pub fn left(&self) -> u64 {
        self.left
    }

    /// The needed pages as spans, in `Postcopy` messages.
    pub fn messages(&self) -> Vec<Message> {
        let mut spans = Vec::new();
        for d in &self.maps {
            let mut page = 0;
            while page < d.pages {
                if !bit(&d.bits, page) {
                    page += 1;
                    continue;
                }
                let start = page;
                while page < d.pages && bit(&d.bits, page) && page - start < u64::from(u32::MAX) {
                    page += 1;
                }
                spans.push(Span {
                    gpa: d.gpa + start * PAGE_SIZE,
                    pages: (page - start) as u32,
                });
            }
        }
        // At least one message, even empty: it is what says post-copy.
        if spans.is_empty() {
            return vec![Message::Postcopy(Vec::new())];
        }
        spans
            .chunks(SPANS_PER_MESSAGE)
            .map(|c| Message::Postcopy(c.to_vec()))
            .collect()
    }

    /// Takes `gpa`'s page if it is still to send.
    pub fn take(&mut self, gpa: u64) -> bool {
        for d in &mut self.maps {
            if gpa >= d.gpa && gpa < d.gpa + d.pages * PAGE_SIZE {
                let page = (gpa - d.gpa) / PAGE_SIZE;
                if bit(&d.bits, page) {
                    d.bits[(page / 64) as usize] &= !(1u64 << (page % 64));
                    self.left -= 1;
                    return true;
                }
                return false;
            }
        }
        false
    }

    /// The next up to `n` pages of the background, taken.
    pub fn next(&mut self, n: usize) -> Vec<u64> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n && self.left > 0 {
            let (m, page) = self.cursor;
            let Some(d) = self.maps.get(m) else { break };
            if page >= d.pages {
                self.cursor = (m + 1, 0);
                continue;
            }
            let gpa = d.gpa + page * PAGE_SIZE;
            self.cursor.1 += 1;
            if self.take(gpa) {
                out.push(gpa);
            }
        }
        out
    }
}

fn bit(bits: &[u64], page: u64) -> bool {
    bits.get((page / 64) as usize)
        .is_some_and(|w| w & (1u64 << (page % 64)) != 0)
}

/// What the reading thread hands the sender.
enum Heard {
    Page(u64),
    Done(Stalls),
    Failed(MigrateError),
}

/// What a serve did: the destination's stalls and the pages it asked for.
pub struct Served {
    pub stalls: Stalls,
    pub requested: u64,
}

/// Serves the destination until it holds every page of `needed`:
/// requested pages first, the rest in the background within `cap`
/// bytes/s (none: as fast as the stream goes). `progress` is told the
/// pages sent and asked for after each batch.
pub fn serve(
    ram: &GuestRam,
    conn: &mut Conn,
    mut needed: Needed,
    layout: &[(u64, u64)],
    cap: Option<f64>,
    timeout: Duration,
    progress: &dyn Fn(u64, u64),
) -> Result<Served, MigrateError> {
    let mut reader = conn.try_clone().map_err(MigrateError::Stream)?;
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        let listen = std::thread::Builder::new()
            .name("migration-rx".into())
            .spawn_scoped(s, move || hear(&mut reader, layout, &tx))
            .map_err(MigrateError::Stream)?;
        let r = send(ram, conn, &mut needed, &rx, cap, timeout, progress);
        if r.is_err() {
            // Wakes the reader.
            conn.shutdown();
        }
        let _ = listen.join();
        r
    })
}

/// The reading thread: requests (checked) and `Done`, handed over.
fn hear(conn: &mut Conn, layout: &[(u64, u64)], tx: &mpsc::Sender<Heard>) {
    loop {
        let heard = heard(protocol::read_message(conn), layout);
        let last = !matches!(heard, Heard::Page(_));
        if tx.send(heard).is_err() || last {
            return;
        }
    }
}

/// One message from the destination, read: a request (checked against
/// `layout`), `Done`, or why the serve fails.
fn heard(m: Result<Message, ProtocolError>, layout: &[(u64, u64)]) -> Heard {
    match m {
        Ok(Message::PageRequest(gpa)) => match postcopy::check_request(gpa, layout) {
            Ok(()) => Heard::Page(gpa),
            Err(e) => Heard::Failed(e.into()),
        },
        Ok(Message::Done(stalls)) => Heard::Done(stalls),
        Ok(Message::Abandon(why)) => Heard::Failed(ProtocolError::Abandoned(why).into()),
        Ok(other) => Heard::Failed(
            ProtocolError::Unexpected {
                expected: "PageRequest or Done",
                got: other.command().name(),
            }
            .into(),
        ),
        Err(e) => Heard::Failed(e.into()),
    }
}

/// What the fuzz target runs: the destination's messages in `bytes` read
/// as the source reads them after the switch, each request taken from
/// `needed` as the sender would; returns the pages requested, or why the
/// serve would fail (a `Done` ends it).
pub fn requests(
    mut bytes: &[u8],
    layout: &[(u64, u64)],
    needed: &mut Needed,
) -> Result<u64, MigrateError> {
    let mut taken = 0;
    loop {
        match heard(protocol::read_message(&mut bytes), layout) {
            Heard::Page(gpa) => taken += u64::from(needed.take(gpa)),
            Heard::Done(_) => return Ok(taken),
            Heard::Failed(e) => return Err(e),
        }
    }
}

/// The sending loop (see [`serve`]).
fn send(
    ram: &GuestRam,
    conn: &mut Conn,
    needed: &mut Needed,
    rx: &mpsc::Receiver<Heard>,
    cap: Option<f64>,
    timeout: Duration,
    progress: &dyn Fn(u64, u64),
) -> Result<Served, MigrateError> {
    let total = needed.left();
    let (start, mut background_bytes, mut requested) = (Instant::now(), 0u64, 0u64);
    let mut committed = false;
    loop {
        progress(total - needed.left(), requested);
        if needed.left() == 0 && !committed {
            protocol::write_message(conn, &Message::Commit)?;
            committed = true;
        }
        // Requests first; while the cap holds the background back, wait
        // for one instead of sleeping.
        let ahead = cap.and_then(|c| {
            let due = background_bytes as f64 / c - start.elapsed().as_secs_f64();
            (due > 0.0).then(|| Duration::from_secs_f64(due.min(1.0)))
        });
        let wait = if needed.left() == 0 {
            timeout
        } else {
            ahead.unwrap_or(Duration::ZERO)
        };
        match rx.recv_timeout(wait) {
            Ok(Heard::Page(gpa)) => {
                if needed.take(gpa) {
                    requested += 1;
                    send_pages(ram, conn, &[gpa])?;
                }
                continue;
            }
            Ok(Heard::Done(stalls)) if needed.left() == 0 => {
                return Ok(Served { stalls, requested })
            }
            Ok(Heard::Done(_)) => {
                return Err(MigrateError::Join(format!(
                    "the destination says it holds every page, {} are still to send",
                    needed.left()
                )))
            }
            Ok(Heard::Failed(e)) => return Err(e),
            Err(RecvTimeoutError::Disconnected) => {
                return Err(MigrateError::Join("the reading thread ended".into()))
            }
            Err(RecvTimeoutError::Timeout) if needed.left() == 0 => {
                return Err(MigrateError::Join(format!(
                    "no Done from the destination within {} s",
                    timeout.as_secs()
                )))
            }
            Err(RecvTimeoutError::Timeout) if ahead.is_some() => continue,
            Err(RecvTimeoutError::Timeout) => {}
        }
        let batch = needed.next(BACKGROUND_PAGES);
        background_bytes += batch.len() as u64 * PAGE_SIZE;
        send_pages(ram, conn, &batch)?;
    }
}

/// The pages at `gpas` (each one page), as one batch (zero pages as
/// markers).
fn send_pages(ram: &GuestRam, conn: &mut Conn, gpas: &[u64]) -> Result<(), MigrateError> {
    if gpas.is_empty() {
        return Ok(());
    }
    let mut batch = MemoryBatch::default();
    let mut page = vec![0u8; PAGE_SIZE as usize];
    for &gpa in gpas {
        ram.mem()
            .read_slice(&mut page, GuestAddress(gpa))
            .map_err(|e| MigrateError::Read(gpa, e))?;
        let zero = migration::memory::is_zero(&page);
        batch.ranges.push(PageRange {
            gpa,
            pages: 1,
            zero,
        });
        if !zero {
            batch.data.extend_from_slice(&page);
        }
    }
    protocol::write_message(conn, &Message::Memory(batch))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn needed() -> Needed {
        let mut bits = vec![0u64; 2];
        for p in [1u64, 2, 3, 70, 127] {
            bits[(p / 64) as usize] |= 1 << (p % 64);
        }
        Needed::new(vec![DirtyBitmap {
            slot: 0,
            gpa: 0x10_0000,
            pages: 128,
            bits,
        }])
    }

    #[test]
    fn spans_cover_the_needed_pages() {
        let n = needed();
        let Message::Postcopy(spans) = &n.messages()[0] else {
            panic!("a Postcopy message")
        };
        let page = |p: u64| 0x10_0000 + p * PAGE_SIZE;
        assert_eq!(
            spans,
            &vec![
                Span {
                    gpa: page(1),
                    pages: 3
                },
                Span {
                    gpa: page(70),
                    pages: 1
                },
                Span {
                    gpa: page(127),
                    pages: 1
                },
            ]
        );
    }

    #[test]
    fn a_requested_page_leaves_the_background_and_each_goes_once() {
        let mut n = needed();
        let page = |p: u64| 0x10_0000 + p * PAGE_SIZE;
        assert!(n.take(page(70)));
        assert!(!n.take(page(70)));
        assert!(!n.take(page(4)));
        assert!(!n.take(0));
        assert_eq!(n.next(2), vec![page(1), page(2)]);
        assert_eq!(n.next(10), vec![page(3), page(127)]);
        assert_eq!((n.left(), n.next(10)), (0, vec![]));
    }
}

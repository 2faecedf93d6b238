//! Page channels (`--colo-channels N`, like QEMU's multifd): with N > 1, a
//! checkpoint's pages go over N connections of their own at once instead
//! of the pair's stream (`migration::protocol`, COLO sequence).
//!
//! - The primary opens them after the network link ([`open`]), each
//!   starting with `Hello`; at a checkpoint, with its guest paused, it
//!   splits the dirty bitmap ([`split`]: every Nth run of 512 pages to
//!   channel n) and N threads send one share each, ending with `Commit`
//!   ([`send`]).
//! - The secondary accepts them after the network link ([`accept`]); at a
//!   checkpoint N threads read one channel each until its `Commit`
//!   ([`receive`]), while its own thread reads the stream; the checkpoint
//!   is applied only once every part arrived whole.
//!
//! Run on the sides' checkpoint threads (the primary's `colo`, the
//! secondary's `incoming`), with scoped threads for the parallel part.
//! Everything a secondary reads is hostile: each batch is checked against
//! its layout and the pages of all channels together are bounded by the
//! guest's size (one shared count), anything but `Memory` and `Commit` is
//! refused. Never does: hold a page past the bound; leave a thread behind
//! (every scoped thread is joined before a call returns).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use migration::protocol::{self, MemoryBatch, Message};

use super::ColoError;
use crate::migrate::inline::Slicer;
use crate::migrate::pages::{self, Sent, Stop};
use crate::streams::endpoint::{Conn, Listener};
use crate::streams::{Endpoint, Transport};
use crate::vstate::memory::{DirtyBitmap, GuestRam};

/// Bitmap words (64 pages each) per run handed to one channel.
const RUN_WORDS: usize = 8;

/// The primary's channels to the secondary at `to` (none for `n` ≤ 1).
pub fn open(
    transport: &Transport,
    to: &Endpoint,
    n: u16,
    timeout: Duration,
) -> Result<Vec<Conn>, ColoError> {
    let mut out = Vec::new();
    if n <= 1 {
        return Ok(out);
    }
    for i in 0..n {
        let mut c = transport
            .connect(to, timeout)
            .map_err(ColoError::io(format!("page channel {i} to {to}")))?;
        c.set_timeouts(timeout).map_err(ColoError::Stream)?;
        protocol::write_message(
            &mut c,
            &Message::Hello {
                version: protocol::VERSION,
            },
        )?;
        out.push(c);
    }
    Ok(out)
}

/// The secondary's `n` channels from its primary (none for `n` ≤ 1).
pub fn accept(listener: &Listener, n: u16, timeout: Duration) -> Result<Vec<Conn>, ColoError> {
    let mut out = Vec::new();
    if n <= 1 {
        return Ok(out);
    }
    for i in 0..n {
        let mut c = listener
            .accept_within(timeout)
            .map_err(ColoError::io(format!("no page channel {i}")))?;
        c.set_timeouts(timeout).map_err(ColoError::Stream)?;
        protocol::check_hello(&protocol::read_message(&mut c)?)?;
        out.push(c);
    }
    Ok(out)
}

/// `dirty` split `n` ways: run `r` of [`RUN_WORDS`] words goes to share
/// `r % n`; each share is a whole bitmap with the others' bits clear.
pub fn split(dirty: &[DirtyBitmap], n: usize) -> Vec<Vec<DirtyBitmap>> {
    let n = n.max(1);
    (0..n)
        .map(|share| {
            dirty
                .iter()
                .map(|d| {
                    let mut bits = d.bits.clone();
                    for (run, words) in bits.chunks_mut(RUN_WORDS).enumerate() {
                        if run % n != share {
                            words.fill(0);
                        }
                    }
                    DirtyBitmap {
                        slot: d.slot,
                        gpa: d.gpa,
                        pages: d.pages,
                        bits,
                    }
                })
                .collect()
        })
        .collect()
}

/// The primary, its guest paused: each share of `dirty` on its channel
/// at once, each ending with `Commit`. Returns the bytes sent.
pub fn send(
    ram: &GuestRam,
    channels: &mut [Conn],
    dirty: &[DirtyBitmap],
) -> Result<u64, ColoError> {
    let shares = split(dirty, channels.len());
    let results: Vec<Result<u64, ColoError>> = std::thread::scope(|s| {
        let threads: Vec<_> = channels
            .iter_mut()
            .zip(shares)
            .map(|(conn, share)| {
                std::thread::Builder::new()
                    .name("colo-pages".into())
                    .spawn_scoped(s, move || send_share(ram, conn, &share))
            })
            .collect();
        joined(threads)
    });
    results.into_iter().sum()
}

fn send_share(ram: &GuestRam, conn: &mut Conn, share: &[DirtyBitmap]) -> Result<u64, ColoError> {
    let bytes = send_pages(ram, conn, share)?;
    protocol::write_message(conn, &Message::Commit)?;
    Ok(bytes)
}

/// The pages set in `dirty`, on `conn`, at full speed (a checkpoint is
/// neither capped nor cancelled); the bytes sent.
pub fn send_pages(
    ram: &GuestRam,
    conn: &mut Conn,
    dirty: &[DirtyBitmap],
) -> Result<u64, ColoError> {
    let mut sent = Sent::default();
    let never = AtomicBool::new(false);
    let slicer = Slicer::thread();
    let stop = Stop {
        cancel: &never,
        others_failed: None,
        progress: &|_| {},
        until: None,
        slicer: &slicer,
    };
    let uncapped = crate::migrate::Params::default();
    let whole = pages::Share::WHOLE;
    pages::send_dirty(ram, conn, dirty, &uncapped, whole, &mut sent, &stop)?;
    Ok(sent.bytes())
}

/// Every scoped page thread's result (one that could not start or that
/// panicked is an error).
fn joined<T>(
    threads: Vec<std::io::Result<std::thread::ScopedJoinHandle<'_, Result<T, ColoError>>>>,
) -> Vec<Result<T, ColoError>> {
    threads
        .into_iter()
        .map(|t| match t {
            Ok(h) => h
                .join()
                .unwrap_or_else(|_| Err(ColoError::Panicked("a page thread"))),
            Err(e) => Err(ColoError::Stream(e)),
        })
        .collect()
}

/// The secondary: each channel's share of a checkpoint, read at once, each
/// batch checked against `layout`, at most `limit` pages in all. Returns
/// the batches and their pages.
pub fn receive(
    channels: &mut [Conn],
    layout: &[(u64, u64)],
    limit: u64,
) -> Result<(Vec<MemoryBatch>, u64), ColoError> {
    let count = AtomicU64::new(0);
    let results: Vec<Result<Vec<MemoryBatch>, ColoError>> = std::thread::scope(|s| {
        let threads: Vec<_> = channels
            .iter_mut()
            .map(|conn| {
                let count = &count;
                std::thread::Builder::new()
                    .name("colo-pages".into())
                    .spawn_scoped(s, move || receive_share(conn, layout, limit, count))
            })
            .collect();
        joined(threads)
    });
    let mut batches = Vec::new();
    for r in results {
        batches.extend(r?);
    }
    Ok((batches, count.load(Ordering::SeqCst)))
}

fn receive_share(
    conn: &mut Conn,
    layout: &[(u64, u64)],
    limit: u64,
    count: &AtomicU64,
) -> Result<Vec<MemoryBatch>, ColoError> {
    let mut batches = Vec::new();
    loop {
        match protocol::read_message(conn)? {
            Message::Memory(b) => {
                b.check(layout)?;
                let pages = b.pages();
                let total = count
                    .fetch_add(pages, Ordering::SeqCst)
                    .saturating_add(pages);
                if total > limit {
                    return Err(ColoError::TooBig {
                        pages: total,
                        limit,
                    });
                }
                batches.push(b);
            }
            Message::Commit => return Ok(batches),
            other => {
                return Err(ColoError::Unexpected {
                    got: other.command().name(),
                    place: "on a page channel",
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_page_once() {
        let bits: Vec<u64> = (0..40u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        let d = vec![DirtyBitmap {
            slot: 0,
            gpa: 0,
            pages: 40 * 64,
            bits: bits.clone(),
        }];
        for n in [1, 2, 3, 4] {
            let shares = split(&d, n);
            assert_eq!(shares.len(), n);
            for (w, &word) in bits.iter().enumerate() {
                let mut or = 0u64;
                for s in &shares {
                    let b = s[0].bits[w];
                    assert_eq!(or & b, 0, "a page in two shares");
                    or |= b;
                }
                assert_eq!(or, word, "word {w} with {n} shares");
            }
        }
    }
}

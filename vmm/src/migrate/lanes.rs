//! A migration over several streams (`--connections N`, like QEMU's
//! multifd and Cloud Hypervisor's connections), the source's side: it
//! says on the main stream how many streams there are and opens the others
//! ([`open`]), and sends each round, the stop-and-copy included, as one
//! share per stream at once ([`send`]: runs of pages dealt round-robin, see
//! [`Share`]).
//!
//! Runs on the migration thread, which sends the main stream's share
//! itself, with one scoped `migration-tx` thread per other stream for the
//! length of a round (each confined as the migration thread is: threads
//! inherit its filter). Never does: let a page move from one stream to
//! another between rounds (a page sent twice must arrive in order), leave
//! a thread behind (each is joined before [`send`] returns), or go on with
//! a round after one of its streams failed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use migration::protocol::streams::{Join, Streams, TOKEN_BYTES};
use migration::protocol::{self, Message};

use super::inline::Slicer;
use super::pages::{self, Sent, Share, Stop};
use super::status::Params;
use super::MigrateError;
use crate::streams::endpoint::{Conn, Endpoint};
use crate::streams::Transport;
use crate::vstate::memory::{DirtyBitmap, GuestRam};

/// A fresh token that binds a migration's streams together (the kernel's
/// random source).
fn token() -> std::io::Result<[u8; TOKEN_BYTES]> {
    let mut t = [0u8; TOKEN_BYTES];
    // SAFETY: getrandom writes at most `t.len()` bytes into `t`, a live
    // buffer of that many bytes; no other memory is touched.
    let n = unsafe { libc::getrandom(t.as_mut_ptr().cast(), t.len(), 0) };
    if n != t.len() as isize {
        return Err(std::io::Error::last_os_error());
    }
    Ok(t)
}

/// Right after `Accept` on the main stream `main`: with `n` > 1, says so
/// (`Streams`) and opens the `n - 1` other streams to `to`, each starting
/// with `Hello` and `Join`; returns them in order (none for `n` ≤ 1).
pub fn open(
    transport: &Transport,
    to: &Endpoint,
    main: &mut Conn,
    n: u16,
    timeout: Duration,
) -> Result<Vec<Conn>, MigrateError> {
    let mut out = Vec::new();
    if n <= 1 {
        return Ok(out);
    }
    let token = token().map_err(MigrateError::Stream)?;
    protocol::write_message(main, &Message::Streams(Streams { count: n, token }))?;
    for index in 1..n {
        let lane_error = |source| MigrateError::Lane {
            index: usize::from(index),
            of: usize::from(n),
            source: Box::new(source),
        };
        let mut c = transport
            .connect(to, timeout)
            .map_err(|e| lane_error(MigrateError::Connect(to.to_string(), e)))?;
        c.set_timeouts(timeout)
            .map_err(|e| lane_error(MigrateError::Stream(e)))?;
        let hello = Message::Hello {
            version: protocol::VERSION,
        };
        protocol::write_message(&mut c, &hello)
            .and_then(|()| protocol::write_message(&mut c, &Message::Join(Join { index, token })))
            .map_err(|e| lane_error(e.into()))?;
        out.push(c);
    }
    Ok(out)
}

/// What a round sends: all of RAM (round 0) or a dirty bitmap's pages.
#[derive(Clone, Copy)]
pub enum Work<'a> {
    All,
    Dirty(&'a [DirtyBitmap]),
}

/// A round's settings, shared by its streams' threads.
pub struct Round<'a> {
    pub ram: &'a GuestRam,
    /// The cap is split evenly between the streams.
    pub params: &'a Params,
    pub cancel: &'a AtomicBool,
    /// The time limit (none: the stop-and-copy, never cut short).
    pub until: Option<(Instant, u64)>,
    /// Told the total sent so far after each batch of any stream.
    pub progress: &'a (dyn Fn(&Sent) + Sync),
    /// The stop-and-copy: each other stream ends its share with `Commit`.
    pub commit: bool,
}

/// Sends `work` over `main` (share 0, on this thread) and `others` (one
/// thread each) at once, adding what went out to `sent`. The first stream
/// that fails fails the round (the others stop at their next span); a
/// cancel or the time limit is returned as it is, any other failure as
/// [`MigrateError::Lane`] naming the stream.
pub fn send(
    round: &Round,
    main: &mut Conn,
    others: &mut [Conn],
    work: Work,
    sent: &mut Sent,
) -> Result<(), MigrateError> {
    let of = others.len() + 1;
    let failed = AtomicBool::new(false);
    let base = sent.clone();
    let tally = Mutex::new(vec![Sent::default(); of]);
    let report = |index: usize, s: &Sent| {
        let mut total = base.clone();
        {
            let mut t = devices::sync::lock(&tally);
            t[index] = s.clone();
            t.iter().for_each(|x| total.absorb(x));
        }
        (round.progress)(&total);
    };
    let results: Vec<Result<Sent, MigrateError>> =
        std::thread::scope(|s| {
            let threads: Vec<_> = others
                .iter_mut()
                .enumerate()
                .map(|(i, conn)| {
                    let share = Share { index: i + 1, of };
                    let (failed, report) = (&failed, &report);
                    let t = std::thread::Builder::new()
                        .name("migration-tx".into())
                        .spawn_scoped(s, move || lane(round, conn, work, share, failed, report));
                    if t.is_err() {
                        failed.store(true, Ordering::SeqCst);
                    }
                    t
                })
                .collect();
            let share = Share { index: 0, of };
            let mut out = vec![lane(round, main, work, share, &failed, &report)];
            out.extend(threads.into_iter().map(|t| match t {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(MigrateError::Join("a sending thread panicked".into()))
                }),
                Err(e) => Err(MigrateError::Stream(e)),
            }));
            out
        });
    let mut first = None;
    for (index, r) in results.into_iter().enumerate() {
        match r {
            Ok(s) => sent.absorb(&s),
            Err(MigrateError::OtherStream) => {}
            Err(e) => {
                first.get_or_insert((index, e));
            }
        }
    }
    match first {
        None => Ok(()),
        Some((_, e @ (MigrateError::Cancelled | MigrateError::Timeout(_)))) => Err(e),
        Some((index, e)) => Err(MigrateError::Lane {
            index,
            of,
            source: Box::new(e),
        }),
    }
}

/// One stream's share of a round; what it sent.
fn lane(
    round: &Round,
    conn: &mut Conn,
    work: Work,
    share: Share,
    failed: &AtomicBool,
    report: &(dyn Fn(usize, &Sent) + Sync),
) -> Result<Sent, MigrateError> {
    let mut sent = Sent::default();
    let slicer = Slicer::thread();
    let progress = |s: &Sent| report(share.index, s);
    let stop = Stop {
        cancel: round.cancel,
        others_failed: Some(failed),
        progress: &progress,
        until: round.until,
        slicer: &slicer,
    };
    let (ram, params) = (round.ram, round.params);
    let r = match work {
        Work::All => pages::send_all(ram, conn, params, share, &mut sent, &stop),
        Work::Dirty(d) => pages::send_dirty(ram, conn, d, params, share, &mut sent, &stop),
    }
    .and_then(|()| {
        if round.commit && share.index > 0 {
            protocol::write_message(conn, &Message::Commit)?;
        }
        Ok(())
    });
    if r.is_err() {
        failed.store(true, Ordering::SeqCst);
    }
    r.map(|()| sent)
}

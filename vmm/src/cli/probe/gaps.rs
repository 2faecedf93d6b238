//! The gap collector: receives the guest's `tandem-jitter` datagrams,
//! parses them, puts their gaps on the probe's timeline, each once.
//!
//! Runs on the probe's `probe-gaps` thread, which owns the UDP socket and
//! everything it records until [`collect`] returns it. A datagram is
//! guest-controlled: [`parse`] takes at most [`MAX_DATAGRAM`] bytes and
//! [`MAX_TRIPLES`] gaps from it and refuses anything else whole; what is
//! kept across datagrams is capped ([`MAX_GAPS`], [`MAX_REPORTS`]).
//! Never panics on a datagram, never blocks longer than [`READ_TIMEOUT`]
//! between looks at the stop flag. Takes datagrams from any sender (listen
//! where only the guest reaches): a stranger's count as bad, or as gaps.
//!
//! The datagram, ASCII, unsigned decimal integers separated by spaces:
//!
//! ```text
//! TJ1 <seq> <now_us> <loops> <max_gap_us> <n> (<id> <end_us> <gap_us>){n}
//! ```
//!
//! `now_us` is the guest's CLOCK_MONOTONIC when it sent it; a gap ending at
//! `end_us` goes on the host timeline at
//! `arrival_ms - (now_us - end_us) / 1000`: each datagram is aligned by its
//! own arrival, so guest and host clocks need no common origin, and a
//! clock that jumps with the migration moves only that datagram's gaps.

use std::collections::HashSet;
use std::io::ErrorKind;
use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{Clock, Gap};

/// The longest datagram taken, bytes (a full one with 20-digit numbers is
/// about 2 KiB).
pub const MAX_DATAGRAM: usize = 4096;
/// The most gaps one datagram may carry.
pub const MAX_TRIPLES: usize = 32;
/// The most gaps kept.
pub const MAX_GAPS: usize = 200_000;
/// The most per-datagram maxima kept (5.5 h of datagrams every 100 ms).
pub const MAX_REPORTS: usize = 200_000;
/// How long a read waits before looking at the stop flag.
pub const READ_TIMEOUT: Duration = Duration::from_millis(50);

const MAGIC: &str = "TJ1";
/// The numbers before the triples.
const HEADER: usize = 5;

/// Why a datagram was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("longer than {MAX_DATAGRAM} bytes")]
    TooLong,
    #[error("not ASCII")]
    NotAscii,
    #[error("does not start with {MAGIC}")]
    Magic,
    #[error("field {0} is not an unsigned decimal integer that fits in 64 bits")]
    Number(usize),
    #[error("too few fields")]
    Truncated,
    #[error("{0} gaps (at most {MAX_TRIPLES})")]
    TooMany(u64),
    #[error("what follows the gap count is not {0} gap(s)")]
    Count(usize),
    #[error("a gap ends after the datagram was sent")]
    Future,
}

/// One gap as the guest tool reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Triple {
    pub id: u64,
    pub end_us: u64,
    pub gap_us: u64,
}

/// One valid datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub seq: u64,
    pub now_us: u64,
    pub loops: u64,
    pub max_gap_us: u64,
    /// At most [`MAX_TRIPLES`].
    pub gaps: Vec<Triple>,
}

/// Parses one datagram (a trailing newline is allowed).
pub fn parse(datagram: &[u8]) -> Result<Report, ParseError> {
    if datagram.len() > MAX_DATAGRAM {
        return Err(ParseError::TooLong);
    }
    if !datagram.is_ascii() {
        return Err(ParseError::NotAscii);
    }
    // ASCII is UTF-8.
    let text = std::str::from_utf8(datagram).map_err(|_| ParseError::NotAscii)?;
    let mut fields = text.split_ascii_whitespace();
    if fields.next() != Some(MAGIC) {
        return Err(ParseError::Magic);
    }
    let mut header = [0u64; HEADER];
    for (i, slot) in header.iter_mut().enumerate() {
        *slot = number(fields.next().ok_or(ParseError::Truncated)?, i + 1)?;
    }
    let [seq, now_us, loops, max_gap_us, n] = header;
    if n > MAX_TRIPLES as u64 {
        return Err(ParseError::TooMany(n));
    }
    let n = n as usize;
    // At most one field past the n triples is looked at (and bounds the
    // allocation), so a flood of fields costs nothing.
    let rest: Vec<&str> = fields.take(3 * n + 1).collect();
    if rest.len() != 3 * n {
        return Err(ParseError::Count(n));
    }
    let mut gaps = Vec::with_capacity(n);
    for (i, t) in rest.chunks_exact(3).enumerate() {
        let at = HEADER + 1 + 3 * i;
        let t = Triple {
            id: number(t[0], at)?,
            end_us: number(t[1], at + 1)?,
            gap_us: number(t[2], at + 2)?,
        };
        if t.end_us > now_us {
            return Err(ParseError::Future);
        }
        gaps.push(t);
    }
    Ok(Report {
        seq,
        now_us,
        loops,
        max_gap_us,
        gaps,
    })
}

/// Field `index` as a u64: decimal digits only (no sign), no overflow.
fn number(field: &str, index: usize) -> Result<u64, ParseError> {
    if field.is_empty() || !field.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ParseError::Number(index));
    }
    field.parse().map_err(|_| ParseError::Number(index))
}

/// What the collector recorded.
#[derive(Debug, Default)]
pub struct GapLog {
    /// The gaps, each once, in time order once [`GapLog::done`] ran.
    pub gaps: Vec<Gap>,
    /// The ids in `gaps`.
    seen: HashSet<u64>,
    pub by_report: Vec<(f64, f64)>,
    pub reports: u64,
    pub bad: u64,
    pub overflow: u64,
    pub loops: u64,
    /// The `seq` of the datagram `loops` came from.
    loops_seq: Option<u64>,
}

impl GapLog {
    /// Takes one datagram that arrived at `arrival_ms` (host timeline).
    pub fn take(&mut self, datagram: &[u8], arrival_ms: f64) {
        match parse(datagram) {
            Ok(r) => self.add(&r, arrival_ms),
            Err(e) => {
                self.bad += 1;
                log::debug!("jitter probe: bad datagram: {e}");
            }
        }
    }

    /// Adds a valid report: its gaps not seen yet, mapped by its arrival.
    pub fn add(&mut self, r: &Report, arrival_ms: f64) {
        self.reports += 1;
        if self.loops_seq.is_none_or(|s| r.seq >= s) {
            self.loops = r.loops;
            self.loops_seq = Some(r.seq);
        }
        if self.by_report.len() < MAX_REPORTS {
            self.by_report.push((arrival_ms, us_to_ms(r.max_gap_us)));
        } else {
            self.overflow += 1;
        }
        for t in &r.gaps {
            if self.seen.contains(&t.id) {
                continue;
            }
            let t_ms = arrival_ms - us_to_ms(t.now_minus(r.now_us));
            if t_ms < 0.0 {
                // Ended before the probe started: not this probe's.
                continue;
            }
            if self.gaps.len() >= MAX_GAPS {
                self.overflow += 1;
                continue;
            }
            self.seen.insert(t.id);
            self.gaps.push(Gap {
                t_ms,
                gap_ms: us_to_ms(t.gap_us),
                id: t.id,
            });
        }
    }

    /// Puts the gaps in time order.
    pub fn done(&mut self) {
        self.gaps.sort_by(|a, b| a.t_ms.total_cmp(&b.t_ms));
    }
}

impl Triple {
    /// How long before `now_us` this gap ended (`parse` checked it did).
    fn now_minus(&self, now_us: u64) -> u64 {
        now_us.saturating_sub(self.end_us)
    }
}

fn us_to_ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// The collector thread: reads datagrams until `stop`, then what is
/// already queued, and returns what it recorded.
pub fn collect(sock: &UdpSocket, clock: Clock, stop: &AtomicBool) -> GapLog {
    let mut log = GapLog::default();
    // One byte more than taken, to tell a datagram that is too long.
    let mut buf = vec![0u8; MAX_DATAGRAM + 1];
    if let Err(e) = sock.set_read_timeout(Some(READ_TIMEOUT)) {
        log::warn!("jitter probe: no read timeout on the UDP socket ({e}); polling");
        let _ = sock.set_nonblocking(true);
    }
    while !stop.load(Ordering::SeqCst) {
        match sock.recv_from(&mut buf) {
            Ok((len, _)) => log.take(&buf[..len], clock.now_ms()),
            Err(e) if transient(&e) => {
                if e.kind() == ErrorKind::WouldBlock {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            Err(e) => {
                log::debug!("jitter probe: UDP receive: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    if sock.set_nonblocking(true).is_ok() {
        while let Ok((len, _)) = sock.recv_from(&mut buf) {
            log.take(&buf[..len], clock.now_ms());
        }
    }
    log.done();
    log
}

/// A read timeout, or an interruption.
fn transient(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
    )
}

#[cfg(test)]
mod tests;

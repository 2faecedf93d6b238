//! A migration over several streams (`--connections N`), the
//! destination's side: the other streams let in and checked against the
//! main stream's `Streams` ([`Joiner`], [`Listening`]), and the memory of
//! all of them placed at once ([`receive`]), the state handed back only
//! once every stream has delivered its share.
//!
//! Runs on the incoming thread, with one scoped `incoming-rx` thread per
//! other stream for the length of the receive (each confined as the
//! incoming thread is: threads inherit its filter). Everything read is
//! hostile: a connection without this migration's token is refused and the
//! wait goes on (for at most [`JOIN_WAIT`]); each batch on any stream is
//! checked against this VM's layout before it is written; a stream may
//! carry only `Memory` and, last, `Commit`. Never does: apply the state
//! before every stream's `Commit`, leave a thread behind, or wait on a
//! source that sends nothing on any stream for longer than the stream
//! timeout.

use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use migration::protocol::colo::Span;
use migration::protocol::streams::Streams;
use migration::protocol::{self, Message, ProtocolError};

use super::MigrateError;
use crate::streams::endpoint::{Conn, Listener};
use devices::GuestMemoryMmap;

/// How long the other streams may take to arrive after `Streams`.
pub const JOIN_WAIT: Duration = Duration::from_secs(30);
/// How long a new connection may take to say which stream it is.
const INTRODUCE_WAIT: Duration = Duration::from_secs(5);
/// How often a waiting stream looks whether the others still go on.
const TICK: Duration = Duration::from_secs(1);

/// How a destination gets a migration's other streams.
pub trait Joiner {
    type Stream: Read + Send;

    /// The `streams.count - 1` other streams, in order.
    fn join(&mut self, streams: &Streams) -> Result<Vec<Self::Stream>, MigrateError>;
}

/// One stream only: a source that asks for more is refused.
pub struct Alone;

impl Joiner for Alone {
    type Stream = io::Empty;

    fn join(&mut self, streams: &Streams) -> Result<Vec<io::Empty>, MigrateError> {
        Err(MigrateError::Join(format!(
            "the source asks for {} streams; this receive takes one",
            streams.count
        )))
    }
}

/// The other streams from the listener the main one came on.
pub struct Listening<'a> {
    pub listener: &'a Listener,
    /// How long a stream may stay silent while no other sends either.
    pub timeout: Duration,
}

impl Joiner for Listening<'_> {
    type Stream = Conn;

    fn join(&mut self, streams: &Streams) -> Result<Vec<Conn>, MigrateError> {
        let others = usize::from(streams.count) - 1;
        let mut got: Vec<Option<Conn>> = (0..others).map(|_| None).collect();
        let end = Instant::now() + JOIN_WAIT;
        while got.iter().any(Option::is_none) {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let came = got.iter().filter(|c| c.is_some()).count();
                return Err(MigrateError::Join(format!(
                    "{came} of the source's {others} other streams came within {} s",
                    JOIN_WAIT.as_secs()
                )));
            }
            let c = match self.listener.accept_within(left) {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::TimedOut => continue,
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                    eprintln!("tandem: incoming: {e}; still waiting for the source's streams");
                    continue;
                }
                Err(e) => return Err(MigrateError::Stream(e)),
            };
            let mut c = c;
            match introduce(&mut c, streams) {
                Ok(index) if got[index - 1].is_none() => {
                    // Short reads: a waiting stream looks at the others.
                    c.set_timeouts(TICK).map_err(MigrateError::Stream)?;
                    got[index - 1] = Some(c);
                }
                Ok(index) => eprintln!("tandem: incoming: stream {index} came twice; refused"),
                Err(e) => eprintln!(
                    "tandem: incoming: a connection that is not one of this migration's \
                     streams was refused ({e}); still waiting"
                ),
            }
        }
        Ok(got.into_iter().flatten().collect())
    }
}

/// A new connection's `Hello` and `Join`: which of `streams` it is.
fn introduce(c: &mut Conn, streams: &Streams) -> Result<usize, ProtocolError> {
    c.set_timeouts(INTRODUCE_WAIT)?;
    protocol::check_hello(&protocol::read_message(c)?)?;
    match protocol::read_message(c)? {
        Message::Join(j) if j.belongs(streams) => Ok(usize::from(j.index)),
        Message::Join(j) => Err(ProtocolError::Malformed {
            command: "Join",
            msg: format!("stream {} with another migration's token", j.index),
        }),
        other => Err(ProtocolError::Unexpected {
            expected: "Join",
            got: other.command().name(),
        }),
    }
}

/// What the streams of one receive share: whether the main stream failed,
/// and when any of them last got a byte.
struct Liveness {
    start: Instant,
    last_ms: AtomicU64,
    main_failed: AtomicBool,
    timeout: Duration,
}

impl Liveness {
    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
    }

    fn quiet_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}

/// A stream read while the others are watched: a read that times out is
/// tried again while some stream got a byte within the timeout and the
/// main stream has not failed.
struct Patient<'a, T> {
    inner: T,
    live: &'a Liveness,
}

impl<T: Read> Read for Patient<'_, T> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.inner.read(buf) {
                Ok(n) => {
                    self.live.touch();
                    return Ok(n);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    if self.live.main_failed.load(Ordering::SeqCst) {
                        return Err(io::Error::other("the main stream failed"));
                    }
                    if self.live.quiet_for() >= self.live.timeout {
                        return Err(e);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// What the streams delivered: the state image, the pages written, and
/// with post-copy the pages still to fetch.
#[derive(Debug)]
pub struct Received {
    pub image: Vec<u8>,
    pub pages: u64,
    /// `Postcopy`'s pages (none: not a post-copy).
    pub postcopy: Option<Vec<Span>>,
}

/// The memory of every stream, placed at once: `main` (whose next message
/// is `first`) on this thread up to its `State`, each of `others` on its
/// own thread up to its `Commit`; each batch checked against `layout`
/// and written into `mem`. Returns the state image and the pages written,
/// once every stream has delivered its share. A stream that fails fails
/// the receive (its error is the one returned, naming it).
pub fn receive<S: Read, T: Read + Send>(
    main: &mut S,
    first: Message,
    others: Vec<T>,
    layout: &[(u64, u64)],
    mem: &GuestMemoryMmap,
    timeout: Duration,
) -> Result<Received, MigrateError> {
    let live = Liveness {
        start: Instant::now(),
        last_ms: AtomicU64::new(0),
        main_failed: AtomicBool::new(false),
        timeout,
    };
    // Who failed first: 0 nobody, 1 the main stream, 2 + i other stream i.
    let first_failed = AtomicUsize::new(0);
    let failed = |who: usize| {
        let _ = first_failed.compare_exchange(0, who, Ordering::SeqCst, Ordering::SeqCst);
    };
    let (main_result, results) = std::thread::scope(|s| {
        let threads: Vec<_> = others
            .into_iter()
            .enumerate()
            .map(|(i, conn)| {
                let (live, failed) = (&live, &failed);
                std::thread::Builder::new()
                    .name("incoming-rx".into())
                    .spawn_scoped(s, move || {
                        let mut conn = Patient { inner: conn, live };
                        let r = read_share(&mut conn, layout, mem);
                        if r.is_err() {
                            failed(2 + i);
                        }
                        r
                    })
            })
            .collect();
        let mut patient = Patient {
            inner: &mut *main,
            live: &live,
        };
        let r = read_main(&mut patient, first, layout, mem);
        if r.is_err() {
            failed(1);
            live.main_failed.store(true, Ordering::SeqCst);
        }
        let results: Vec<Result<u64, MigrateError>> = threads
            .into_iter()
            .map(|t| match t {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(MigrateError::Join("a receiving thread panicked".into()))
                }),
                Err(e) => Err(MigrateError::Stream(e)),
            })
            .collect();
        (r, results)
    });
    outcome(main_result, results, first_failed.load(Ordering::SeqCst))
}

/// The receive's result from the main stream's and the others': the
/// source's own word (`Abandon`, naming the stream that broke) first,
/// else the stream that failed first (`first`: 1 the main one, 2 + i
/// other stream i).
fn outcome(
    main: Result<Received, MigrateError>,
    others: Vec<Result<u64, MigrateError>>,
    first: usize,
) -> Result<Received, MigrateError> {
    let of = others.len() + 1;
    let abandoned = matches!(
        main,
        Err(MigrateError::Protocol(ProtocolError::Abandoned(_)))
    );
    let mut pages = 0;
    for (i, r) in others.into_iter().enumerate() {
        match r {
            Ok(p) => pages += p,
            Err(e) if !abandoned && (first == 2 + i || main.is_ok()) => {
                return Err(MigrateError::Lane {
                    index: i + 1,
                    of,
                    source: Box::new(e),
                })
            }
            Err(_) => {}
        }
    }
    let mut received = main?;
    received.pages += pages;
    Ok(received)
}

/// The main stream from `first` on: its batches (and with post-copy the
/// pages still to fetch, at most as many as guest RAM holds), up to
/// `State`.
fn read_main<R: Read>(
    main: &mut R,
    first: Message,
    layout: &[(u64, u64)],
    mem: &GuestMemoryMmap,
) -> Result<Received, MigrateError> {
    let mut pages = 0u64;
    let mut postcopy: Option<Vec<Span>> = None;
    let ram_pages: u64 = layout
        .iter()
        .map(|(_, len)| len / protocol::PAGE_SIZE)
        .sum();
    let mut next = first;
    loop {
        match next {
            Message::Memory(batch) => {
                batch.check(layout)?;
                pages += super::dest::write_batch(mem, &batch)?;
            }
            Message::Postcopy(spans) => {
                migration::protocol::colo::check_spans(&spans, layout)?;
                let all = postcopy.get_or_insert_with(Vec::new);
                all.extend(spans);
                let named: u64 = all.iter().map(|s| u64::from(s.pages)).sum();
                if named > ram_pages {
                    return Err(MigrateError::Join(format!(
                        "the source names {named} pages to fetch; guest RAM has {ram_pages}"
                    )));
                }
            }
            Message::State(image) => {
                return Ok(Received {
                    image,
                    pages,
                    postcopy,
                })
            }
            Message::Abandon(why) => return Err(ProtocolError::Abandoned(why).into()),
            other => {
                return Err(ProtocolError::Unexpected {
                    expected: "Memory or State",
                    got: other.command().name(),
                }
                .into())
            }
        }
        next = protocol::read_message(main)?;
    }
}

/// One other stream: its batches, up to `Commit`.
fn read_share<R: Read>(
    conn: &mut R,
    layout: &[(u64, u64)],
    mem: &GuestMemoryMmap,
) -> Result<u64, MigrateError> {
    let mut pages = 0u64;
    loop {
        match protocol::read_message(conn)? {
            Message::Memory(batch) => {
                batch.check(layout)?;
                pages += super::dest::write_batch(mem, &batch)?;
            }
            Message::Commit => return Ok(pages),
            other => {
                return Err(ProtocolError::Unexpected {
                    expected: "Memory or Commit",
                    got: other.command().name(),
                }
                .into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use migration::protocol::{MemoryBatch, PageRange};
    use vm_memory::{Bytes, GuestAddress};

    const MEM: u64 = 1 << 20;

    fn frames(msgs: &[Message]) -> Vec<u8> {
        let mut out = Vec::new();
        for m in msgs {
            protocol::write_message(&mut out, m).unwrap();
        }
        out
    }

    fn page(gpa: u64, byte: u8) -> Message {
        Message::Memory(MemoryBatch {
            ranges: vec![PageRange {
                gpa,
                pages: 1,
                zero: false,
            }],
            data: vec![byte; protocol::PAGE_SIZE as usize],
        })
    }

    fn run(others: Vec<Vec<u8>>) -> (Result<Received, MigrateError>, GuestMemoryMmap) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
        let mut main = io::Cursor::new(frames(&[page(0, 1), Message::State(vec![7])]));
        let others = others.into_iter().map(io::Cursor::new).collect();
        let r = receive(
            &mut main,
            page(0x1000, 2),
            others,
            &[(0, MEM)],
            &mem,
            Duration::from_secs(1),
        );
        (r, mem)
    }

    #[test]
    fn every_stream_places_its_pages_before_the_state_is_handed_back() {
        let (r, mem) = run(vec![
            frames(&[page(0x2000, 3), Message::Commit]),
            frames(&[page(0x3000, 4), page(0x4000, 5), Message::Commit]),
        ]);
        let r = r.unwrap();
        assert_eq!((r.image, r.pages, r.postcopy), (vec![7], 5, None));
        for (gpa, byte) in [
            (0u64, 1u8),
            (0x1000, 2),
            (0x2000, 3),
            (0x3000, 4),
            (0x4000, 5),
        ] {
            assert_eq!(mem.read_obj::<u8>(GuestAddress(gpa)).unwrap(), byte);
        }
    }

    #[test]
    fn a_stream_that_ends_without_its_commit_fails_the_receive_naming_it() {
        let (r, _) = run(vec![
            frames(&[page(0x2000, 3), Message::Commit]),
            frames(&[page(0x3000, 4)]),
        ]);
        let e = r.unwrap_err().to_string();
        assert!(e.starts_with("stream 2 of 3:"), "{e}");
    }

    #[test]
    fn a_stream_with_a_page_outside_memory_or_another_message_fails() {
        let (r, _) = run(vec![frames(&[page(MEM, 3), Message::Commit])]);
        let e = r.unwrap_err().to_string();
        assert!(e.contains("stream 1 of 2") && e.contains("outside"), "{e}");
        let (r, _) = run(vec![frames(&[Message::State(vec![1])])]);
        let e = r.unwrap_err().to_string();
        assert!(e.contains("expected Memory or Commit, got State"), "{e}");
    }

    #[test]
    fn the_sources_abandon_is_the_error_told() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
        let mut main = io::Cursor::new(Vec::new());
        let why = Message::Abandon("stream 1 of 2: broken pipe".into());
        let r = receive(
            &mut main,
            why,
            vec![io::Cursor::new(Vec::new())],
            &[(0, MEM)],
            &mem,
            Duration::from_secs(1),
        );
        let e = r.unwrap_err().to_string();
        assert!(e.contains("abandoned") && e.contains("broken pipe"), "{e}");
    }
}

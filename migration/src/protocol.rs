//! The live-migration wire protocol: the messages a source and a
//! destination exchange over one stream (TCP or a Unix socket), how each is
//! framed and checked, and what the destination checks a memory batch
//! against before it writes a byte.
//!
//! Pure: encodes and decodes, touches no guest memory, starts no thread.
//! The vmm's migration thread (source) and incoming side (destination)
//! drive it. Everything read is hostile: a frame is length-checked against
//! [`MAX_PAYLOAD`] before anything is allocated, checksummed, and decoded
//! exactly (no trailing bytes); a memory batch is checked against the
//! destination's own layout, so the destination never writes or allocates
//! beyond the guest size it was started with.
//!
//! # Framing
//!
//! All integers are little-endian.
//!
//! ```text
//! 4   payload length L (u32), at most MAX_PAYLOAD
//! 1   command (Command as u8)
//! L   payload
//! 4   CRC-32 (IEEE) of the command byte and the payload
//! ```
//!
//! # Messages ([`Message`], payload per command)
//!
//! ```text
//! Hello    8 magic "TNDMMIG\0", 4 protocol version
//! Config   the source's Manifest as JSON (devices, memory size, vCPUs,
//!          the firmware image by size and SHA-256)
//! Accept   empty: the destination takes this guest, send memory
//! Memory   4 range count N; N x (8 gpa, 4 pages, 1 kind: 0 data, 1 zero);
//!          then the data ranges' pages, 4096 bytes each, in table order
//! State    a tandem snapshot image (the snapshot file format) holding the
//!          state sections and an empty memory section: the same sections
//!          and checks as a snapshot restore
//! Ready    empty: the destination has applied the state, paused
//! Go       empty: the guest is the destination's; the source never runs
//!          it again
//! Abandon  a reason (UTF-8): the sender gives up; the source runs the guest
//! Streams  2 stream count N (2 to 16), 16 token: N streams in all
//! Join     2 stream index (1 to N - 1), 16 token: this stream is one of
//!          them (the first message after its Hello)
//! Postcopy 4 span count N; N x (8 gpa, 4 pages): pages the destination
//!          lacks and fetches after the switch (one or more, before State)
//! PageRequest  8 gpa: the destination's guest faulted on this page
//! Done     6 x 8: faults, requested, background pages, and a fault's wait
//!          p50, p99, max in µs: the destination holds every page
//!
//! COLO (a primary/secondary pair on one stream, after Go; see below):
//! Protect     4 heartbeat interval ms, 4 heartbeat timeout ms, 2 page
//!             channels (1 to 16; absent: 1)
//! Disks       4 count N (at most 64); N x 32 SHA-256 of each disk image,
//!             in device order (answered by Accept, or Abandon: they differ)
//! Heartbeat   empty (the primary asks, the secondary answers)
//! Checkpoint  8 epoch: pause, and tell me what you wrote
//! Dirty       4 span count N; N x (8 gpa, 4 pages): the pages the
//!             secondary's guest wrote since the last committed checkpoint
//! Commit      empty: the checkpoint (Memory x n, State) is whole; on a
//!             page channel: this channel's share of it is whole
//! Committed   empty: the secondary applied it, paused
//! DiskWrite   4 disk (index among the disks), 8 offset, then 1 to
//!             DISK_WRITE_MAX bytes: what the primary's guest wrote there,
//!             journaled by the secondary until the next Commit
//! ```
//!
//! # Sequence
//!
//! ```text
//! source (migration thread)              destination (--incoming)
//!   Hello ----------------------------->   version checked
//!   Config ---------------------------->   manifest checked against its
//!                                          own devices and memory size
//!   <------------------------------------  Accept  (or Abandon: refused)
//!   dirty log on
//!   Memory x n (round 0: all of RAM;  -->  each batch checked, written
//!   then the pages dirtied meanwhile)
//!   pause the VM (stop-and-copy)
//!   Memory x n (the last dirty pages) -->
//!   State ----------------------------->   checked whole, applied (paused)
//!   <------------------------------------  Ready   (or Abandon)
//!   Go -------------------------------->   resumes the guest, announces
//!   exits: the guest left                  its MAC
//! ```
//!
//! With `--connections N` (N > 1) the source sends `Streams` right after
//! `Accept` and opens N - 1 more connections, each `Hello` then `Join`
//! with the token (a stray connection, or one with another token, is
//! refused and the wait goes on). Each page belongs to one stream for the
//! whole migration (runs of 512 pages of a memory slot, dealt round-robin),
//! so a page sent twice arrives in order. Every round, the stop-and-copy
//! included, sends each stream's share on it at once (one thread each);
//! each other stream ends with `Commit` after its share of the
//! stop-and-copy, and the destination applies `State` (on the main stream,
//! after its own share) only once every stream's `Commit` came. A stream
//! that breaks fails the migration; the source sends `Abandon` on the main
//! stream (if it can) and runs the guest on.
//!
//! Post-copy replaces the stop-and-copy's pages with `Postcopy` (the pages
//! still to fetch, at least one message, perhaps empty); after `Go` the
//! stream goes on:
//!
//! ```text
//! source (migration thread)              destination (incoming thread)
//!   Postcopy x n, State --------------->   stale pages dropped, RAM under
//!   <------------------------------------  Ready      a userfaultfd
//!   Go -------------------------------->   runs the guest
//!   <------------------------------------  PageRequest x n (its faults)
//!   Memory x n (asked first, the rest -->  each missing page placed
//!   in the background)
//!   Commit (every page sent) ---------->
//!   <------------------------------------  Done (what the guest waited)
//! ```
//!
//! After `Go` neither side alone holds the guest: a failure loses it.
//!
//! A COLO pair starts as a migration whose source keeps its guest: after
//! `Go` both run, and the stream goes on:
//!
//! ```text
//! primary (colo thread)                  secondary (--colo secondary)
//!   Protect --------------------------->   dirty log on, heartbeat timer
//!   Disks ----------------------------->   its own images' sums compared
//!   <------------------------------------  Accept  (or Abandon: they differ)
//!   Heartbeat ------------------------->   (any message is a sign of life)
//!   <------------------------------------  Heartbeat
//!   DiskWrite x n (its guest's writes,->   journaled, not applied
//!   as they happen)
//!   Checkpoint e ---------------------->   pauses its guest
//!   <------------------------------------  Dirty (its pages since e-1)
//!   pauses its guest
//!   DiskWrite x n (the last writes) --->   journaled
//!   Memory x n (its dirty pages OR the -->  buffered, checked, not applied
//!   secondary's)
//!   State ----------------------------->   buffered, checked
//!   Commit ---------------------------->   writes the pages, applies the
//!                                          state and the disk journal,
//!                                          drops its own disk writes:
//!                                          an exact copy
//!   <------------------------------------  Committed
//!   resumes                                resumes
//! ```
//!
//! With `channels` N > 1 (`--colo-channels`, like QEMU's multifd), the
//! primary opens N more connections after the network link, each starting
//! with Hello; a checkpoint's pages then go over those, each channel's share
//! (every Nth span of the dirty bitmap) ending with its own Commit, sent by
//! N threads at once and read by N threads on the secondary, which holds
//! the checkpoint whole (all channels' Commits and the stream's) before it
//! applies anything. The stream carries the rest as above (no Memory).
//!
//! A checkpoint that does not arrive whole is dropped: the secondary's
//! guest goes on from its own state (the pages it wrote stay owed to the
//! next checkpoint).
//!
//! Until the source has sent `Go`, any failure (a refusal, a broken
//! stream, a timeout, a cancel) ends the migration with the source's guest
//! resumed; the destination never runs a guest without `Go`. Once `Go` is
//! sent, the source never resumes it: exactly one side runs the guest.

use std::io::{self, Read, Write};

use crate::manifest::Manifest;

pub mod colo;
pub mod postcopy;
pub mod streams;

/// The first bytes of a migration stream.
pub const MAGIC: [u8; 8] = *b"TNDMMIG\0";
/// The protocol version this tandem speaks.
pub const VERSION: u32 = 1;
/// The page size of memory batches.
pub const PAGE_SIZE: u64 = 4096;
/// Pages of data in one memory batch, at most.
pub const BATCH_PAGES: usize = 256;
/// Ranges in one memory batch, at most.
pub const BATCH_RANGES: usize = 4096;
/// The largest payload taken: a full batch (table and data), or a state
/// image (a few vCPUs of some tens of KiB each, devices, serial).
pub const MAX_PAYLOAD: usize = 16 << 20;
const RANGE_ENTRY: usize = 13;

/// Protocol errors: the stream, the framing, a message that does not
/// decode, and a batch outside the destination's memory.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The stream failed or ended.
    #[error("migration stream: {0}")]
    Io(#[from] io::Error),
    /// The frame says its payload is longer than any message.
    #[error("message of {0} bytes is over the {MAX_PAYLOAD}-byte limit")]
    Oversized(u64),
    /// The frame's checksum does not match.
    #[error("message {command} fails its checksum (stream damaged)")]
    Checksum {
        /// The command byte as read.
        command: u8,
    },
    /// An unknown command byte.
    #[error("unknown command {0}")]
    UnknownCommand(u8),
    /// The stream is not a tandem migration stream.
    #[error("not a tandem migration stream")]
    Foreign,
    /// The peer speaks another version.
    #[error("migration protocol version {theirs}, this tandem speaks {VERSION}")]
    Version {
        /// The peer's version.
        theirs: u32,
    },
    /// A payload that does not decode as its command says.
    #[error("malformed {command} message: {msg}")]
    Malformed {
        /// Which message.
        command: &'static str,
        /// What is wrong.
        msg: String,
    },
    /// A message that is not the one this point of the protocol takes.
    #[error("expected {expected}, got {got}")]
    Unexpected {
        /// What the protocol wants here.
        expected: &'static str,
        /// What came.
        got: &'static str,
    },
    /// The peer gave up, with its reason.
    #[error("the peer abandoned the migration: {0}")]
    Abandoned(String),
    /// A batch range outside the destination's memory.
    #[error("{pages} page(s) at {gpa:#x} are outside this VM's memory")]
    OutsideMemory {
        /// The range's first address.
        gpa: u64,
        /// Its page count.
        pages: u32,
    },
}

type Result<T> = std::result::Result<T, ProtocolError>;

/// The command byte of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Command {
    Hello = 1,
    Config = 2,
    Accept = 3,
    Memory = 4,
    State = 5,
    Ready = 6,
    Go = 7,
    Abandon = 8,
    Protect = 9,
    Heartbeat = 10,
    Checkpoint = 11,
    Dirty = 12,
    Commit = 13,
    Committed = 14,
    Disks = 15,
    DiskWrite = 16,
    Streams = 17,
    Join = 18,
    Postcopy = 19,
    PageRequest = 20,
    Done = 21,
}

impl Command {
    fn from_u8(b: u8) -> Result<Command> {
        Ok(match b {
            1 => Command::Hello,
            2 => Command::Config,
            3 => Command::Accept,
            4 => Command::Memory,
            5 => Command::State,
            6 => Command::Ready,
            7 => Command::Go,
            8 => Command::Abandon,
            9 => Command::Protect,
            10 => Command::Heartbeat,
            11 => Command::Checkpoint,
            12 => Command::Dirty,
            13 => Command::Commit,
            14 => Command::Committed,
            15 => Command::Disks,
            16 => Command::DiskWrite,
            17 => Command::Streams,
            18 => Command::Join,
            19 => Command::Postcopy,
            20 => Command::PageRequest,
            21 => Command::Done,
            other => return Err(ProtocolError::UnknownCommand(other)),
        })
    }

    /// The command's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Command::Hello => "Hello",
            Command::Config => "Config",
            Command::Accept => "Accept",
            Command::Memory => "Memory",
            Command::State => "State",
            Command::Ready => "Ready",
            Command::Go => "Go",
            Command::Abandon => "Abandon",
            Command::Protect => "Protect",
            Command::Heartbeat => "Heartbeat",
            Command::Checkpoint => "Checkpoint",
            Command::Dirty => "Dirty",
            Command::Commit => "Commit",
            Command::Committed => "Committed",
            Command::Disks => "Disks",
            Command::DiskWrite => "DiskWrite",
            Command::Streams => "Streams",
            Command::Join => "Join",
            Command::Postcopy => "Postcopy",
            Command::PageRequest => "PageRequest",
            Command::Done => "Done",
        }
    }
}

/// One range of a memory batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRange {
    /// Guest physical address of the first page (page-aligned).
    pub gpa: u64,
    /// Pages, at least 1.
    pub pages: u32,
    /// All zero: no bytes follow for it.
    pub zero: bool,
}

impl PageRange {
    fn bytes(self) -> u64 {
        u64::from(self.pages) * PAGE_SIZE
    }
}

/// A memory batch: its ranges and the bytes of its data ranges, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryBatch {
    pub ranges: Vec<PageRange>,
    pub data: Vec<u8>,
}

impl MemoryBatch {
    /// Pages the batch carries, data and zero.
    pub fn pages(&self) -> u64 {
        self.ranges.iter().map(|r| u64::from(r.pages)).sum()
    }

    /// Each range with its bytes (`None` for a zero range).
    pub fn iter(&self) -> impl Iterator<Item = (PageRange, Option<&[u8]>)> + '_ {
        let mut at = 0usize;
        self.ranges.iter().map(move |&r| {
            if r.zero {
                (r, None)
            } else {
                let n = r.bytes() as usize;
                let bytes = &self.data[at..at + n];
                at += n;
                (r, Some(bytes))
            }
        })
    }

    /// Checks every range against `layout` (the destination's regions as
    /// `(gpa, length)`): page-aligned, each inside one region.
    pub fn check(&self, layout: &[(u64, u64)]) -> Result<()> {
        for r in &self.ranges {
            let inside = r.gpa.is_multiple_of(PAGE_SIZE)
                && r.gpa.checked_add(r.bytes()).is_some_and(|end| {
                    layout
                        .iter()
                        .any(|&(start, len)| r.gpa >= start && end <= start + len)
                });
            if !inside {
                return Err(ProtocolError::OutsideMemory {
                    gpa: r.gpa,
                    pages: r.pages,
                });
            }
        }
        Ok(())
    }
}

/// A protocol message.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    Hello {
        version: u32,
    },
    Config(Manifest),
    Accept,
    Memory(MemoryBatch),
    State(Vec<u8>),
    Ready,
    Go,
    Abandon(String),
    Protect(colo::Timing),
    Heartbeat,
    Checkpoint {
        epoch: u64,
    },
    Dirty(Vec<colo::Span>),
    Commit,
    Committed,
    Disks(Vec<[u8; 32]>),
    DiskWrite(colo::DiskWrite),
    Streams(streams::Streams),
    Join(streams::Join),
    /// The pages the destination must fetch after the switch.
    Postcopy(Vec<colo::Span>),
    /// The destination's guest faulted on this page.
    PageRequest(u64),
    /// The destination holds every page.
    Done(postcopy::Stalls),
}

impl Message {
    /// The message's command.
    pub fn command(&self) -> Command {
        match self {
            Message::Hello { .. } => Command::Hello,
            Message::Config(_) => Command::Config,
            Message::Accept => Command::Accept,
            Message::Memory(_) => Command::Memory,
            Message::State(_) => Command::State,
            Message::Ready => Command::Ready,
            Message::Go => Command::Go,
            Message::Abandon(_) => Command::Abandon,
            Message::Protect(_) => Command::Protect,
            Message::Heartbeat => Command::Heartbeat,
            Message::Checkpoint { .. } => Command::Checkpoint,
            Message::Dirty(_) => Command::Dirty,
            Message::Commit => Command::Commit,
            Message::Committed => Command::Committed,
            Message::Disks(_) => Command::Disks,
            Message::DiskWrite(_) => Command::DiskWrite,
            Message::Streams(_) => Command::Streams,
            Message::Join(_) => Command::Join,
            Message::Postcopy(_) => Command::Postcopy,
            Message::PageRequest(_) => Command::PageRequest,
            Message::Done(_) => Command::Done,
        }
    }

    fn payload(&self) -> Result<Vec<u8>> {
        Ok(match self {
            Message::Hello { version } => {
                let mut p = MAGIC.to_vec();
                p.extend_from_slice(&version.to_le_bytes());
                p
            }
            Message::Config(m) => serde_json::to_vec(m).map_err(|e| ProtocolError::Malformed {
                command: "Config",
                msg: e.to_string(),
            })?,
            Message::Accept
            | Message::Ready
            | Message::Go
            | Message::Heartbeat
            | Message::Commit
            | Message::Committed => Vec::new(),
            Message::Memory(b) => encode_batch(b)?,
            Message::State(image) => image.clone(),
            Message::Abandon(why) => why.as_bytes().to_vec(),
            Message::Protect(t) => t.encode(),
            Message::Checkpoint { epoch } => epoch.to_le_bytes().to_vec(),
            Message::Dirty(spans) => colo::encode_spans(spans),
            Message::Disks(sums) => colo::encode_sums(sums),
            Message::DiskWrite(w) => w.encode(),
            Message::Streams(s) => s.encode(),
            Message::Join(j) => j.encode(),
            Message::Postcopy(spans) => colo::encode_spans(spans),
            Message::PageRequest(gpa) => postcopy::encode_request(*gpa),
            Message::Done(s) => s.encode(),
        })
    }
}

fn encode_batch(b: &MemoryBatch) -> Result<Vec<u8>> {
    let malformed = |msg: String| ProtocolError::Malformed {
        command: "Memory",
        msg,
    };
    let data_bytes: u64 = b.ranges.iter().filter(|r| !r.zero).map(|r| r.bytes()).sum();
    if b.ranges.len() > BATCH_RANGES || data_bytes != b.data.len() as u64 {
        return Err(malformed(format!(
            "{} ranges, {} data bytes for {} declared",
            b.ranges.len(),
            b.data.len(),
            data_bytes
        )));
    }
    let mut p = Vec::with_capacity(4 + RANGE_ENTRY * b.ranges.len() + b.data.len());
    p.extend_from_slice(&(b.ranges.len() as u32).to_le_bytes());
    for r in &b.ranges {
        p.extend_from_slice(&r.gpa.to_le_bytes());
        p.extend_from_slice(&r.pages.to_le_bytes());
        p.push(u8::from(r.zero));
    }
    p.extend_from_slice(&b.data);
    Ok(p)
}

fn decode_batch(p: &[u8]) -> Result<MemoryBatch> {
    let malformed = |msg: String| ProtocolError::Malformed {
        command: "Memory",
        msg,
    };
    let (count, rest) = p
        .split_first_chunk::<4>()
        .ok_or_else(|| malformed("no range count".into()))?;
    let count = u32::from_le_bytes(*count) as usize;
    if count > BATCH_RANGES {
        return Err(malformed(format!(
            "{count} ranges (at most {BATCH_RANGES})"
        )));
    }
    let table_len = count * RANGE_ENTRY;
    if rest.len() < table_len {
        return Err(malformed(format!("{count} ranges in {} bytes", rest.len())));
    }
    let (table, data) = rest.split_at(table_len);
    let mut ranges = Vec::with_capacity(count);
    let mut data_bytes = 0u64;
    for e in table.chunks_exact(RANGE_ENTRY) {
        let gpa = u64::from_le_bytes(e[..8].try_into().unwrap_or_default());
        let pages = u32::from_le_bytes(e[8..12].try_into().unwrap_or_default());
        let zero = match e[12] {
            0 => false,
            1 => true,
            k => return Err(malformed(format!("range kind {k}"))),
        };
        if pages == 0 {
            return Err(malformed(format!("an empty range at {gpa:#x}")));
        }
        let r = PageRange { gpa, pages, zero };
        if !zero {
            data_bytes += r.bytes();
        }
        ranges.push(r);
    }
    if data_bytes != data.len() as u64 {
        return Err(malformed(format!(
            "{} data bytes, the table declares {data_bytes}",
            data.len()
        )));
    }
    Ok(MemoryBatch {
        ranges,
        data: data.to_vec(),
    })
}

fn decode(command: Command, p: Vec<u8>) -> Result<Message> {
    let empty = |m: Message| {
        if p.is_empty() {
            Ok(m)
        } else {
            Err(ProtocolError::Malformed {
                command: command.name(),
                msg: format!("{} unexpected bytes", p.len()),
            })
        }
    };
    match command {
        Command::Hello => {
            let magic = p.get(..8).ok_or(ProtocolError::Foreign)?;
            if magic != MAGIC {
                return Err(ProtocolError::Foreign);
            }
            let version = p
                .get(8..)
                .and_then(|v| <[u8; 4]>::try_from(v).ok())
                .ok_or_else(|| ProtocolError::Malformed {
                    command: "Hello",
                    msg: format!("{} bytes", p.len()),
                })?;
            Ok(Message::Hello {
                version: u32::from_le_bytes(version),
            })
        }
        Command::Config => serde_json::from_slice(&p)
            .map(Message::Config)
            .map_err(|e| ProtocolError::Malformed {
                command: "Config",
                msg: e.to_string(),
            }),
        Command::Accept => empty(Message::Accept),
        Command::Ready => empty(Message::Ready),
        Command::Go => empty(Message::Go),
        Command::Memory => decode_batch(&p).map(Message::Memory),
        Command::State => Ok(Message::State(p)),
        Command::Abandon => Ok(Message::Abandon(
            String::from_utf8_lossy(&p).chars().take(1000).collect(),
        )),
        Command::Heartbeat => empty(Message::Heartbeat),
        Command::Commit => empty(Message::Commit),
        Command::Committed => empty(Message::Committed),
        Command::Protect => colo::Timing::decode(&p).map(Message::Protect),
        Command::Checkpoint => <[u8; 8]>::try_from(p.as_slice())
            .map(|b| Message::Checkpoint {
                epoch: u64::from_le_bytes(b),
            })
            .map_err(|_| ProtocolError::Malformed {
                command: "Checkpoint",
                msg: format!("{} bytes", p.len()),
            }),
        Command::Dirty => colo::decode_spans("Dirty", &p).map(Message::Dirty),
        Command::Postcopy => colo::decode_spans("Postcopy", &p).map(Message::Postcopy),
        Command::PageRequest => postcopy::decode_request(&p).map(Message::PageRequest),
        Command::Done => postcopy::Stalls::decode(&p).map(Message::Done),
        Command::Disks => colo::decode_sums(&p).map(Message::Disks),
        Command::DiskWrite => colo::DiskWrite::decode(p).map(Message::DiskWrite),
        Command::Streams => streams::Streams::decode(&p).map(Message::Streams),
        Command::Join => streams::Join::decode(&p).map(Message::Join),
    }
}

/// Writes one framed message.
pub fn write_message<W: Write>(w: &mut W, m: &Message) -> Result<()> {
    let payload = m.payload()?;
    if payload.len() > MAX_PAYLOAD {
        return Err(ProtocolError::Oversized(payload.len() as u64));
    }
    let command = m.command() as u8;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&[command]);
    crc.update(&payload);
    let mut head = [0u8; 5];
    head[..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    head[4] = command;
    w.write_all(&head)?;
    w.write_all(&payload)?;
    w.write_all(&crc.finalize().to_le_bytes())?;
    w.flush()?;
    Ok(())
}

/// Reads one framed message: its length is checked before its payload is
/// allocated, its checksum before it is decoded.
pub fn read_message<R: Read>(r: &mut R) -> Result<Message> {
    let mut head = [0u8; 5];
    r.read_exact(&mut head)?;
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    if len as usize > MAX_PAYLOAD {
        return Err(ProtocolError::Oversized(u64::from(len)));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload)?;
    let mut sum = [0u8; 4];
    r.read_exact(&mut sum)?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&head[4..]);
    crc.update(&payload);
    if crc.finalize() != u32::from_le_bytes(sum) {
        return Err(ProtocolError::Checksum { command: head[4] });
    }
    decode(Command::from_u8(head[4])?, payload)
}

/// Reads the next message and takes it only if it is `expected`; an
/// `Abandon` becomes [`ProtocolError::Abandoned`].
pub fn expect<R: Read>(r: &mut R, expected: Command) -> Result<Message> {
    let m = read_message(r)?;
    match m {
        Message::Abandon(why) if expected != Command::Abandon => Err(ProtocolError::Abandoned(why)),
        m if m.command() == expected => Ok(m),
        m => Err(ProtocolError::Unexpected {
            expected: expected.name(),
            got: m.command().name(),
        }),
    }
}

/// Checks a `Hello`: a tandem stream of this version.
pub fn check_hello(m: &Message) -> Result<()> {
    match m {
        Message::Hello { version } if *version == VERSION => Ok(()),
        Message::Hello { version } => Err(ProtocolError::Version { theirs: *version }),
        other => Err(ProtocolError::Unexpected {
            expected: "Hello",
            got: other.command().name(),
        }),
    }
}

#[cfg(test)]
mod tests;

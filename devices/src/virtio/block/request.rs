//! One virtio-blk request: parsed from a descriptor chain and executed
//! against a [`DiskBackend`]. Pure logic over guest memory and a backend,
//! unit tested over mock guest memory; every chain is hostile input.
//!
//! A request is a byte stream (virtio 1.2, 5.2.6): the device-readable part
//! starts with a 16-byte header (type, reserved, sector), followed by the
//! data of a write (or the segments of a discard / write-zeroes); the
//! device-writable part holds the data of a read (or the id), and ends with
//! the status byte. Framing is free: any part may be split across
//! descriptors. A chain that breaks the shape (no header, no status byte,
//! readable after writable, data in the wrong direction, a buffer outside
//! guest memory, a chain that never ends) is *malformed*: it is rejected
//! without touching the disk and, if its last descriptor can hold a status
//! byte, answered with IOERR. A well-formed request the device cannot serve
//! (out of range, read-only disk, bad length) completes with IOERR; an
//! unknown type, or a feature the driver did not negotiate, with UNSUPP.

use crate::GuestMemoryMmap;
use virtio_queue::DescriptorChain;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use super::backend::DiskBackend;
use super::disk::{ID_BYTES, SECTOR_SIZE};
use super::features;

/// Request types.
pub mod kind {
    pub const IN: u32 = 0;
    pub const OUT: u32 = 1;
    pub const FLUSH: u32 = 4;
    pub const GET_ID: u32 = 8;
    pub const DISCARD: u32 = 11;
    pub const WRITE_ZEROES: u32 = 13;
}

/// Status byte values.
pub mod status {
    pub const OK: u8 = 0;
    pub const IOERR: u8 = 1;
    pub const UNSUPP: u8 = 2;
}

/// Size of the request header.
pub const HEADER_LEN: u64 = 16;
/// Size of one discard / write-zeroes segment.
const SEGMENT_LEN: u64 = 16;
/// `flags` bit of a write-zeroes segment: the range may be deallocated.
const FLAG_UNMAP: u32 = 1;
/// Most segments in one discard or write-zeroes request (config space).
pub const MAX_SEGMENTS: u32 = 32;
/// Most sectors in one discard or write-zeroes segment (config space).
pub const MAX_RANGE_SECTORS: u32 = 1 << 22;

/// Why a chain was rejected as malformed.
#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone, Copy)]
pub enum ChainError {
    #[error("chain shorter than the 16-byte request header")]
    ShortHeader,
    #[error("no device-writable status byte at the end of the chain")]
    NoStatus,
    #[error("descriptor with the wrong direction")]
    WrongDirection,
    #[error("descriptor outside guest memory")]
    Memory,
    #[error("chain does not end (a loop, or a next index past the table)")]
    Unterminated,
}

/// A rejected chain, and where its status byte is if it has one.
#[derive(Debug, PartialEq, Eq)]
pub struct Rejected {
    pub error: ChainError,
    pub status: Option<GuestAddress>,
}

/// Buffers in chain order, seen as one stream.
#[derive(Debug, Default)]
struct Stream {
    parts: Vec<(GuestAddress, u32)>,
    len: u64,
}

impl Stream {
    fn push(&mut self, addr: GuestAddress, len: u32) {
        if len > 0 {
            self.parts.push((addr, len));
            self.len += u64::from(len);
        }
    }

    /// Calls `f` on each piece of the stream's bytes `[start, start + len)`.
    fn for_each<E>(
        &self,
        start: u64,
        len: u64,
        mut f: impl FnMut(GuestAddress, usize) -> Result<(), E>,
    ) -> Result<(), E> {
        let end = start + len;
        let mut pos = 0u64;
        for &(addr, plen) in &self.parts {
            let (lo, hi) = (pos, pos + u64::from(plen));
            pos = hi;
            if hi <= start {
                continue;
            }
            if lo >= end {
                break;
            }
            let from = start.max(lo);
            let to = end.min(hi);
            f(addr.unchecked_add(from - lo), (to - from) as usize)?;
        }
        Ok(())
    }

    /// Copies the stream's bytes from `start` into `buf`.
    fn read(&self, mem: &GuestMemoryMmap, start: u64, buf: &mut [u8]) -> Result<(), ()> {
        let mut at = 0usize;
        self.for_each(start, buf.len() as u64, |addr, n| {
            mem.read_slice(&mut buf[at..at + n], addr).map_err(|_| ())?;
            at += n;
            Ok(())
        })
    }

    /// Copies `bytes` into the stream from its start.
    fn write(&self, mem: &GuestMemoryMmap, bytes: &[u8]) -> Result<(), ()> {
        let mut at = 0usize;
        self.for_each(0, bytes.len() as u64, |addr, n| {
            mem.write_slice(&bytes[at..at + n], addr).map_err(|_| ())?;
            at += n;
            Ok(())
        })
    }
}

/// A well-formed request.
#[derive(Debug)]
pub struct Request {
    pub kind: u32,
    pub sector: u64,
    readable: Stream,
    writable: Stream,
    status: GuestAddress,
}

impl Request {
    /// Parses a chain. Nothing is read from or written to the disk here.
    pub fn parse(
        chain: DescriptorChain<&GuestMemoryMmap>,
        mem: &GuestMemoryMmap,
    ) -> Result<Request, Rejected> {
        let descs: Vec<_> = chain.collect();
        let Some(last) = descs.last() else {
            return Err(Rejected {
                error: ChainError::ShortHeader,
                status: None,
            });
        };
        let status = (last.is_write_only() && last.len() > 0)
            .then(|| last.addr().checked_add(u64::from(last.len()) - 1))
            .flatten()
            .filter(|&a| mem.check_range(a, 1));
        if last.has_next() {
            // The chain was cut short: its last descriptor is not the status.
            return Err(Rejected {
                error: ChainError::Unterminated,
                status: None,
            });
        }
        let reject = |error| Err(Rejected { error, status });
        let mut readable = Stream::default();
        let mut writable = Stream::default();
        for d in &descs {
            if !mem.check_range(d.addr(), d.len() as usize) {
                return reject(ChainError::Memory);
            }
            if d.is_write_only() {
                writable.push(d.addr(), d.len());
            } else if writable.len > 0 {
                return reject(ChainError::WrongDirection);
            } else {
                readable.push(d.addr(), d.len());
            }
        }
        if readable.len < HEADER_LEN {
            return reject(ChainError::ShortHeader);
        }
        let Some(status_addr) = status else {
            return reject(ChainError::NoStatus);
        };
        let mut hdr = [0u8; HEADER_LEN as usize];
        if readable.read(mem, 0, &mut hdr).is_err() {
            return reject(ChainError::Memory);
        }
        let kind = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
        let mut s = [0u8; 8];
        s.copy_from_slice(&hdr[8..16]);
        let sector = u64::from_le_bytes(s);
        // Data must flow the way the type says.
        let wrong = match kind {
            kind::IN | kind::GET_ID => readable.len != HEADER_LEN,
            kind::OUT | kind::DISCARD | kind::WRITE_ZEROES => writable.len != 1,
            _ => false,
        };
        if wrong {
            return reject(ChainError::WrongDirection);
        }
        Ok(Request {
            kind,
            sector,
            readable,
            writable,
            status: status_addr,
        })
    }

    /// Bytes of data the request carries (read, written, or segments).
    pub fn data_len(&self) -> u64 {
        match self.kind {
            kind::IN | kind::GET_ID => self.writable.len - 1,
            _ => self.readable.len - HEADER_LEN,
        }
    }
}

/// What a completed request was, for the counters.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub enum Outcome {
    Read(u64),
    Written(u64),
    Flushed,
    Id,
    Discarded,
    Zeroed,
    /// Completed with IOERR.
    IoError,
    /// Completed with UNSUPP.
    Unsupported,
}

/// A completion: the status byte written and the used length to report.
#[derive(Debug, PartialEq, Eq)]
pub struct Completion {
    pub outcome: Outcome,
    pub status: u8,
    pub used_len: u32,
}

/// Executes `req` (with the driver's `acked` features) and writes its
/// status byte. The status byte was range-checked when parsing.
pub fn execute(
    req: &Request,
    mem: &GuestMemoryMmap,
    disk: &dyn DiskBackend,
    acked: u64,
    id: &[u8; ID_BYTES],
) -> Completion {
    let (outcome, data_written) = run(req, mem, disk, acked, id);
    let status = match outcome {
        Outcome::IoError => status::IOERR,
        Outcome::Unsupported => status::UNSUPP,
        _ => status::OK,
    };
    // Cannot fail (checked at parse time); if it did, the driver sees len 0.
    let used_len = match mem.write_obj(status, req.status) {
        Ok(()) => u32::try_from(data_written + 1).unwrap_or(u32::MAX),
        Err(_) => 0,
    };
    Completion {
        outcome,
        status,
        used_len,
    }
}

/// The byte range `[sector * 512, + len)` if it lies within the disk.
fn byte_range(disk: &dyn DiskBackend, sector: u64, len: u64) -> Option<u64> {
    let start = sector.checked_mul(SECTOR_SIZE)?;
    let end = start.checked_add(len)?;
    (end <= disk.size()).then_some(start)
}

fn run(
    req: &Request,
    mem: &GuestMemoryMmap,
    disk: &dyn DiskBackend,
    acked: u64,
    id: &[u8; ID_BYTES],
) -> (Outcome, u64) {
    let len = req.data_len();
    match req.kind {
        kind::IN | kind::OUT => {
            if !len.is_multiple_of(SECTOR_SIZE) {
                return (Outcome::IoError, 0);
            }
            if req.kind == kind::OUT && disk.readonly() {
                return (Outcome::IoError, 0);
            }
            let Some(mut offset) = byte_range(disk, req.sector, len) else {
                return (Outcome::IoError, 0);
            };
            let (stream, start) = if req.kind == kind::IN {
                (&req.writable, 0)
            } else {
                (&req.readable, HEADER_LEN)
            };
            let mut done = 0u64;
            let r = stream.for_each(start, len, |addr, n| {
                if req.kind == kind::IN {
                    disk.read_to_guest(mem, addr, n, offset)?;
                } else {
                    disk.write_from_guest(mem, addr, n, offset)?;
                }
                offset += n as u64;
                done += n as u64;
                Ok::<(), std::io::Error>(())
            });
            let written = if req.kind == kind::IN { done } else { 0 };
            match r {
                Ok(()) if req.kind == kind::IN => (Outcome::Read(len), written),
                Ok(()) => (Outcome::Written(len), 0),
                Err(e) => {
                    log::debug!(
                        "virtio-blk {}: I/O error at sector {}: {e}",
                        disk.name(),
                        req.sector
                    );
                    (Outcome::IoError, written)
                }
            }
        }
        kind::FLUSH => {
            if disk.readonly() {
                return (Outcome::Flushed, 0);
            }
            match disk.flush() {
                Ok(()) => (Outcome::Flushed, 0),
                Err(e) => {
                    log::warn!("virtio-blk {}: flush: {e}", disk.name());
                    (Outcome::IoError, 0)
                }
            }
        }
        kind::GET_ID => {
            let n = len.min(ID_BYTES as u64) as usize;
            match req.writable.write(mem, &id[..n]) {
                Ok(()) => (Outcome::Id, n as u64),
                Err(()) => (Outcome::IoError, 0),
            }
        }
        kind::DISCARD if acked & features::DISCARD != 0 => (ranges(req, mem, disk, false), 0),
        kind::WRITE_ZEROES if acked & features::WRITE_ZEROES != 0 => {
            (ranges(req, mem, disk, true), 0)
        }
        _ => (Outcome::Unsupported, 0),
    }
}

/// Discard (`zero` false) or write-zeroes (`zero` true) over the request's
/// segments. All segments are checked before any is executed.
fn ranges(req: &Request, mem: &GuestMemoryMmap, disk: &dyn DiskBackend, zero: bool) -> Outcome {
    let len = req.data_len();
    if disk.readonly()
        || len == 0
        || !len.is_multiple_of(SEGMENT_LEN)
        || len / SEGMENT_LEN > u64::from(MAX_SEGMENTS)
    {
        return Outcome::IoError;
    }
    let mut raw = vec![0u8; len as usize];
    if req.readable.read(mem, HEADER_LEN, &mut raw).is_err() {
        return Outcome::IoError;
    }
    let mut todo = Vec::with_capacity(raw.len() / SEGMENT_LEN as usize);
    for seg in raw.chunks_exact(SEGMENT_LEN as usize) {
        let mut s = [0u8; 8];
        s.copy_from_slice(&seg[..8]);
        let sector = u64::from_le_bytes(s);
        let count = u32::from_le_bytes([seg[8], seg[9], seg[10], seg[11]]);
        let flags = u32::from_le_bytes([seg[12], seg[13], seg[14], seg[15]]);
        // Unknown flags, and unmap on a discard, are unsupported (5.2.6.2).
        if flags & !FLAG_UNMAP != 0 || (!zero && flags != 0) {
            return Outcome::Unsupported;
        }
        if count > MAX_RANGE_SECTORS {
            return Outcome::IoError;
        }
        let bytes = u64::from(count) * SECTOR_SIZE;
        let Some(offset) = byte_range(disk, sector, bytes) else {
            return Outcome::IoError;
        };
        todo.push((offset, bytes, flags & FLAG_UNMAP != 0));
    }
    for (offset, bytes, unmap) in todo {
        let r = if zero {
            disk.write_zeroes(offset, bytes, unmap)
        } else {
            disk.discard(offset, bytes)
        };
        if let Err(e) = r {
            log::warn!(
                "virtio-blk {}: {}: {e}",
                disk.name(),
                if zero { "write zeroes" } else { "discard" }
            );
            return Outcome::IoError;
        }
    }
    if zero {
        Outcome::Zeroed
    } else {
        Outcome::Discarded
    }
}

#[cfg(test)]
mod tests;

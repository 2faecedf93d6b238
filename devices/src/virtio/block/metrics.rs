//! Per-disk counters: updated lock-free on the VMM thread, read by anyone.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use super::request::Outcome;

/// The counters of one virtio-blk device.
#[derive(Default, Debug)]
pub struct BlockMetrics {
    /// Read requests completed OK, and their bytes.
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    /// Write requests completed OK, and their bytes.
    pub writes: AtomicU64,
    pub write_bytes: AtomicU64,
    /// Flushes completed OK (each an `fdatasync` of a writable image).
    pub flushes: AtomicU64,
    /// Device id requests answered.
    pub get_ids: AtomicU64,
    /// Discard and write-zeroes requests completed OK.
    pub discards: AtomicU64,
    pub write_zeroes: AtomicU64,
    /// Requests completed with IOERR: out of range, a write to a read-only
    /// disk, a bad length, or a host I/O error.
    pub io_errors: AtomicU64,
    /// Requests completed with UNSUPP: unknown type, feature not negotiated.
    pub unsupported: AtomicU64,
    /// Descriptor chains rejected as malformed (never executed).
    pub malformed_chains: AtomicU64,
    /// Guest accesses to the transport or config space that were wrong.
    pub bad_register_accesses: AtomicU64,
}

/// A point-in-time copy, for JSON.
#[derive(Debug, Serialize, PartialEq, Eq, Default)]
pub struct BlockCounters {
    pub reads: u64,
    pub read_bytes: u64,
    pub writes: u64,
    pub write_bytes: u64,
    pub flushes: u64,
    pub get_ids: u64,
    pub discards: u64,
    pub write_zeroes: u64,
    pub io_errors: u64,
    pub unsupported: u64,
    pub malformed_chains: u64,
    pub bad_register_accesses: u64,
}

impl BlockMetrics {
    /// Adds `n` to `c`.
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts a completed request.
    pub fn record(&self, outcome: Outcome) {
        match outcome {
            Outcome::Read(n) => {
                Self::add(&self.reads, 1);
                Self::add(&self.read_bytes, n);
            }
            Outcome::Written(n) => {
                Self::add(&self.writes, 1);
                Self::add(&self.write_bytes, n);
            }
            Outcome::Flushed => Self::add(&self.flushes, 1),
            Outcome::Id => Self::add(&self.get_ids, 1),
            Outcome::Discarded => Self::add(&self.discards, 1),
            Outcome::Zeroed => Self::add(&self.write_zeroes, 1),
            Outcome::IoError => Self::add(&self.io_errors, 1),
            Outcome::Unsupported => Self::add(&self.unsupported, 1),
        }
    }

    /// The current values.
    pub fn snapshot(&self) -> BlockCounters {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        BlockCounters {
            reads: g(&self.reads),
            read_bytes: g(&self.read_bytes),
            writes: g(&self.writes),
            write_bytes: g(&self.write_bytes),
            flushes: g(&self.flushes),
            get_ids: g(&self.get_ids),
            discards: g(&self.discards),
            write_zeroes: g(&self.write_zeroes),
            io_errors: g(&self.io_errors),
            unsupported: g(&self.unsupported),
            malformed_chains: g(&self.malformed_chains),
            bad_register_accesses: g(&self.bad_register_accesses),
        }
    }
}

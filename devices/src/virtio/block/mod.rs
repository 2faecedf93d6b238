//! virtio-blk on a raw image (a regular file or a host block device).
//!
//! - `backend`: the seam to the storage ([`DiskBackend`]): reads into and
//!   writes from guest memory, flush, discard, write-zeroes, size.
//! - `disk`: the backend on a raw image: open and lock it, positioned I/O
//!   between the file and guest memory, flush, discard, write-zeroes.
//! - `request`: pure request logic (descriptor chain in, status out),
//!   unit-tested over mock guest memory; every chain is guest-controlled.
//! - `device`: the virtio device (features, configuration space, activation).
//! - `handler`: event-loop glue on the VMM thread: the queue notification.
//! - `metrics`: lock-free counters.
//! - `tracked`: a backend wrapper noting the ranges the guest changed (a
//!   COLO primary's disks, whose writes are forwarded).
//!
//! I/O is synchronous on the VMM thread: a request is complete, and its data
//! in the host file (or, after a flush, on its storage), before it is
//! returned to the guest.

pub mod backend;
pub mod device;
pub mod disk;
pub mod handler;
pub mod metrics;
pub mod request;
pub mod tracked;

pub use backend::DiskBackend;
pub use device::{Block, BlockConfig};

/// virtio-blk feature bits (virtio 1.2, 5.2.3).
pub mod features {
    pub const SEG_MAX: u64 = 1 << 2;
    pub const RO: u64 = 1 << 5;
    pub const FLUSH: u64 = 1 << 9;
    pub const DISCARD: u64 = 1 << 13;
    pub const WRITE_ZEROES: u64 = 1 << 14;
}

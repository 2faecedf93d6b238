//! virtio-net on a tap device (or another backend).
//!
//! - `backend`: the seam to the host side ([`NetBackend`]): frames with a
//!   virtio-net header in and out, readiness descriptors, offloads.
//! - `tap`: the backend on the host's network (non-blocking, virtio-net
//!   header on every frame).
//! - `tx`, `rx`: pure queue logic (descriptor chains in, frames out and back),
//!   unit-tested over mock guest memory; every chain is guest-controlled.
//! - `device`: the virtio device (features, config space, activation).
//! - `handler`: event-loop glue on the VMM thread: queue notifications and
//!   backend readiness, with flow control both ways; swaps the backend of a
//!   running device.
//! - `rx_pump`: the receive path's flow control, from backend reads through the
//!   RSC engine (when on) to the guest, pure logic.
//! - `metrics`: lock-free counters.
//! - `rsc`: receive segment coalescing, pure logic: merges in-order TCP
//!   segments read from the backend into GSO frames for the guest (design §4).

pub mod announce;
pub mod backend;
pub mod datagram;
pub mod detached;
pub mod device;
pub mod handler;
pub mod metrics;
pub mod rsc;
pub mod rx;
pub mod rx_pump;
pub mod tap;
pub mod tx;

pub use backend::NetBackend;
pub use device::{Net, NetConfig};

/// Feature bits (virtio 1.2, 5.1.3).
pub mod features {
    pub const CSUM: u64 = 1 << 0;
    pub const GUEST_CSUM: u64 = 1 << 1;
    pub const MAC: u64 = 1 << 5;
    pub const GUEST_TSO4: u64 = 1 << 7;
    pub const GUEST_TSO6: u64 = 1 << 8;
    pub const HOST_TSO4: u64 = 1 << 11;
    pub const HOST_TSO6: u64 = 1 << 12;
    pub const MRG_RXBUF: u64 = 1 << 15;
    pub const STATUS: u64 = 1 << 16;
    /// Extended RSC info (coalesced segment and duplicate-ACK counts).
    pub const RSC_EXT: u64 = 1 << 61;
}

/// Why a descriptor chain was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChainError {
    #[error("chain shorter than the virtio-net header")]
    TooShort,
    #[error("chain longer than the largest frame")]
    TooLong,
    #[error("descriptor with the wrong direction")]
    WrongDirection,
    #[error("descriptor outside guest memory")]
    Memory,
    #[error("receive buffer too small for the frame")]
    BufferTooSmall,
}

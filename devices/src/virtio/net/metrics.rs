//! Per-device counters: updated lock-free on the VMM thread, read by anyone.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// The counters of one virtio-net device.
#[derive(Default, Debug)]
pub struct NetMetrics {
    pub rx_packets: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub tx_packets: AtomicU64,
    pub tx_bytes: AtomicU64,
    /// Times a tap write would have blocked: TX paused until writable.
    pub tap_full_waits: AtomicU64,
    /// Times a frame waited for the guest to post receive buffers.
    pub no_rx_buffer_waits: AtomicU64,
    /// Descriptor chains rejected as malformed (counted, never processed).
    pub malformed_chains: AtomicU64,
    /// Frames lost inside the VMM (tap write errors other than "full",
    /// frames larger than the guest's buffers). Flow control keeps it 0.
    pub drops: AtomicU64,
    /// Guest accesses to the transport that were wrong and ignored.
    pub bad_register_accesses: AtomicU64,
    /// Most frames held at once for a guest without RX buffers (a maximum,
    /// not a sum): 1 without RSC, bounded by `rx_pump::MAX_HELD` with it.
    pub rx_held_max: AtomicU64,
}

/// A point-in-time copy, for JSON.
#[derive(Debug, Serialize, PartialEq, Eq, Default)]
pub struct NetCounters {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub tap_full_waits: u64,
    pub no_rx_buffer_waits: u64,
    pub malformed_chains: u64,
    pub drops: u64,
    pub bad_register_accesses: u64,
    pub rx_held_max: u64,
}

impl NetMetrics {
    /// Adds `n` to `c`.
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// Raises `c` to `n` if it is lower.
    pub fn max(c: &AtomicU64, n: u64) {
        c.fetch_max(n, Ordering::Relaxed);
    }

    /// The current values.
    pub fn snapshot(&self) -> NetCounters {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        NetCounters {
            rx_packets: g(&self.rx_packets),
            rx_bytes: g(&self.rx_bytes),
            tx_packets: g(&self.tx_packets),
            tx_bytes: g(&self.tx_bytes),
            tap_full_waits: g(&self.tap_full_waits),
            no_rx_buffer_waits: g(&self.no_rx_buffer_waits),
            malformed_chains: g(&self.malformed_chains),
            drops: g(&self.drops),
            bad_register_accesses: g(&self.bad_register_accesses),
            rx_held_max: g(&self.rx_held_max),
        }
    }
}

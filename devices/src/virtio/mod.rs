//! Virtio devices and their transports: virtio-mmio (version 2) and
//! virtio-pci (modern, with MSI-X).
//!
//! `transport` owns what a driver programs whatever the transport
//! (features, queues, status); `mmio` and `pci` decode their registers
//! into it; `interrupt` tells the guest. A device implements
//! [`VirtioDevice`] and only sees negotiated features and ready queues
//! when the driver sets DRIVER_OK.

pub mod block;
pub mod drain;
pub mod interrupt;
pub mod mmio;
pub mod net;
pub mod pci;
#[cfg(test)]
pub(crate) mod test_device;
#[cfg(test)]
pub(crate) mod test_util;
pub mod transport;

use std::io;

use crate::GuestMemoryMmap;
use virtio_queue::Queue;

/// Feature bit: the device conforms to virtio 1.x (required by mmio v2).
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// Feature bit: used/avail event index suppression.
pub const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;

/// Device status bits (virtio 1.2, 2.1).
pub mod status {
    pub const ACKNOWLEDGE: u32 = 1;
    pub const DRIVER: u32 = 2;
    pub const DRIVER_OK: u32 = 4;
    pub const FEATURES_OK: u32 = 8;
    pub const DEVICE_NEEDS_RESET: u32 = 64;
    pub const FAILED: u32 = 128;
}

/// Interrupt status bits.
pub const INT_USED_RING: u32 = 1;
/// The device configuration changed.
pub const INT_CONFIG: u32 = 2;

/// Why a device could not start.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("queue {0} is not valid in guest memory")]
    BadQueue(usize),
    #[error("the device needs {wanted} queues, {got} given")]
    QueueCount { wanted: usize, got: usize },
    #[error("cannot set the offloads of network backend {backend}: {source}")]
    Offloads { backend: String, source: io::Error },
    #[error("cannot wake the device's handler: {0}")]
    Notify(#[source] io::Error),
}

impl ActivateError {
    /// `Ok` when the driver set up exactly the `wanted` queues a device has.
    pub fn check_queue_count(queues: &[Queue], wanted: usize) -> Result<(), ActivateError> {
        if queues.len() == wanted {
            Ok(())
        } else {
            Err(ActivateError::QueueCount {
                wanted,
                got: queues.len(),
            })
        }
    }
}

/// A virtio device behind a transport.
pub trait VirtioDevice: Send {
    /// The virtio device id (1 = net, 2 = block).
    fn device_type(&self) -> u32;
    /// The largest size of each queue; the number of queues is its length.
    fn queue_max_sizes(&self) -> &[u16];
    /// Features offered to the driver.
    fn features(&self) -> u64;
    /// A driver read of the device configuration space.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// A driver write to the device configuration space.
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// Starts the device with the features the driver accepted and its queues.
    fn activate(
        &mut self,
        acked_features: u64,
        queues: Vec<Queue>,
        mem: GuestMemoryMmap,
    ) -> Result<(), ActivateError>;
    /// Stops the device and forgets its queues (driver reset).
    fn reset(&mut self);
    /// The live state of the queues (where the device has got to in each
    /// ring), in index order, while the device is active; `None` otherwise.
    fn queue_states(&self) -> Option<Vec<virtio_queue::QueueState>>;
}

/// Answers a driver read of `data.len()` bytes at `offset` from a device's
/// configuration space `config`; bytes past its end (or an offset that does
/// not fit a `usize`) read as zero. Every device's `read_config` is this.
pub fn read_config_space(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(i))
            .and_then(|o| config.get(o).copied())
            .unwrap_or(0);
    }
}

//! The virtio-mmio transport, version 2 (virtio 1.2, section 4.2.2).
//!
//! One 4 KiB window per device: registers below 0x100, the device's
//! configuration space above. This module only decodes the window: what the
//! registers mean (features, queues, status, the device's start) is the
//! shared [`Transport`]'s. A wrong width or an unknown offset is counted
//! and ignored, never a panic. Queue notifications normally never reach
//! this code: the VMM registers each queue's eventfd as a KVM ioeventfd on
//! the notify register; a notify that does arrive here is forwarded to the
//! same eventfd. Runs on the vCPU thread of the access.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::GuestMemoryMmap;
use migration::devices::MmioTransportState;
use migration::Snapshottable;
use virtio_queue::QueueT;
use vmm_sys_util::eventfd::EventFd;

use super::transport::{QueueReg, Transport};
use super::VirtioDevice;
use crate::bus::BusDevice;

pub use super::interrupt::Interrupt;
pub use super::transport::TransportStateError;

#[cfg(test)]
mod state_tests;
#[cfg(test)]
mod tests;

/// Size of one device's window.
pub const MMIO_WINDOW: u64 = 0x1000;
/// Offset of the queue notify register (for ioeventfd registration).
pub const NOTIFY_OFFSET: u64 = 0x50;

const MAGIC: u32 = 0x7472_6976; // "virt"
const VERSION: u32 = 2;
const VENDOR_ID: u32 = 0x4d44_4e54; // "TNDM"
const CONFIG_START: u64 = 0x100;

/// The transport of one device.
pub struct MmioTransport {
    pub(crate) core: Transport,
}

impl MmioTransport {
    /// Wraps `device`; `queue_evts` (one per queue) are what a queue notify
    /// signals; `interrupt` is shared with the device.
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
        queue_evts: Vec<EventFd>,
    ) -> Result<Self, virtio_queue::Error> {
        Ok(MmioTransport {
            core: Transport::new("virtio-mmio", device, mem, interrupt, queue_evts)?,
        })
    }

    /// Accesses the guest got wrong so far (shared counter, for metrics).
    pub fn bad_accesses(&self) -> Arc<AtomicU64> {
        self.core.bad_accesses()
    }

    /// The device status register.
    pub fn status(&self) -> u32 {
        self.core.status()
    }

    /// Checks a saved state against this device without applying it (see
    /// [`Transport::check_state`]).
    pub fn check_state(&self, s: &MmioTransportState) -> Result<(), TransportStateError> {
        self.core.check_state(s)
    }

    fn read_register(&mut self, offset: u64) -> Option<u32> {
        let c = &self.core;
        Some(match offset {
            0x000 => MAGIC,
            0x004 => VERSION,
            0x008 => c.device_type(),
            0x00c => VENDOR_ID,
            0x010 => c.device_features(),
            0x034 => c.selected_queue().map_or(0, |q| u32::from(q.max_size())),
            0x044 => c.selected_queue().map_or(0, |q| u32::from(q.ready())),
            0x060 => c.interrupt.status(),
            0x070 => c.status,
            0x0fc => c.config_generation,
            _ => return None,
        })
    }

    fn write_register(&mut self, offset: u64, v: u32) {
        let c = &mut self.core;
        let queue_reg = match offset {
            0x038 => Some(QueueReg::Size),
            0x044 => Some(QueueReg::Ready),
            0x080 => Some(QueueReg::DescLo),
            0x084 => Some(QueueReg::DescHi),
            0x090 => Some(QueueReg::AvailLo),
            0x094 => Some(QueueReg::AvailHi),
            0x0a0 => Some(QueueReg::UsedLo),
            0x0a4 => Some(QueueReg::UsedHi),
            _ => None,
        };
        if let Some(reg) = queue_reg {
            return c.set_queue(reg, v, offset);
        }
        match offset {
            0x014 => c.device_features_sel = v,
            0x020 => c.set_driver_features(v, offset),
            0x024 => c.driver_features_sel = v,
            0x030 => c.queue_sel = v,
            0x050 => c.notify(v, offset),
            0x064 => c.interrupt.ack(v),
            0x070 => c.write_status(v, offset),
            _ => c.bad("write to an unknown register", offset),
        }
    }
}

impl Snapshottable for MmioTransport {
    type State = MmioTransportState;
    type Error = TransportStateError;

    fn save(&self) -> Result<MmioTransportState, TransportStateError> {
        self.core.save()
    }

    fn restore(&mut self, s: &MmioTransportState) -> Result<(), TransportStateError> {
        self.core.restore(s)
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_START {
            return self.core.read_config(offset - CONFIG_START, data);
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            data.fill(0);
            return self.core.bad("register read not 32-bit aligned", offset);
        }
        match self.read_register(offset) {
            Some(v) => data.copy_from_slice(&v.to_le_bytes()),
            None => {
                data.fill(0);
                self.core.bad("read of an unknown register", offset);
            }
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_START {
            return self.core.write_config(offset - CONFIG_START, data);
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            return self.core.bad("register write not 32 bits", offset);
        };
        if !offset.is_multiple_of(4) {
            return self.core.bad("register write not aligned", offset);
        }
        self.write_register(offset, u32::from_le_bytes(bytes));
    }
}

//! The virtio-mmio transport, version 2 (virtio 1.2, section 4.2.2).
//!
//! One 4 KiB window per device: registers below 0x100, the device's
//! configuration space above. Every access comes from the guest and is
//! checked: a wrong width, an unknown offset, a write out of order (queue
//! set-up after DRIVER_OK, features the device never offered) is counted and
//! ignored, never a panic. The status register follows the rules in
//! [`lifecycle`]: the device is started on exactly the write that sets
//! DRIVER_OK after an accepted FEATURES_OK, and a start that fails (a queue
//! outside guest memory, a device that refuses) sets DEVICE_NEEDS_RESET and
//! leaves the device stopped. Queue notifications normally never reach this
//! code: the VMM registers each queue's eventfd as a KVM ioeventfd on the
//! notify register; a notify that does arrive here is forwarded to the same
//! eventfd.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::GuestMemoryMmap;
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::{status, ActivateError, VirtioDevice, INT_CONFIG, VIRTIO_F_VERSION_1};
use crate::bus::BusDevice;

mod lifecycle;
mod state;
#[cfg(test)]
mod tests;
pub use state::TransportStateError;

/// Size of one device's window.
pub const MMIO_WINDOW: u64 = 0x1000;
/// Offset of the queue notify register (for ioeventfd registration).
pub const NOTIFY_OFFSET: u64 = 0x50;

const MAGIC: u32 = 0x7472_6976; // "virt"
const VERSION: u32 = 2;
const VENDOR_ID: u32 = 0x4d44_4e54; // "TNDM"
const CONFIG_START: u64 = 0x100;

/// The device's interrupt: status bits the driver reads and acknowledges,
/// and the irqfd that raises the line.
pub struct Interrupt {
    status: AtomicU32,
    evt: EventFd,
}

impl Interrupt {
    /// An interrupt raised through `evt` (registered as a KVM irqfd).
    pub fn new(evt: EventFd) -> Self {
        Interrupt {
            status: AtomicU32::new(0),
            evt,
        }
    }

    /// Sets `bit` in the interrupt status and raises the line.
    pub fn trigger(&self, bit: u32) {
        self.status.fetch_or(bit, Ordering::SeqCst);
        if let Err(e) = self.evt.write(1) {
            log::warn!("virtio: cannot raise the interrupt: {e}");
        }
    }

    /// The current interrupt status bits.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// Puts back saved status bits; raises the line again if any is set
    /// (the driver had not acknowledged them).
    pub fn restore(&self, bits: u32) {
        self.status.store(bits, Ordering::SeqCst);
        if bits != 0 {
            if let Err(e) = self.evt.write(1) {
                log::warn!("virtio: cannot raise the interrupt: {e}");
            }
        }
    }

    fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }
}

/// The transport of one device.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryMmap,
    interrupt: Arc<Interrupt>,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    queue_sel: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    acked_features: u64,
    status: u32,
    config_generation: u32,
    bad_accesses: Arc<AtomicU64>,
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
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|&max| Queue::new(max))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MmioTransport {
            device,
            mem,
            interrupt,
            queues,
            queue_evts,
            queue_sel: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            acked_features: 0,
            status: 0,
            config_generation: 0,
            bad_accesses: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Accesses the guest got wrong so far (shared counter, for metrics).
    pub fn bad_accesses(&self) -> Arc<AtomicU64> {
        self.bad_accesses.clone()
    }

    /// The device status register.
    pub fn status(&self) -> u32 {
        self.status
    }

    fn bad(&self, what: &str, offset: u64) {
        self.bad_accesses.fetch_add(1, Ordering::Relaxed);
        log::debug!("virtio-mmio: {what} at {offset:#x}");
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    fn features_page(features: u64, sel: u32) -> u32 {
        match sel {
            0 => features as u32,
            1 => (features >> 32) as u32,
            _ => 0,
        }
    }

    fn offered(&self) -> u64 {
        self.device.features() | VIRTIO_F_VERSION_1
    }

    fn read_register(&mut self, offset: u64) -> Option<u32> {
        Some(match offset {
            0x000 => MAGIC,
            0x004 => VERSION,
            0x008 => self.device.device_type(),
            0x00c => VENDOR_ID,
            0x010 => Self::features_page(self.offered(), self.device_features_sel),
            0x034 => self.selected_queue().map_or(0, |q| u32::from(q.max_size())),
            0x044 => self.selected_queue().map_or(0, |q| u32::from(q.ready())),
            0x060 => self.interrupt.status(),
            0x070 => self.status,
            0x0fc => self.config_generation,
            _ => return None,
        })
    }

    fn queue_setup_allowed(&self) -> bool {
        self.status & status::FEATURES_OK != 0 && self.status & status::DRIVER_OK == 0
    }

    fn write_register(&mut self, offset: u64, v: u32) {
        match offset {
            0x014 => self.device_features_sel = v,
            0x020 => {
                if self.status & status::FEATURES_OK != 0 {
                    return self.bad("features written after FEATURES_OK", offset);
                }
                let page = match self.driver_features_sel {
                    0 => u64::from(v),
                    1 => u64::from(v) << 32,
                    _ => return,
                };
                let mask = match self.driver_features_sel {
                    0 => 0xffff_ffff,
                    _ => 0xffff_ffff_0000_0000,
                };
                self.acked_features = (self.acked_features & !mask) | page;
            }
            0x024 => self.driver_features_sel = v,
            0x030 => self.queue_sel = v,
            0x038 | 0x044 | 0x080 | 0x084 | 0x090 | 0x094 | 0x0a0 | 0x0a4 => {
                if !self.queue_setup_allowed() {
                    return self.bad("queue set-up out of order", offset);
                }
                let Some(q) = self.queues.get_mut(self.queue_sel as usize) else {
                    return self.bad("no such queue", offset);
                };
                if offset != 0x044 && q.ready() {
                    return self.bad("queue changed while ready", offset);
                }
                match offset {
                    0x038 => q.set_size(v as u16),
                    0x044 => q.set_ready(v == 1),
                    0x080 => q.set_desc_table_address(Some(v), None),
                    0x084 => q.set_desc_table_address(None, Some(v)),
                    0x090 => q.set_avail_ring_address(Some(v), None),
                    0x094 => q.set_avail_ring_address(None, Some(v)),
                    0x0a0 => q.set_used_ring_address(Some(v), None),
                    _ => q.set_used_ring_address(None, Some(v)),
                }
            }
            0x050 => match self.queue_evts.get(v as usize) {
                Some(evt) => {
                    if let Err(e) = evt.write(1) {
                        log::warn!("virtio-mmio: cannot signal queue {v}: {e}");
                    }
                }
                None => self.bad("notify of a queue that does not exist", offset),
            },
            0x064 => self.interrupt.ack(v),
            0x070 => self.write_status(v),
            _ => self.bad("write to an unknown register", offset),
        }
    }

    /// A driver write of the status register, by the rules in
    /// [`lifecycle`]: 0 resets; otherwise the write may add FAILED or the
    /// one bit that comes next, and the rest of it is ignored and counted.
    /// FEATURES_OK is refused (left clear) for features the device cannot
    /// take; DRIVER_OK after an accepted FEATURES_OK starts the device.
    fn write_status(&mut self, v: u32) {
        if v == 0 {
            return self.reset();
        }
        let cur = self.status;
        if v & cur != cur {
            return self.bad("status bits cleared without a reset", 0x70);
        }
        if v & !lifecycle::DRIVER_BITS & !cur != 0 {
            // Unknown bits, or DEVICE_NEEDS_RESET the device never set.
            self.bad("status bits a driver cannot set, ignored", 0x70);
        }
        let new = v & lifecycle::DRIVER_BITS & !cur;
        if new == 0 {
            return;
        }
        if new & status::FAILED != 0 {
            if new != status::FAILED {
                self.bad("status bits set with FAILED, ignored", 0x70);
            }
            self.status |= status::FAILED;
            return;
        }
        // Several bits in one write are taken one by one, in the driver's
        // order (as if written one at a time); the first that cannot come
        // next, or is refused, ends the write.
        let mut new = new;
        while new != 0 {
            let Some(bit) = lifecycle::next_bit(self.status).filter(|b| new & b != 0) else {
                return self.bad("status bits not set in the driver's order", 0x70);
            };
            if bit == status::FEATURES_OK && !self.features_acceptable(self.acked_features) {
                return self.bad("features not offered, or no VERSION_1", 0x70);
            }
            self.status |= bit;
            new &= !bit;
            if bit == status::DRIVER_OK {
                self.activate();
            }
        }
    }

    /// Whether the device can work with `acked` (FEATURES_OK): only
    /// features it offered, and VERSION_1.
    fn features_acceptable(&self, acked: u64) -> bool {
        acked & !self.offered() == 0 && acked & VIRTIO_F_VERSION_1 != 0
    }

    /// The first ready queue of `queues` that does not fit in guest memory.
    fn invalid_queue(&self, queues: &[Queue]) -> Option<usize> {
        queues
            .iter()
            .position(|q| q.ready() && !q.is_valid(&self.mem))
    }

    /// DRIVER_OK was just set: starts the device on copies of the queues as
    /// the driver programmed them; a queue outside guest memory or a device
    /// that refuses leaves it stopped, with DEVICE_NEEDS_RESET.
    fn activate(&mut self) {
        if let Some(i) = self.invalid_queue(&self.queues) {
            self.bad("queue not valid in guest memory", 0x44);
            return self.needs_reset(&format!("queue {i} is not valid"));
        }
        let event_idx = self.acked_features & super::VIRTIO_RING_F_EVENT_IDX != 0;
        let copies = self
            .queues
            .iter()
            .map(|q| {
                Queue::try_from(virtio_queue::QueueState {
                    next_avail: 0,
                    next_used: 0,
                    event_idx_enabled: event_idx,
                    ..q.state()
                })
            })
            .collect::<Result<Vec<_>, _>>();
        let result = match copies {
            Ok(queues) => self.start(self.acked_features, queues),
            Err(e) => return self.needs_reset(&format!("queue copy: {e:?}")),
        };
        if let Err(e) = result {
            self.needs_reset(&e.to_string());
        }
    }

    /// Starts the device with `acked` on `queues` (the device's own copies,
    /// with their ring positions): the one way a device goes live, on the
    /// driver's DRIVER_OK or on a restore. A device that refuses is reset,
    /// so that it never runs half started.
    fn start(&mut self, acked: u64, queues: Vec<Queue>) -> Result<(), ActivateError> {
        let result = self.device.activate(acked, queues, self.mem.clone());
        if result.is_err() {
            self.device.reset();
        }
        result
    }

    fn needs_reset(&mut self, why: &str) {
        log::warn!("virtio-mmio: device needs reset: {why}");
        self.status |= status::DEVICE_NEEDS_RESET;
        self.interrupt.trigger(INT_CONFIG);
    }

    fn reset(&mut self) {
        self.device.reset();
        for q in &mut self.queues {
            q.reset();
        }
        self.queue_sel = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.acked_features = 0;
        self.status = 0;
        self.interrupt.ack(u32::MAX);
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_START {
            return self.device.read_config(offset - CONFIG_START, data);
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            data.fill(0);
            return self.bad("register read not 32-bit aligned", offset);
        }
        match self.read_register(offset) {
            Some(v) => data.copy_from_slice(&v.to_le_bytes()),
            None => {
                data.fill(0);
                self.bad("read of an unknown register", offset);
            }
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_START {
            self.device.write_config(offset - CONFIG_START, data);
            self.config_generation = self.config_generation.wrapping_add(1);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            return self.bad("register write not 32 bits", offset);
        };
        if !offset.is_multiple_of(4) {
            return self.bad("register write not aligned", offset);
        }
        self.write_register(offset, u32::from_le_bytes(bytes));
    }
}

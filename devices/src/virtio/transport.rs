//! What every virtio transport keeps, whatever its registers look like
//! (virtio-mmio's window, virtio-pci's common configuration structure):
//! the device, its queues as the driver programs them, feature
//! negotiation and the device status.
//!
//! The transports decode the guest's accesses and call in here; every
//! value comes from the guest and is checked: a write out of order (queue
//! set-up after DRIVER_OK, features the device never offered) is counted
//! and ignored, never a panic. The status register follows the rules in
//! [`lifecycle`]: the device is started on exactly the write that sets
//! DRIVER_OK after an accepted FEATURES_OK, and a start that fails (a queue
//! outside guest memory, a device that refuses) sets DEVICE_NEEDS_RESET and
//! leaves the device stopped. Runs on the vCPU thread of the access, under
//! the transport's lock; never blocks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::GuestMemoryMmap;
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::interrupt::Interrupt;
use super::{status, ActivateError, VirtioDevice, VIRTIO_F_VERSION_1};

pub(crate) mod lifecycle;
mod state;
pub use state::TransportStateError;

/// A queue register a driver programs before the queue is ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueReg {
    Size,
    Ready,
    DescLo,
    DescHi,
    AvailLo,
    AvailHi,
    UsedLo,
    UsedHi,
}

/// The transport-independent part of a virtio transport.
pub struct Transport {
    /// Names the transport in logs ("virtio-mmio", "virtio-pci").
    name: &'static str,
    pub(crate) device: Box<dyn VirtioDevice>,
    pub(crate) mem: GuestMemoryMmap,
    pub(crate) interrupt: Arc<Interrupt>,
    pub(crate) queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    pub(crate) queue_sel: u32,
    pub(crate) device_features_sel: u32,
    pub(crate) driver_features_sel: u32,
    pub(crate) acked_features: u64,
    pub(crate) status: u32,
    pub(crate) config_generation: u32,
    bad_accesses: Arc<AtomicU64>,
}

impl Transport {
    /// Wraps `device`; `queue_evts` (one per queue) are what a queue notify
    /// signals; `interrupt` is shared with the device.
    pub fn new(
        name: &'static str,
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
        Ok(Transport {
            name,
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

    /// The device's interrupt.
    pub fn interrupt(&self) -> &Arc<Interrupt> {
        &self.interrupt
    }

    /// Counts and logs a guest access that made no sense.
    pub fn bad(&self, what: &str, offset: u64) {
        self.bad_accesses.fetch_add(1, Ordering::Relaxed);
        log::debug!("{}: {what} at {offset:#x}", self.name);
    }

    /// The queue QueueSel names, if it exists.
    pub fn selected_queue(&self) -> Option<&Queue> {
        self.queues.get(self.queue_sel as usize)
    }

    /// The number of queues.
    pub fn queue_count(&self) -> usize {
        self.queues.len()
    }

    /// The virtio device type.
    pub fn device_type(&self) -> u32 {
        self.device.device_type()
    }

    /// Features offered: the device's and VERSION_1.
    pub fn offered(&self) -> u64 {
        self.device.features() | VIRTIO_F_VERSION_1
    }

    /// The 32 bits of offered features DeviceFeaturesSel selects.
    pub fn device_features(&self) -> u32 {
        match self.device_features_sel {
            0 => self.offered() as u32,
            1 => (self.offered() >> 32) as u32,
            _ => 0,
        }
    }

    /// The 32 bits of accepted features DriverFeaturesSel selects.
    pub fn driver_features(&self) -> u32 {
        match self.driver_features_sel {
            0 => self.acked_features as u32,
            1 => (self.acked_features >> 32) as u32,
            _ => 0,
        }
    }

    /// A driver write of the 32 accepted-feature bits DriverFeaturesSel
    /// selects (refused after FEATURES_OK).
    pub fn set_driver_features(&mut self, v: u32, offset: u64) {
        if self.status & status::FEATURES_OK != 0 {
            return self.bad("features written after FEATURES_OK", offset);
        }
        let (page, mask) = match self.driver_features_sel {
            0 => (u64::from(v), 0xffff_ffff),
            1 => (u64::from(v) << 32, 0xffff_ffff_0000_0000),
            _ => return,
        };
        self.acked_features = (self.acked_features & !mask) | page;
    }

    fn queue_setup_allowed(&self) -> bool {
        self.status & status::FEATURES_OK != 0 && self.status & status::DRIVER_OK == 0
    }

    /// A driver write of one of the selected queue's set-up registers:
    /// only between FEATURES_OK and DRIVER_OK, and only while the queue is
    /// not ready (but for Ready itself).
    pub fn set_queue(&mut self, reg: QueueReg, v: u32, offset: u64) {
        if !self.queue_setup_allowed() {
            return self.bad("queue set-up out of order", offset);
        }
        let Some(q) = self.queues.get_mut(self.queue_sel as usize) else {
            return self.bad("no such queue", offset);
        };
        if reg != QueueReg::Ready && q.ready() {
            return self.bad("queue changed while ready", offset);
        }
        match reg {
            QueueReg::Size => q.set_size(v as u16),
            QueueReg::Ready => q.set_ready(v == 1),
            QueueReg::DescLo => q.set_desc_table_address(Some(v), None),
            QueueReg::DescHi => q.set_desc_table_address(None, Some(v)),
            QueueReg::AvailLo => q.set_avail_ring_address(Some(v), None),
            QueueReg::AvailHi => q.set_avail_ring_address(None, Some(v)),
            QueueReg::UsedLo => q.set_used_ring_address(Some(v), None),
            QueueReg::UsedHi => q.set_used_ring_address(None, Some(v)),
        }
    }

    /// A queue notify that reached the transport (normally KVM's ioeventfd
    /// takes it first): forwarded to the queue's eventfd.
    pub fn notify(&mut self, queue: u32, offset: u64) {
        match self.queue_evts.get(queue as usize) {
            Some(evt) => {
                if let Err(e) = evt.write(1) {
                    log::warn!("{}: cannot signal queue {queue}: {e}", self.name);
                }
            }
            None => self.bad("notify of a queue that does not exist", offset),
        }
    }

    /// A driver read of the device configuration space.
    pub fn read_config(&self, offset: u64, data: &mut [u8]) {
        self.device.read_config(offset, data);
    }

    /// A driver write to the device configuration space.
    pub fn write_config(&mut self, offset: u64, data: &[u8]) {
        self.device.write_config(offset, data);
        self.config_generation = self.config_generation.wrapping_add(1);
    }

    /// A driver write of the status register, by the rules in
    /// [`lifecycle`]: 0 resets; otherwise the write may add FAILED or the
    /// one bit that comes next, and the rest of it is ignored and counted.
    /// FEATURES_OK is refused (left clear) for features the device cannot
    /// take; DRIVER_OK after an accepted FEATURES_OK starts the device.
    pub fn write_status(&mut self, v: u32, offset: u64) {
        if v == 0 {
            return self.reset();
        }
        let cur = self.status;
        if v & cur != cur {
            return self.bad("status bits cleared without a reset", offset);
        }
        if v & !lifecycle::DRIVER_BITS & !cur != 0 {
            // Unknown bits, or DEVICE_NEEDS_RESET the device never set.
            self.bad("status bits a driver cannot set, ignored", offset);
        }
        let new = v & lifecycle::DRIVER_BITS & !cur;
        if new == 0 {
            return;
        }
        if new & status::FAILED != 0 {
            if new != status::FAILED {
                self.bad("status bits set with FAILED, ignored", offset);
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
                return self.bad("status bits not set in the driver's order", offset);
            };
            if bit == status::FEATURES_OK && !self.features_acceptable(self.acked_features) {
                return self.bad("features not offered, or no VERSION_1", offset);
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
    pub(crate) fn features_acceptable(&self, acked: u64) -> bool {
        acked & !self.offered() == 0 && acked & VIRTIO_F_VERSION_1 != 0
    }

    /// The first ready queue of `queues` that does not fit in guest memory.
    pub(crate) fn invalid_queue(&self, queues: &[Queue]) -> Option<usize> {
        queues
            .iter()
            .position(|q| q.ready() && !q.is_valid(&self.mem))
    }

    /// DRIVER_OK was just set: starts the device on copies of the queues as
    /// the driver programmed them; a queue outside guest memory or a device
    /// that refuses leaves it stopped, with DEVICE_NEEDS_RESET.
    fn activate(&mut self) {
        if let Some(i) = self.invalid_queue(&self.queues) {
            self.bad("queue not valid in guest memory", 0);
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
    pub(crate) fn start(&mut self, acked: u64, queues: Vec<Queue>) -> Result<(), ActivateError> {
        let result = self.device.activate(acked, queues, self.mem.clone());
        if result.is_err() {
            self.device.reset();
        }
        result
    }

    fn needs_reset(&mut self, why: &str) {
        log::warn!("{}: device needs reset: {why}", self.name);
        self.status |= status::DEVICE_NEEDS_RESET;
        self.interrupt.trigger_config();
    }

    /// The driver's reset (a status write of 0): the device stops, the
    /// queues and registers go back to their first values.
    pub fn reset(&mut self) {
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
        self.interrupt.reset_vectors();
    }
}

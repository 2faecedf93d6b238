//! The virtio-pci transport, modern only (virtio 1.2, section 4.1), with
//! MSI-X.
//!
//! A PCI function (vendor 0x1af4, device 0x1040 + the virtio type) with one
//! 32-bit memory BAR of [`BAR_SIZE`] bytes that holds, each at its own
//! page: the common configuration structure, the ISR, the device
//! configuration, the queue notify area (queue `n` at `4 * n`), the MSI-X
//! table and its pending bits. The capability list names them, beside the
//! MSI-X capability and the PCI configuration access capability (a window
//! on the BAR through configuration space, which firmware uses before it
//! maps BARs: the driver sets BAR, offset and length, then reads or writes
//! the data bytes). What the common configuration means (features,
//! queues, status) is the shared [`Transport`]'s; this module decodes the
//! BAR and the configuration space into it.
//!
//! The VMM is told what the guest changed that KVM must follow, through two
//! small traits: where the notify area is now ([`NotifyArea`], for the
//! queues' ioeventfds), and the message of each MSI-X vector ([`MsiRoutes`],
//! for KVM's routes of the vectors' irqfds). A notify that reaches the
//! transport anyway is forwarded to the queue's eventfd.
//!
//! Runs on the vCPU thread of the access, under the function's lock; never
//! blocks. Every access is the guest's: one of a width a field does not
//! have, or at an offset with nothing, reads zeros, writes nothing and is
//! counted; none panics.

use std::io;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use migration::devices::{MmioTransportState, VirtioPciState};
use migration::Snapshottable;
use virtio_queue::QueueT;
use vmm_sys_util::eventfd::EventFd;

use super::interrupt::{Interrupt, NO_VECTOR};
use super::transport::{QueueReg, Transport, TransportStateError};
use super::VirtioDevice;
use crate::pci::{ConfigSpace, PciFunction, CONFIG_BYTES};
use crate::GuestMemoryMmap;

mod msix;
#[cfg(test)]
mod tests;
pub use msix::MsixTable;

/// The BAR's size.
pub const BAR_SIZE: u32 = 0x8000;
/// Where the structures sit in the BAR.
pub const COMMON_AT: u64 = 0x0000;
const COMMON_LEN: u64 = 0x38;
pub const ISR_AT: u64 = 0x1000;
pub const DEVICE_AT: u64 = 0x2000;
const DEVICE_LEN: u64 = 0x1000;
/// The queue notify area (queue `n` at `NOTIFY_AT + NOTIFY_MULTIPLIER * n`).
pub const NOTIFY_AT: u64 = 0x3000;
pub const NOTIFY_MULTIPLIER: u32 = 4;
pub const MSIX_TABLE_AT: u64 = 0x4000;
pub const MSIX_PBA_AT: u64 = 0x5000;

/// PCI vendor of virtio devices.
pub const VIRTIO_PCI_VENDOR: u16 = 0x1af4;
/// Capability offsets in the configuration space.
const MSIX_CAP: usize = 0x40;
const COMMON_CAP: usize = 0x4c;
const NOTIFY_CAP: usize = 0x5c;
const ISR_CAP: usize = 0x70;
const DEVICE_CAP: usize = 0x80;
/// The PCI configuration access capability, and its fields: the window
/// (BAR, offset, length) the driver sets and the data bytes through which
/// it reads or writes the BAR there.
const PCI_CFG_CAP: usize = 0x90;
const PCI_CFG_BAR: usize = PCI_CFG_CAP + 4;
const PCI_CFG_OFFSET: usize = PCI_CFG_CAP + 8;
const PCI_CFG_LENGTH: usize = PCI_CFG_CAP + 12;
const PCI_CFG_DATA: usize = PCI_CFG_CAP + 16;
/// virtio capability types (cfg_type).
const CAP_COMMON: u8 = 1;
const CAP_NOTIFY: u8 = 2;
const CAP_ISR: u8 = 3;
const CAP_DEVICE: u8 = 4;
const CAP_PCI_CFG: u8 = 5;

/// Tells KVM the message of each MSI-X vector the guest programs (the
/// VMM routes the vector's irqfd to it).
pub trait MsiRoutes: Send {
    /// Vector `vector` now sends (`address`, `data`).
    fn set(&mut self, vector: usize, address: u64, data: u32) -> io::Result<()>;
}

/// Tells KVM where the queue notify area is (the VMM registers the
/// queues' ioeventfds there).
pub trait NotifyArea: Send {
    /// The area starts at guest-physical `at` now; `None`: it is not
    /// decoded any more (memory decoding off).
    fn moved(&mut self, at: Option<u64>) -> io::Result<()>;
}

/// Where the KVM-facing side of a transport is told of the guest's
/// changes.
pub struct Hooks {
    pub routes: Box<dyn MsiRoutes>,
    pub notify: Box<dyn NotifyArea>,
}

/// A virtio device behind virtio-pci.
pub struct PciTransport {
    core: Transport,
    config: ConfigSpace,
    msix: MsixTable,
    hooks: Hooks,
    /// Where the notify area was last said to be.
    notify_at: Option<u64>,
}

/// The PCI device ID of virtio device type `t` (modern: 0x1040 + t).
pub fn pci_device_id(t: u32) -> u16 {
    0x1040u16.wrapping_add(t as u16)
}

/// The PCI class of virtio device type `t` (class, subclass, interface).
fn class_of(t: u32) -> [u8; 3] {
    match t {
        1 => [0x02, 0x00, 0x00], // network controller, Ethernet
        2 => [0x01, 0x00, 0x00], // mass storage, SCSI (as QEMU's virtio-blk)
        _ => [0xff, 0x00, 0x00],
    }
}

/// One of the virtio capabilities: cfg_type, BAR 0, the range, and what
/// follows (the notify capability's multiplier).
fn virtio_cap(cfg_type: u8, offset: u64, len: u64, extra: &[u8]) -> Vec<u8> {
    let mut c = vec![0x09, 0, (16 + extra.len()) as u8, cfg_type, 0, 0, 0, 0];
    c.extend_from_slice(&(offset as u32).to_le_bytes());
    c.extend_from_slice(&(len as u32).to_le_bytes());
    c.extend_from_slice(extra);
    c
}

impl PciTransport {
    /// Wraps `device` as a PCI function whose BAR starts at `bar` (the
    /// guest may move it); `interrupt` must be an MSI-X one
    /// ([`Interrupt::msix`]) with a vector per queue and one for
    /// configuration changes.
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
        queue_evts: Vec<EventFd>,
        bar: u32,
        hooks: Hooks,
    ) -> Result<Self, virtio_queue::Error> {
        let t = device.device_type();
        let vectors = interrupt.vector_count();
        let core = Transport::new("virtio-pci", device, mem, interrupt, queue_evts)?;
        let mut config = ConfigSpace::new(VIRTIO_PCI_VENDOR, pci_device_id(t), 1, class_of(t));
        config.set_subsystem(VIRTIO_PCI_VENDOR, 0x40);
        config.set_memory_bar(0, bar, BAR_SIZE);
        // Command: INTx disable is writable but there is no INTx (pin 0).
        let n = (vectors.max(1) - 1) as u16;
        let mut msix = vec![0x11, 0];
        msix.extend_from_slice(&n.to_le_bytes());
        msix.extend_from_slice(&(MSIX_TABLE_AT as u32).to_le_bytes());
        msix.extend_from_slice(&(MSIX_PBA_AT as u32).to_le_bytes());
        config.add_capability(MSIX_CAP, &msix);
        // Message control: Function Mask and MSI-X Enable.
        config.set_writable(MSIX_CAP + 3, &[0xc0]);
        let queues = core.queue_count() as u64;
        let caps = [
            (
                COMMON_CAP,
                virtio_cap(CAP_COMMON, COMMON_AT, COMMON_LEN, &[]),
            ),
            (
                NOTIFY_CAP,
                virtio_cap(
                    CAP_NOTIFY,
                    NOTIFY_AT,
                    queues * u64::from(NOTIFY_MULTIPLIER),
                    &NOTIFY_MULTIPLIER.to_le_bytes(),
                ),
            ),
            (ISR_CAP, virtio_cap(CAP_ISR, ISR_AT, 4, &[])),
            (
                DEVICE_CAP,
                virtio_cap(CAP_DEVICE, DEVICE_AT, DEVICE_LEN, &[]),
            ),
            (PCI_CFG_CAP, virtio_cap(CAP_PCI_CFG, 0, 0, &[0; 4])),
        ];
        for (at, cap) in caps {
            config.add_capability(at, &cap);
        }
        config.set_writable(PCI_CFG_BAR, &[0xff]);
        config.set_writable(PCI_CFG_OFFSET, &[0xff; 12]);
        Ok(PciTransport {
            core,
            config,
            msix: MsixTable::new(vectors),
            hooks,
            notify_at: None,
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

    /// Checks a saved state against this device without applying it.
    pub fn check_state(
        &self,
        s: &MmioTransportState,
        pci: &VirtioPciState,
    ) -> Result<(), TransportStateError> {
        self.core.check_state(s)?;
        self.check_pci(pci)
    }

    fn check_pci(&self, pci: &VirtioPciState) -> Result<(), TransportStateError> {
        let vectors = self.msix.len();
        let bad = |what: String| Err(TransportStateError::Pci(what));
        if pci.msix.len() != vectors {
            return bad(format!(
                "{} MSI-X vectors saved, the device has {vectors}",
                pci.msix.len()
            ));
        }
        if pci.queue_vectors.len() != self.core.queue_count() {
            return bad(format!(
                "{} queue vectors saved, the device has {} queues",
                pci.queue_vectors.len(),
                self.core.queue_count()
            ));
        }
        let valid = |v: u16| v == NO_VECTOR || usize::from(v) < vectors;
        if !valid(pci.config_vector) || !pci.queue_vectors.iter().all(|&v| valid(v)) {
            return bad("a vector the device does not have".into());
        }
        Ok(())
    }

    /// The state beyond the common registers: vectors and the MSI-X table.
    pub fn save_pci(&self) -> VirtioPciState {
        let i = self.core.interrupt();
        VirtioPciState {
            config_vector: i.config_vector(),
            queue_vectors: (0..self.core.queue_count())
                .map(|q| i.queue_vector(q))
                .collect(),
            msix: self.msix.save(&i.mask_state()),
        }
    }

    /// Puts a saved state back (checked first; nothing changes if it is
    /// refused): the common registers (a live device restarts), the
    /// vectors, the MSI-X table and its routes.
    pub fn restore_all(
        &mut self,
        s: &MmioTransportState,
        pci: &VirtioPciState,
    ) -> Result<(), TransportStateError> {
        self.check_pci(pci)?;
        self.core.restore(s)?;
        let i = self.core.interrupt().clone();
        i.set_config_vector(pci.config_vector);
        for (q, &v) in pci.queue_vectors.iter().enumerate() {
            i.set_queue_vector(q, v);
        }
        self.msix.restore(&pci.msix, &i, self.hooks.routes.as_mut());
        Ok(())
    }

    fn bar_base(&self) -> Option<u64> {
        self.config
            .memory_enabled()
            .then(|| u64::from(self.config.memory_bar(0)))
            .filter(|&b| b != 0)
    }

    /// After a change of the configuration space: MSI-X enable and
    /// function mask to the interrupt, the notify area to KVM.
    fn config_changed(&mut self) {
        let control = self.config.bytes()[MSIX_CAP + 3];
        self.core.interrupt().update_masks(|m| {
            m.enabled = control & 0x80 != 0;
            m.function_masked = control & 0x40 != 0;
        });
        let at = self.bar_base().map(|b| b + NOTIFY_AT);
        if at != self.notify_at {
            if let Err(e) = self.hooks.notify.moved(at) {
                log::warn!("virtio-pci: cannot move the queue notify area: {e}");
            }
            self.notify_at = at;
        }
    }

    fn read_common(&mut self, offset: u64, data: &mut [u8]) {
        let c = &self.core;
        let i = c.interrupt();
        let sel = c.queue_sel as usize;
        let q = c.selected_queue();
        let v: u32 = match (offset, data.len()) {
            (0x00, 4) => c.device_features_sel,
            (0x04, 4) => c.device_features(),
            (0x08, 4) => c.driver_features_sel,
            (0x0c, 4) => c.driver_features(),
            (0x10, 2) => u32::from(i.config_vector()),
            (0x12, 2) => c.queue_count() as u32,
            (0x14, 1) => c.status,
            (0x15, 1) => c.config_generation & 0xff,
            (0x16, 2) => c.queue_sel,
            (0x18, 2) => q.map_or(0, |q| u32::from(q.size())),
            (0x1a, 2) => u32::from(i.queue_vector(sel)),
            (0x1c, 2) => q.map_or(0, |q| u32::from(q.ready())),
            (0x1e, 2) => c.queue_sel,
            (0x20, 4) => q.map_or(0, |q| q.desc_table() as u32),
            (0x24, 4) => q.map_or(0, |q| (q.desc_table() >> 32) as u32),
            (0x28, 4) => q.map_or(0, |q| q.avail_ring() as u32),
            (0x2c, 4) => q.map_or(0, |q| (q.avail_ring() >> 32) as u32),
            (0x30, 4) => q.map_or(0, |q| q.used_ring() as u32),
            (0x34, 4) => q.map_or(0, |q| (q.used_ring() >> 32) as u32),
            _ => {
                data.fill(0);
                return self.core.bad("common configuration read", offset);
            }
        };
        data.copy_from_slice(&v.to_le_bytes()[..data.len()]);
    }

    fn write_common(&mut self, offset: u64, data: &[u8]) {
        if data.len() > 4 {
            return self
                .core
                .bad("common configuration write wider than 32 bits", offset);
        }
        let mut b = [0u8; 4];
        b[..data.len()].copy_from_slice(data);
        let v = u32::from_le_bytes(b);
        let queue_reg = match (offset, data.len()) {
            (0x18, 2) => Some(QueueReg::Size),
            (0x1c, 2) => Some(QueueReg::Ready),
            (0x20, 4) => Some(QueueReg::DescLo),
            (0x24, 4) => Some(QueueReg::DescHi),
            (0x28, 4) => Some(QueueReg::AvailLo),
            (0x2c, 4) => Some(QueueReg::AvailHi),
            (0x30, 4) => Some(QueueReg::UsedLo),
            (0x34, 4) => Some(QueueReg::UsedHi),
            _ => None,
        };
        let c = &mut self.core;
        if let Some(reg) = queue_reg {
            if reg == QueueReg::Ready && v != 1 {
                return c.bad("queue_enable written with other than 1", offset);
            }
            return c.set_queue(reg, v, offset);
        }
        match (offset, data.len()) {
            (0x00, 4) => c.device_features_sel = v,
            (0x08, 4) => c.driver_features_sel = v,
            (0x0c, 4) => c.set_driver_features(v, offset),
            (0x10, 2) => {
                c.interrupt().set_config_vector(v as u16);
            }
            (0x14, 1) => c.write_status(v, offset),
            (0x16, 2) => c.queue_sel = v,
            (0x1a, 2) => {
                let sel = c.queue_sel as usize;
                if sel < c.queue_count() {
                    c.interrupt().set_queue_vector(sel, v as u16);
                } else {
                    c.bad("vector of a queue that does not exist", offset);
                }
            }
            _ => c.bad("common configuration write", offset),
        }
    }
}

/// Whether `len` bytes at `at` of configuration space touch the PCI
/// configuration access capability's data bytes.
fn touches_cfg_data(at: usize, len: usize) -> bool {
    at < PCI_CFG_DATA + 4 && at + len > PCI_CFG_DATA
}

impl PciTransport {
    /// The BAR range the PCI configuration access capability names now:
    /// `None` (counted) unless it is BAR 0, 1, 2 or 4 bytes, aligned to
    /// its length, inside the BAR.
    fn cfg_window(&self) -> Option<(u64, usize)> {
        let c = &self.config;
        let bar = c.bytes()[PCI_CFG_BAR];
        let (offset, len) = (c.dword(PCI_CFG_OFFSET), c.dword(PCI_CFG_LENGTH));
        let ok = bar == 0
            && matches!(len, 1 | 2 | 4)
            && offset.is_multiple_of(len)
            && u64::from(offset) + u64::from(len) <= u64::from(BAR_SIZE);
        if !ok {
            self.core
                .bad("PCI configuration access window", u64::from(offset));
            return None;
        }
        Some((u64::from(offset), len as usize))
    }
}

impl PciFunction for PciTransport {
    fn config(&self) -> &ConfigSpace {
        &self.config
    }

    fn read_config(&mut self, at: usize, data: &mut [u8]) {
        if touches_cfg_data(at, data.len()) {
            let mut window = [0u8; 4];
            if let Some((offset, len)) = self.cfg_window() {
                self.read_bar(offset, &mut window[..len]);
            }
            self.config.set(PCI_CFG_DATA, &window);
        }
        self.config.read(at, data);
    }

    fn write_config(&mut self, at: usize, data: &[u8]) {
        self.config.write(at, data);
        if touches_cfg_data(at, data.len()) {
            let bytes = self.config.dword(PCI_CFG_DATA).to_le_bytes();
            if let Some((offset, len)) = self.cfg_window() {
                self.write_bar(offset, &bytes[..len]);
            }
        }
        self.config_changed();
    }

    fn restore_config(&mut self, saved: &[u8; CONFIG_BYTES]) {
        self.config.restore(saved);
        self.config_changed();
    }

    fn decoded_bar(&self) -> Option<(u64, u64)> {
        self.bar_base().map(|b| (b, u64::from(BAR_SIZE)))
    }

    fn read_bar(&mut self, offset: u64, data: &mut [u8]) {
        match offset {
            o if o < COMMON_AT + COMMON_LEN => self.read_common(o - COMMON_AT, data),
            o if (ISR_AT..ISR_AT + 4).contains(&o) => {
                data.fill(0);
                if let (ISR_AT, Some(b)) = (o, data.first_mut()) {
                    *b = self.core.interrupt().take_status() as u8;
                }
            }
            o if (DEVICE_AT..DEVICE_AT + DEVICE_LEN).contains(&o) => {
                let at = o - DEVICE_AT;
                if at + data.len() as u64 > DEVICE_LEN {
                    data.fill(0);
                    return self.core.bad("device configuration read", o);
                }
                self.core.read_config(at, data);
            }
            o if (MSIX_TABLE_AT..MSIX_PBA_AT).contains(&o) => {
                if !self.msix.read_table(o - MSIX_TABLE_AT, data) {
                    return self.core.bad("MSI-X table read", o);
                }
                let masks = self.core.interrupt().mask_state();
                msix::fill_control(&masks, o - MSIX_TABLE_AT, data);
            }
            o if (MSIX_PBA_AT..u64::from(BAR_SIZE)).contains(&o) => {
                let pending = self.core.interrupt().mask_state().pending;
                if !msix::read_pba(&pending, o - MSIX_PBA_AT, data) {
                    self.core.bad("MSI-X pending bits read", o);
                }
            }
            o => {
                data.fill(0);
                self.core.bad("read of nothing in the BAR", o);
            }
        }
    }

    fn write_bar(&mut self, offset: u64, data: &[u8]) {
        match offset {
            o if o < COMMON_AT + COMMON_LEN => self.write_common(o - COMMON_AT, data),
            o if (DEVICE_AT..DEVICE_AT + DEVICE_LEN).contains(&o) => {
                let at = o - DEVICE_AT;
                if at + data.len() as u64 > DEVICE_LEN {
                    return self.core.bad("device configuration write", o);
                }
                self.core.write_config(at, data);
            }
            o if (NOTIFY_AT..MSIX_TABLE_AT).contains(&o) => {
                let rel = o - NOTIFY_AT;
                if !rel.is_multiple_of(u64::from(NOTIFY_MULTIPLIER)) {
                    return self.core.bad("notify not at a queue's address", o);
                }
                self.core
                    .notify((rel / u64::from(NOTIFY_MULTIPLIER)) as u32, o);
            }
            o if (MSIX_TABLE_AT..MSIX_PBA_AT).contains(&o) => {
                let i = self.core.interrupt().clone();
                if !self
                    .msix
                    .write_table(o - MSIX_TABLE_AT, data, &i, self.hooks.routes.as_mut())
                {
                    self.core.bad("MSI-X table write", o);
                }
            }
            o => self
                .core
                .bad("write of nothing (or read-only) in the BAR", o),
        }
    }
}

impl Snapshottable for PciTransport {
    type State = (MmioTransportState, VirtioPciState);
    type Error = TransportStateError;

    fn save(&self) -> Result<Self::State, TransportStateError> {
        Ok((self.core.save()?, self.save_pci()))
    }

    fn restore(&mut self, s: &Self::State) -> Result<(), TransportStateError> {
        self.restore_all(&s.0, &s.1)
    }
}

//! The virtio-mmio transport, version 2 (virtio 1.2, section 4.2.2).
//!
//! One 4 KiB window per device: registers below 0x100, the device's
//! configuration space above. Every access comes from the guest and is
//! checked: a wrong width, an unknown offset, a write out of order (queue
//! set-up after DRIVER_OK, features the device never offered) is counted and
//! ignored, never a panic. Queue notifications normally never reach this
//! code: the VMM registers each queue's eventfd as a KVM ioeventfd on the
//! notify register; a notify that does arrive here is forwarded to the same
//! eventfd.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::GuestMemoryMmap;
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::{status, VirtioDevice, INT_CONFIG, VIRTIO_F_VERSION_1};
use crate::bus::BusDevice;

mod state;
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

    fn write_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        // Bits are only ever added, and in order.
        if v & self.status != self.status {
            return self.bad("status bits cleared without a reset", 0x70);
        }
        let new = v & !self.status;
        if new & status::FEATURES_OK != 0 {
            let offered = self.offered();
            if self.acked_features & !offered != 0 || self.acked_features & VIRTIO_F_VERSION_1 == 0
            {
                self.bad("features not offered, or no VERSION_1", 0x70);
                self.status = v & !status::FEATURES_OK;
                return;
            }
        }
        if new & status::DRIVER_OK != 0 {
            if self.status & status::FEATURES_OK == 0 {
                return self.bad("DRIVER_OK before FEATURES_OK", 0x70);
            }
            self.status = v;
            self.activate();
            return;
        }
        self.status = v;
    }

    fn activate(&mut self) {
        for (i, q) in self.queues.iter().enumerate() {
            if q.ready() && !q.is_valid(&self.mem) {
                self.bad("queue not valid in guest memory", 0x44);
                return self.needs_reset(&format!("queue {i} is not valid"));
            }
        }
        let mut queues = Vec::with_capacity(self.queues.len());
        for q in &self.queues {
            let Ok(mut copy) = Queue::new(q.max_size()) else {
                return self.needs_reset("queue copy");
            };
            copy.set_size(q.size());
            copy.set_desc_table_address(
                Some(q.desc_table() as u32),
                Some((q.desc_table() >> 32) as u32),
            );
            copy.set_avail_ring_address(
                Some(q.avail_ring() as u32),
                Some((q.avail_ring() >> 32) as u32),
            );
            copy.set_used_ring_address(
                Some(q.used_ring() as u32),
                Some((q.used_ring() >> 32) as u32),
            );
            copy.set_event_idx(self.acked_features & super::VIRTIO_RING_F_EVENT_IDX != 0);
            copy.set_ready(q.ready());
            queues.push(copy);
        }
        if let Err(e) = self
            .device
            .activate(self.acked_features, queues, self.mem.clone())
        {
            self.needs_reset(&e.to_string());
        }
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

#[cfg(test)]
pub(super) mod tests {
    use std::sync::Mutex;

    use vm_memory::GuestAddress;

    use super::*;
    use crate::virtio::ActivateError;

    #[derive(Default)]
    pub(super) struct Seen {
        pub(super) activated: Option<(u64, usize)>,
        /// The queues as activated (what `queue_states` reports).
        pub(super) live: Option<Vec<virtio_queue::QueueState>>,
        resets: u32,
        config: Vec<u8>,
    }

    struct Dummy(Arc<Mutex<Seen>>);

    impl VirtioDevice for Dummy {
        fn device_type(&self) -> u32 {
            1
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[256, 256]
        }
        fn features(&self) -> u64 {
            1 << 5 // VIRTIO_NET_F_MAC
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = offset as u8 + i as u8;
            }
        }
        fn write_config(&mut self, _offset: u64, data: &[u8]) {
            self.0.lock().unwrap().config.extend_from_slice(data);
        }
        fn activate(
            &mut self,
            acked: u64,
            queues: Vec<Queue>,
            _mem: GuestMemoryMmap,
        ) -> Result<(), ActivateError> {
            let mut seen = self.0.lock().unwrap();
            seen.activated = Some((acked, queues.len()));
            seen.live = Some(queues.iter().map(|q| q.state()).collect());
            Ok(())
        }
        fn reset(&mut self) {
            self.0.lock().unwrap().resets += 1;
        }
        fn queue_states(&self) -> Option<Vec<virtio_queue::QueueState>> {
            self.0.lock().unwrap().live.clone()
        }
    }

    pub(super) fn transport() -> (MmioTransport, Arc<Mutex<Seen>>, Vec<EventFd>) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let evts: Vec<EventFd> = (0..2)
            .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
            .collect();
        let clones = evts.iter().map(|e| e.try_clone().unwrap()).collect();
        let t = MmioTransport::new(
            Box::new(Dummy(seen.clone())),
            mem,
            Arc::new(Interrupt::new(irq)),
            clones,
        )
        .unwrap();
        (t, seen, evts)
    }

    fn r(t: &mut MmioTransport, off: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    pub(super) fn w(t: &mut MmioTransport, off: u64, v: u32) {
        t.write(off, &v.to_le_bytes());
    }

    pub(super) fn setup_queue(t: &mut MmioTransport, sel: u32, base: u64) {
        w(t, 0x30, sel);
        assert_eq!(r(t, 0x34), 256);
        w(t, 0x38, 256);
        w(t, 0x80, base as u32);
        w(t, 0x84, 0);
        w(t, 0x90, (base + 0x1000) as u32);
        w(t, 0x94, 0);
        w(t, 0xa0, (base + 0x2000) as u32);
        w(t, 0xa4, 0);
        w(t, 0x44, 1);
    }

    #[test]
    fn identity_registers() {
        let (mut t, _, _) = transport();
        assert_eq!(r(&mut t, 0x0), MAGIC);
        assert_eq!(r(&mut t, 0x4), 2);
        assert_eq!(r(&mut t, 0x8), 1);
        w(&mut t, 0x14, 1);
        assert_eq!(r(&mut t, 0x10), 1, "VERSION_1 in the high page");
        w(&mut t, 0x14, 0);
        assert_eq!(r(&mut t, 0x10), 1 << 5);
        let mut cfg = [0u8; 2];
        t.read(0x104, &mut cfg);
        assert_eq!(cfg, [4, 5]);
    }

    /// What a driver does up to DRIVER_OK: features (MAC and VERSION_1),
    /// FEATURES_OK, both queues.
    pub(super) fn start_device(t: &mut MmioTransport) {
        w(t, 0x70, status::ACKNOWLEDGE);
        w(t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
        w(t, 0x24, 0);
        w(t, 0x20, 1 << 5);
        w(t, 0x24, 1);
        w(t, 0x20, 1);
        let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
        w(t, 0x70, s);
        assert_eq!(r(t, 0x70), s);
        setup_queue(t, 0, 0x10000);
        setup_queue(t, 1, 0x20000);
        w(t, 0x70, s | status::DRIVER_OK);
    }

    #[test]
    fn full_negotiation_activates_the_device() {
        let (mut t, seen, evts) = transport();
        start_device(&mut t);
        assert_eq!(
            seen.lock().unwrap().activated,
            Some(((1 << 5) | VIRTIO_F_VERSION_1, 2))
        );
        // A notify that reaches the transport signals the queue's eventfd.
        w(&mut t, 0x50, 1);
        assert_eq!(evts[1].read().unwrap(), 1);
        w(&mut t, 0x50, 7);
        assert_eq!(t.bad_accesses().load(Ordering::Relaxed), 1);
        // Reset.
        w(&mut t, 0x70, 0);
        assert_eq!(r(&mut t, 0x70), 0);
        assert_eq!(seen.lock().unwrap().resets, 1);
    }

    #[test]
    fn hostile_accesses_are_counted_and_ignored() {
        let (mut t, seen, _) = transport();
        let bad = t.bad_accesses();
        // Offered features only, and VERSION_1 is required.
        w(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
        w(&mut t, 0x20, 1 << 7);
        w(
            &mut t,
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        assert_eq!(r(&mut t, 0x70) & status::FEATURES_OK, 0);
        // Queue set-up before FEATURES_OK.
        w(&mut t, 0x38, 16);
        // Odd widths and offsets.
        t.write(0x30, &[1]);
        t.write(0x31, &[1, 2, 3, 4]);
        let mut b = [0xffu8; 2];
        t.read(0x0, &mut b);
        assert_eq!(b, [0, 0]);
        assert_eq!(r(&mut t, 0xf0), 0);
        w(&mut t, 0xf0, 1);
        // Queue selector past the end.
        w(&mut t, 0x30, 99);
        assert_eq!(r(&mut t, 0x34), 0);
        // DRIVER_OK without FEATURES_OK.
        w(
            &mut t,
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::DRIVER_OK,
        );
        assert!(seen.lock().unwrap().activated.is_none());
        assert!(
            bad.load(Ordering::Relaxed) >= 8,
            "{}",
            bad.load(Ordering::Relaxed)
        );
    }

    #[test]
    fn a_queue_outside_guest_memory_needs_reset() {
        let (mut t, seen, _) = transport();
        w(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
        w(&mut t, 0x24, 1);
        w(&mut t, 0x20, 1);
        let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
        w(&mut t, 0x70, s);
        setup_queue(&mut t, 0, 0x7fff_0000);
        w(&mut t, 0x70, s | status::DRIVER_OK);
        assert!(seen.lock().unwrap().activated.is_none());
        assert_ne!(r(&mut t, 0x70) & status::DEVICE_NEEDS_RESET, 0);
        assert_ne!(r(&mut t, 0x60) & INT_CONFIG, 0);
        w(&mut t, 0x64, INT_CONFIG);
        assert_eq!(r(&mut t, 0x60), 0);
    }
}

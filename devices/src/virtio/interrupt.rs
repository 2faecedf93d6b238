//! A virtio device's interrupt, whatever the transport: the interrupt
//! status bits a driver reads (virtio-mmio's InterruptStatus, virtio-pci's
//! ISR), and how the guest is told.
//!
//! - virtio-mmio: one line, an irqfd on an IOAPIC pin.
//! - virtio-pci: MSI-X, one irqfd per vector (the VMM routes each to the
//!   message the driver programmed); the driver maps each queue and the
//!   configuration change to a vector. A masked vector's interrupt is kept
//!   pending and sent when it is unmasked. There is no INTx: a vector the
//!   driver left unassigned (0xffff), or MSI-X off, sends nothing.
//!
//! Raised by the device thread (a queue's used buffers) and by the vCPU
//! thread that drives the transport (a configuration change); the vector
//! map and masks are written by the vCPU thread. Never blocks beyond a
//! short lock, and never fails on what the guest wrote: a vector out of
//! range sends nothing.

use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};
use std::sync::Mutex;

use vmm_sys_util::eventfd::EventFd;

use super::{INT_CONFIG, INT_USED_RING};

/// The vector number that means "no vector" (virtio 1.2, 4.1.5.1.2).
pub const NO_VECTOR: u16 = 0xffff;

/// A device's interrupt.
pub struct Interrupt {
    status: AtomicU32,
    kind: Kind,
}

enum Kind {
    Line(EventFd),
    Msix(Msix),
}

/// The MSI-X side of a virtio-pci device's interrupt.
struct Msix {
    vectors: Vec<EventFd>,
    queue_vectors: Vec<AtomicU16>,
    config_vector: AtomicU16,
    mask: Mutex<MaskState>,
}

/// MSI-X enable and masks, and what waits for an unmask.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MaskState {
    /// MSI-X Enable (message control bit 15).
    pub enabled: bool,
    /// Function Mask (message control bit 14).
    pub function_masked: bool,
    /// Each vector's mask bit (vector control bit 0).
    pub masked: Vec<bool>,
    /// Each vector's pending bit (the PBA).
    pub pending: Vec<bool>,
}

impl Interrupt {
    /// A virtio-mmio interrupt raised through `evt` (a KVM irqfd).
    pub fn new(evt: EventFd) -> Self {
        Interrupt {
            status: AtomicU32::new(0),
            kind: Kind::Line(evt),
        }
    }

    /// A virtio-pci interrupt with one irqfd per MSI-X vector, for a
    /// device of `queues` queues; every vector starts masked and
    /// unassigned, MSI-X off (as after a reset).
    pub fn msix(vectors: Vec<EventFd>, queues: usize) -> Self {
        let n = vectors.len();
        Interrupt {
            status: AtomicU32::new(0),
            kind: Kind::Msix(Msix {
                vectors,
                queue_vectors: (0..queues).map(|_| AtomicU16::new(NO_VECTOR)).collect(),
                config_vector: AtomicU16::new(NO_VECTOR),
                mask: Mutex::new(MaskState {
                    enabled: false,
                    function_masked: false,
                    masked: vec![true; n],
                    pending: vec![false; n],
                }),
            }),
        }
    }

    /// Queue `queue` has used buffers for the driver.
    pub fn trigger_queue(&self, queue: usize) {
        self.status.fetch_or(INT_USED_RING, Ordering::SeqCst);
        match &self.kind {
            Kind::Line(evt) => raise(evt),
            Kind::Msix(m) => {
                if let Some(v) = m.queue_vectors.get(queue) {
                    m.send(v.load(Ordering::SeqCst));
                }
            }
        }
    }

    /// The device configuration (or its status) changed.
    pub fn trigger_config(&self) {
        self.status.fetch_or(INT_CONFIG, Ordering::SeqCst);
        match &self.kind {
            Kind::Line(evt) => raise(evt),
            Kind::Msix(m) => m.send(m.config_vector.load(Ordering::SeqCst)),
        }
    }

    /// The current interrupt status bits.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// Puts back saved status bits; on a line, raises it again if any is
    /// set (the driver had not acknowledged them).
    pub fn restore(&self, bits: u32) {
        self.status.store(bits, Ordering::SeqCst);
        if let Kind::Line(evt) = &self.kind {
            if bits != 0 {
                raise(evt);
            }
        }
    }

    /// Clears acknowledged status bits.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Reads and clears the status (virtio-pci's ISR read).
    pub fn take_status(&self) -> u32 {
        self.status.swap(0, Ordering::SeqCst)
    }

    /// The number of MSI-X vectors (0 on a line).
    pub fn vector_count(&self) -> usize {
        match &self.kind {
            Kind::Line(_) => 0,
            Kind::Msix(m) => m.vectors.len(),
        }
    }

    /// The vector of queue `queue` (`NO_VECTOR` if none or out of range).
    pub fn queue_vector(&self, queue: usize) -> u16 {
        match &self.kind {
            Kind::Msix(m) => m
                .queue_vectors
                .get(queue)
                .map_or(NO_VECTOR, |v| v.load(Ordering::SeqCst)),
            Kind::Line(_) => NO_VECTOR,
        }
    }

    /// The configuration-change vector.
    pub fn config_vector(&self) -> u16 {
        match &self.kind {
            Kind::Msix(m) => m.config_vector.load(Ordering::SeqCst),
            Kind::Line(_) => NO_VECTOR,
        }
    }

    /// Maps queue `queue` to `vector`; returns what the driver reads back:
    /// `vector`, or `NO_VECTOR` for one the device does not have.
    pub fn set_queue_vector(&self, queue: usize, vector: u16) -> u16 {
        let Kind::Msix(m) = &self.kind else {
            return NO_VECTOR;
        };
        let v = m.valid(vector);
        if let Some(q) = m.queue_vectors.get(queue) {
            q.store(v, Ordering::SeqCst);
        }
        v
    }

    /// Maps configuration changes to `vector` (see [`Self::set_queue_vector`]).
    pub fn set_config_vector(&self, vector: u16) -> u16 {
        let Kind::Msix(m) = &self.kind else {
            return NO_VECTOR;
        };
        let v = m.valid(vector);
        m.config_vector.store(v, Ordering::SeqCst);
        v
    }

    /// The MSI-X enable and masks (defaults on a line).
    pub fn mask_state(&self) -> MaskState {
        match &self.kind {
            Kind::Msix(m) => crate::sync::lock(&m.mask).clone(),
            Kind::Line(_) => MaskState::default(),
        }
    }

    /// Changes the MSI-X enable and masks with `f`, then sends what was
    /// pending on a vector that is now unmasked.
    pub fn update_masks(&self, f: impl FnOnce(&mut MaskState)) {
        let Kind::Msix(m) = &self.kind else {
            return;
        };
        let mut s = crate::sync::lock(&m.mask);
        let n = m.vectors.len();
        f(&mut s);
        s.masked.resize(n, true);
        s.pending.resize(n, false);
        if !s.enabled || s.function_masked {
            return;
        }
        for v in 0..n {
            if s.pending[v] && !s.masked[v] {
                s.pending[v] = false;
                raise(&m.vectors[v]);
            }
        }
    }

    /// Resets the vector map (a device reset); masks stay (they are the
    /// PCI function's, not the device's).
    pub fn reset_vectors(&self) {
        if let Kind::Msix(m) = &self.kind {
            for q in &m.queue_vectors {
                q.store(NO_VECTOR, Ordering::SeqCst);
            }
            m.config_vector.store(NO_VECTOR, Ordering::SeqCst);
        }
    }
}

impl Msix {
    fn valid(&self, vector: u16) -> u16 {
        if usize::from(vector) < self.vectors.len() {
            vector
        } else {
            NO_VECTOR
        }
    }

    /// Sends `vector`'s message, or keeps it pending while masked.
    fn send(&self, vector: u16) {
        let v = usize::from(vector);
        let Some(evt) = self.vectors.get(v) else {
            return;
        };
        let mut s = crate::sync::lock(&self.mask);
        if !s.enabled {
            return;
        }
        if s.function_masked || s.masked.get(v).copied().unwrap_or(true) {
            if let Some(p) = s.pending.get_mut(v) {
                *p = true;
            }
            return;
        }
        raise(evt);
    }
}

fn raise(evt: &EventFd) {
    if let Err(e) = evt.write(1) {
        log::warn!("virtio: cannot raise the interrupt: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fds(n: usize) -> Vec<EventFd> {
        (0..n)
            .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
            .collect()
    }

    fn fired(i: &Interrupt, v: usize) -> bool {
        match &i.kind {
            Kind::Msix(m) => m.vectors[v].read().is_ok(),
            Kind::Line(e) => e.read().is_ok(),
        }
    }

    #[test]
    fn a_line_raises_for_queues_and_config() {
        let i = Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        i.trigger_queue(7);
        assert!(fired(&i, 0));
        assert_eq!(i.status(), INT_USED_RING);
        i.trigger_config();
        assert_eq!(i.take_status(), INT_USED_RING | INT_CONFIG);
        assert_eq!(i.status(), 0);
    }

    #[test]
    fn msix_sends_to_the_mapped_vector_and_holds_masked_ones() {
        let i = Interrupt::msix(fds(3), 2);
        assert_eq!(i.set_queue_vector(1, 2), 2);
        assert_eq!(i.set_queue_vector(0, 9), NO_VECTOR, "no such vector");
        assert_eq!(i.set_config_vector(0), 0);
        i.trigger_queue(1);
        assert!(!fired(&i, 2), "MSI-X is off");
        i.update_masks(|s| {
            s.enabled = true;
            s.masked[2] = false;
        });
        i.trigger_queue(1);
        assert!(fired(&i, 2));
        i.trigger_queue(0);
        i.trigger_queue(5);
        i.trigger_config();
        assert!(!fired(&i, 0), "vector 0 is masked");
        assert_eq!(i.mask_state().pending, vec![true, false, false]);
        i.update_masks(|s| s.masked[0] = false);
        assert!(fired(&i, 0), "sent on unmask");
        assert_eq!(i.mask_state().pending, vec![false; 3]);
        i.update_masks(|s| s.function_masked = true);
        i.trigger_config();
        assert!(!fired(&i, 0));
        i.update_masks(|s| s.function_masked = false);
        assert!(fired(&i, 0));
        i.reset_vectors();
        assert_eq!(i.queue_vector(1), NO_VECTOR);
    }
}

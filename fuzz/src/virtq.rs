//! The driver side of a split virtqueue in guest memory, as a hostile guest
//! would drive it: descriptors and available-ring entries written as the
//! fuzzer says, with no check that they make sense.

use devices::GuestMemoryMmap;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

/// Where one queue's rings live, and the driver's available index.
pub struct Ring {
    /// Descriptor table.
    pub desc: u64,
    /// Available ring.
    pub avail: u64,
    /// Used ring.
    pub used: u64,
    /// Queue size (a power of two, at most `max`).
    pub size: u16,
    /// The largest size the device offers.
    pub max: u16,
    avail_idx: u16,
}

impl Ring {
    /// A queue of `size` entries at these addresses, nothing posted.
    pub fn new(desc: u64, avail: u64, used: u64, size: u16, max: u16) -> Self {
        Ring {
            desc,
            avail,
            used,
            size,
            max,
            avail_idx: 0,
        }
    }

    /// The device-side queue, as the transport hands it over on DRIVER_OK.
    pub fn queue(&self, event_idx: bool) -> Queue {
        let mut q = Queue::new(self.max).expect("a valid maximum size");
        q.set_size(self.size);
        q.set_desc_table_address(Some(self.desc as u32), Some((self.desc >> 32) as u32));
        q.set_avail_ring_address(Some(self.avail as u32), Some((self.avail >> 32) as u32));
        q.set_used_ring_address(Some(self.used as u32), Some((self.used >> 32) as u32));
        q.set_event_idx(event_idx);
        q.set_ready(true);
        q
    }

    /// Writes descriptor `index` (modulo the size) as given.
    pub fn write_desc(
        &self,
        mem: &GuestMemoryMmap,
        index: u16,
        addr: u64,
        len: u32,
        flags: u16,
        next: u16,
    ) {
        let at = self.desc + u64::from(index % self.size) * 16;
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..].copy_from_slice(&next.to_le_bytes());
        let _ = mem.write_slice(&d, GuestAddress(at));
    }

    /// Makes `head` (not checked) available and publishes the new index.
    pub fn publish(&mut self, mem: &GuestMemoryMmap, head: u16) {
        let slot = u64::from(self.avail_idx % self.size);
        let _ = mem.write_obj(head, GuestAddress(self.avail + 4 + slot * 2));
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.set_avail_idx(mem, self.avail_idx);
    }

    /// Writes the available index (a hostile driver jumps it anywhere).
    pub fn set_avail_idx(&mut self, mem: &GuestMemoryMmap, idx: u16) {
        self.avail_idx = idx;
        let _ = mem.write_obj(idx, GuestAddress(self.avail + 2));
    }

    /// The used index the device wrote.
    pub fn used_idx(&self, mem: &GuestMemoryMmap) -> u16 {
        mem.read_obj(GuestAddress(self.used + 2)).unwrap_or(0)
    }
}

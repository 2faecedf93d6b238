//! A tiny driver for unit tests: builds descriptor chains and avail entries
//! in mock guest memory the way a guest driver would (hostile ones included),
//! and reads back the used ring.

use crate::GuestMemoryMmap;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress};

pub const DESC: u64 = 0x1000;
pub const AVAIL: u64 = 0x2000;
pub const USED: u64 = 0x3000;
pub const DATA: u64 = 0x10000;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;

/// Where [`Driver::second`] puts its ring (after the data buffers tests use).
const SECOND_RING: u64 = 0x30_0000;

/// One driver-side queue of `size` entries.
pub struct Driver {
    pub mem: GuestMemoryMmap,
    pub size: u16,
    /// Offset of this ring from [`DESC`], [`AVAIL`], [`USED`].
    ring: u64,
    next_desc: u16,
    avail_idx: u16,
}

impl Driver {
    pub fn new(size: u16) -> Self {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        Driver {
            mem,
            size,
            ring: 0,
            next_desc: 0,
            avail_idx: 0,
        }
    }

    /// A second queue of `size` entries in the same guest memory (its ring
    /// elsewhere), for devices with two queues.
    pub fn second(&self, size: u16) -> Self {
        Driver {
            mem: self.mem.clone(),
            size,
            ring: SECOND_RING,
            next_desc: 0,
            avail_idx: 0,
        }
    }

    /// The device-side queue for this ring.
    pub fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).unwrap();
        q.set_size(self.size);
        q.set_desc_table_address(Some((self.ring + DESC) as u32), Some(0));
        q.set_avail_ring_address(Some((self.ring + AVAIL) as u32), Some(0));
        q.set_used_ring_address(Some((self.ring + USED) as u32), Some(0));
        q.set_ready(true);
        q
    }

    /// Writes a raw descriptor at `index`.
    pub fn write_desc(&self, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = GuestAddress(self.ring + DESC + u64::from(index) * 16);
        self.mem.write_obj(addr, at).unwrap();
        self.mem.write_obj(len, at.unchecked_add(8)).unwrap();
        self.mem.write_obj(flags, at.unchecked_add(12)).unwrap();
        self.mem.write_obj(next, at.unchecked_add(14)).unwrap();
    }

    /// Makes `head` available to the device.
    pub fn publish(&mut self, head: u16) {
        let slot = u64::from(self.avail_idx % self.size);
        self.mem
            .write_obj(head, GuestAddress(self.ring + AVAIL + 4 + slot * 2))
            .unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.set_avail_idx(self.avail_idx);
    }

    /// Writes the ring's available index (a hostile one, too).
    pub fn set_avail_idx(&self, idx: u16) {
        self.mem
            .write_obj(idx, GuestAddress(self.ring + AVAIL + 2))
            .unwrap();
    }

    /// Adds and publishes a chain of (addr, len, device-writable) buffers.
    pub fn add_chain(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        for (i, &(addr, len, write)) in bufs.iter().enumerate() {
            let idx = self.next_desc;
            let last = i + 1 == bufs.len();
            let flags = if write { F_WRITE } else { 0 } | if last { 0 } else { F_NEXT };
            self.write_desc(idx, addr, len, flags, idx + 1);
            self.next_desc += 1;
        }
        self.publish(head);
        head
    }

    /// Used ring entries so far: (head, len).
    pub fn used(&self) -> Vec<(u32, u32)> {
        let used = self.ring + USED;
        let idx: u16 = self.mem.read_obj(GuestAddress(used + 2)).unwrap();
        (0..idx)
            .map(|i| {
                let at = GuestAddress(used + 4 + u64::from(i % self.size) * 8);
                let id: u32 = self.mem.read_obj(at).unwrap();
                let len: u32 = self.mem.read_obj(at.unchecked_add(4)).unwrap();
                (id, len)
            })
            .collect()
    }

    pub fn write(&self, addr: u64, bytes: &[u8]) {
        self.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
    }

    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }
}

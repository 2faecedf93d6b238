//! The port-I/O bus: maps port ranges to devices.
//!
//! The bus is built once before the vCPUs start and is read-only afterwards,
//! so vCPU threads share it without a lock; each device carries its own lock.
//! Besides fixed ranges it holds movable devices ([`MovableDevice`]): ones
//! whose range the guest programs (a PCI function's I/O base register).
//! They answer only accesses no fixed range claims, wherever their range
//! is at that moment.

use std::sync::{Arc, Mutex};

use crate::sync::lock;

/// A device on the bus. `offset` is relative to the start of its range.
pub trait BusDevice: Send {
    /// A guest read of `data.len()` bytes at `offset`.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// A guest write of `data` at `offset`.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// A device whose port range the guest moves (through its PCI
/// configuration space, say). `offset` in its [`BusDevice`] accesses is
/// relative to the start of the range it names now.
pub trait MovableDevice: BusDevice {
    /// The range it decodes now (base, length), if any.
    fn range(&self) -> Option<(u64, u64)>;
}

/// Errors from building the bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    /// A range of zero length.
    #[error("device range at {0:#x} is empty")]
    EmptyRange(u64),
    /// A range that overlaps one already on the bus.
    #[error("device range {base:#x}+{len:#x} overlaps another device")]
    Overlap {
        /// Start of the rejected range.
        base: u64,
        /// Length of the rejected range.
        len: u64,
    },
}

struct Entry {
    base: u64,
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// A set of non-overlapping ranges, each served by one device.
#[derive(Default)]
pub struct Bus {
    entries: Vec<Entry>,
    movable: Vec<Arc<Mutex<dyn MovableDevice>>>,
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `device` at `[base, base + len)`.
    pub fn insert(
        &mut self,
        device: Arc<Mutex<dyn BusDevice>>,
        base: u64,
        len: u64,
    ) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::EmptyRange(base));
        }
        let end = base.saturating_add(len);
        if self
            .entries
            .iter()
            .any(|e| base < e.base.saturating_add(e.len) && e.base < end)
        {
            return Err(BusError::Overlap { base, len });
        }
        let at = self.entries.partition_point(|e| e.base < base);
        self.entries.insert(at, Entry { base, len, device });
        Ok(())
    }

    /// Adds a device whose range moves (see [`MovableDevice`]).
    pub fn insert_movable(&mut self, device: Arc<Mutex<dyn MovableDevice>>) {
        self.movable.push(device);
    }

    fn find(&self, addr: u64) -> Option<(&Entry, u64)> {
        let idx = self.entries.partition_point(|e| e.base <= addr);
        let e = self.entries.get(idx.checked_sub(1)?)?;
        let offset = addr - e.base;
        (offset < e.len).then_some((e, offset))
    }

    /// Runs `access` on the device that claims `addr` (a fixed range first,
    /// then a movable device's current range) with the offset in it; false
    /// if none does.
    fn dispatch(&self, addr: u64, access: impl FnOnce(&mut dyn BusDevice, u64)) -> bool {
        if let Some((e, offset)) = self.find(addr) {
            access(&mut *lock(&e.device), offset);
            return true;
        }
        for m in &self.movable {
            let mut d = lock(m);
            let Some((base, len)) = d.range() else {
                continue;
            };
            if let Some(offset) = addr.checked_sub(base).filter(|&o| o < len) {
                access(&mut *d, offset);
                return true;
            }
        }
        false
    }

    /// Dispatches a read. Returns false when no device claims `addr`; the
    /// caller then answers with all ones, like an empty ISA bus.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        self.dispatch(addr, |d, offset| d.read(offset, data))
    }

    /// Dispatches a write. Returns false when no device claims `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        self.dispatch(addr, |d, offset| d.write(offset, data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Recorder(Vec<(u64, Vec<u8>)>);
    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn dispatches_by_range_and_rejects_overlap() {
        let mut bus = Bus::new();
        let a = Arc::new(Mutex::new(Recorder(vec![])));
        bus.insert(a.clone(), 0x3f8, 8).unwrap();
        bus.insert(Arc::new(Mutex::new(Recorder(vec![]))), 0x60, 1)
            .unwrap();
        assert_eq!(
            bus.insert(Arc::new(Mutex::new(Recorder(vec![]))), 0x3ff, 2),
            Err(BusError::Overlap {
                base: 0x3ff,
                len: 2
            })
        );
        assert_eq!(
            bus.insert(Arc::new(Mutex::new(Recorder(vec![]))), 0x10, 0),
            Err(BusError::EmptyRange(0x10))
        );
        let mut b = [0u8; 1];
        assert!(bus.read(0x3fd, &mut b));
        assert_eq!(b[0], 5);
        assert!(bus.write(0x3f8, &[7]));
        assert!(!bus.write(0x400, &[7]));
        assert!(!bus.read(0x3f7, &mut b));
        assert!(!bus.read(u64::MAX, &mut b));
        assert_eq!(a.lock().unwrap().0, vec![(0, vec![7])]);
    }

    struct Moving(Option<(u64, u64)>, Recorder);
    impl BusDevice for Moving {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            self.1.read(offset, data)
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.1.write(offset, data)
        }
    }
    impl MovableDevice for Moving {
        fn range(&self) -> Option<(u64, u64)> {
            self.0
        }
    }

    #[test]
    fn movable_devices_answer_where_they_are_after_fixed_ranges() {
        let mut bus = Bus::new();
        bus.insert(Arc::new(Mutex::new(Recorder(vec![]))), 0x600, 8)
            .unwrap();
        let m = Arc::new(Mutex::new(Moving(None, Recorder(vec![]))));
        bus.insert_movable(m.clone());
        let mut b = [0u8; 1];
        assert!(!bus.read(0xb008, &mut b));
        m.lock().unwrap().0 = Some((0xb000, 0x40));
        assert!(bus.read(0xb008, &mut b));
        assert_eq!(b[0], 8);
        assert!(!bus.read(0xb040, &mut b));
        // A fixed range wins where the two overlap.
        m.lock().unwrap().0 = Some((0x600, 0x40));
        assert!(bus.write(0x604, &[1]));
        assert!(bus.write(0x610, &[2]));
        assert_eq!(m.lock().unwrap().1 .0, vec![(0x10, vec![2])]);
        m.lock().unwrap().0 = Some((u64::MAX, 0x40));
        assert!(!bus.read(0, &mut b));
    }
}

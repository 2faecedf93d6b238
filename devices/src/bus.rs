//! The port-I/O bus: maps port ranges to devices.
//!
//! The bus is built once before the vCPUs start and is read-only afterwards,
//! so vCPU threads share it without a lock; each device carries its own lock.

use std::sync::{Arc, Mutex};

/// A device on the bus. `offset` is relative to the start of its range.
pub trait BusDevice: Send {
    /// A guest read of `data.len()` bytes at `offset`.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// A guest write of `data` at `offset`.
    fn write(&mut self, offset: u64, data: &[u8]);
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

    fn find(&self, addr: u64) -> Option<(&Entry, u64)> {
        let idx = self.entries.partition_point(|e| e.base <= addr);
        let e = self.entries.get(idx.checked_sub(1)?)?;
        let offset = addr - e.base;
        (offset < e.len).then_some((e, offset))
    }

    /// Dispatches a read. Returns false when no device claims `addr`; the
    /// caller then answers with all ones, like an empty ISA bus.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr) {
            Some((e, offset)) => {
                lock(&e.device).read(offset, data);
                true
            }
            None => false,
        }
    }

    /// Dispatches a write. Returns false when no device claims `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr) {
            Some((e, offset)) => {
                lock(&e.device).write(offset, data);
                true
            }
            None => false,
        }
    }
}

/// Locks a device, recovering it if a thread panicked while holding it:
/// device state stays usable and the VMM keeps running.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
}

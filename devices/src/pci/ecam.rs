//! ECAM (PCI Express's memory-mapped configuration access) for bus 0: the
//! region the ACPI MCFG table names. Each function's configuration space
//! is a 4 KiB page at `device << 15 | function << 12`; a read or write of
//! 1, 2 or 4 bytes reaches the same bytes as ports 0xCF8/0xCFC do.
//!
//! The functions here are conventional PCI: bytes 256-4095 (extended
//! configuration space) read as zero and ignore writes. An access that
//! makes no sense (another size, one that crosses its dword) reads all
//! ones, writes nothing and is counted on the bus; an absent function
//! reads all ones. Driven by whichever vCPU thread exits on the region;
//! takes the bus's lock, then the function's, for one access.

use std::sync::{Arc, Mutex};

use super::{PciBus, SharedFunction, CONFIG_BYTES};
use crate::bus::BusDevice;
use crate::sync::lock;

/// Bytes of ECAM for one bus: 32 devices of 8 functions of 4 KiB.
pub const ECAM_BUS_BYTES: u64 = 1 << 20;

/// Bus 0's ECAM region.
pub struct PciEcam {
    bus: Arc<Mutex<PciBus>>,
}

/// Where an access lands.
enum Target {
    /// A function's conventional configuration space, at this byte.
    Config(SharedFunction, usize),
    /// A present function's extended space: zero.
    Extended,
    /// No function, or a senseless access: all ones.
    Nothing,
}

impl PciEcam {
    /// The ECAM region of `bus`.
    pub fn new(bus: Arc<Mutex<PciBus>>) -> PciEcam {
        PciEcam { bus }
    }

    fn target(&self, offset: u64, len: usize) -> Target {
        let mut bus = lock(&self.bus);
        let reg = (offset & 0xfff) as usize;
        if offset >= ECAM_BUS_BYTES || !matches!(len, 1 | 2 | 4) || (reg & 3) + len > 4 {
            bus.bad_accesses += 1;
            return Target::Nothing;
        }
        // Device and function: the bus's index, `slot * 8 + function`.
        let devfn = ((offset >> 12) & 0xff) as usize;
        let f = match bus.functions.get(devfn) {
            Some(Some(f)) => f.clone(),
            _ => return Target::Nothing,
        };
        if reg < CONFIG_BYTES {
            Target::Config(f, reg)
        } else {
            Target::Extended
        }
    }
}

impl BusDevice for PciEcam {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match self.target(offset, data.len()) {
            Target::Config(f, at) => lock(&f).read_config(at, data),
            Target::Extended => data.fill(0),
            Target::Nothing => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Target::Config(f, at) = self.target(offset, data.len()) {
            lock(&f).write_config(at, data);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ecam() -> (PciEcam, Arc<Mutex<PciBus>>) {
        let bus = Arc::new(Mutex::new(PciBus::new()));
        (PciEcam::new(bus.clone()), bus)
    }

    #[test]
    fn reads_the_same_bytes_as_the_ports() {
        let (mut e, bus) = ecam();
        let mut id = [0u8; 4];
        e.read(0, &mut id);
        assert_eq!(u32::from_le_bytes(id), 0x1237_8086);
        // The same dword through 0xCF8/0xCFC.
        let mut port = [0u8; 4];
        let mut b = lock(&bus);
        b.write(0, &(1u32 << 31).to_le_bytes());
        b.read(4, &mut port);
        assert_eq!(port, id);
        drop(b);
        let mut class = [0u8; 1];
        e.read(0xb, &mut class);
        assert_eq!(class[0], 0x06);
        // A function other than 0: 00:01.3 at 1 << 15 | 3 << 12.
        let pm = crate::pci::ConfigSpace::new(0x8086, 0x7113, 3, [6, 0x80, 0]);
        lock(&bus)
            .add_function(1, 3, Arc::new(Mutex::new(super::super::HostBridge(pm))))
            .unwrap();
        e.read(1 << 15 | 3 << 12, &mut id);
        assert_eq!(u32::from_le_bytes(id), 0x7113_8086);
    }

    #[test]
    fn writes_reach_writable_bits_only() {
        let (mut e, _bus) = ecam();
        e.write(0, &[0xff, 0xff]); // vendor ID: read-only
        e.write(4, &[0x06]); // command: memory + bus master
        let mut v = [0u8; 2];
        e.read(0, &mut v);
        assert_eq!(u16::from_le_bytes(v), 0x8086);
    }

    #[test]
    fn absent_functions_extended_space_and_bad_accesses() {
        let (mut e, bus) = ecam();
        let mut v = [0u8; 4];
        e.read(1 << 15, &mut v); // 00:01.0, empty
        assert_eq!(v, [0xff; 4]);
        e.read(1 << 12, &mut v); // 00:00.1
        assert_eq!(v, [0xff; 4]);
        e.read(0x100, &mut v); // extended space of 00:00.0
        assert_eq!(v, [0; 4]);
        e.write(0x100, &[1, 2, 3, 4]);
        assert_eq!(lock(&bus).bad_accesses(), 0);
        e.read(2, &mut v); // crosses its dword
        assert_eq!(v, [0xff; 4]);
        let mut wide = [0u8; 8];
        e.read(0, &mut wide);
        assert_eq!(wide, [0xff; 8]);
        e.read(ECAM_BUS_BYTES, &mut v);
        e.write(u64::MAX - 1, &[0; 2]);
        assert_eq!(lock(&bus).bad_accesses(), 4);
    }
}

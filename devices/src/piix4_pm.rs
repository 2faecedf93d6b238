//! PIIX4's power-management function (PCI 00:01.3, 8086:7113) on a PCI
//! machine: the function UEFI firmware built for an i440FX board (OVMF)
//! programs, and whose ACPI PM timer it counts its delays with.
//!
//! Its configuration space has PMBA (0x40: the I/O base, bits 15:6, bit 0
//! reads 1) and PMREGMISC (0x80: bit 0, PMIOSE, turns the I/O block on).
//! While on, the 64-port block at PMBA answers (a [`MovableDevice`]: the
//! guest puts it where it likes): PM1a status, enable and control (offsets
//! 0-5, the same registers and the same S5 power-off as the fixed block at
//! 0x600, [`AcpiPm`]) and the PM timer (offset 8: a 24-bit count at
//! 3.579545 MHz of the host's monotonic clock since the VM's process
//! started; after a restore it counts on from 0, a jump like any other
//! wrap of it, which happens every 4.7 s). Anything else in the block
//! reads 0, ignores writes and is counted with the PM1a block's ignored
//! accesses.
//!
//! Driven by whichever vCPU thread exits on its ports or on the PCI bus;
//! locks the shared PM1a block for an access there. Never blocks, never
//! panics on a guest's access.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::acpi_pm::{AcpiPm, ACPI_PM_PORTS};
use crate::bus::{BusDevice, MovableDevice};
use crate::pci::{ConfigSpace, PciFunction, CONFIG_BYTES};
use crate::sync::lock;

/// Ports of the block PMBA places.
pub const PM_IO_PORTS: u64 = 64;
/// The PM timer's offset in the block.
pub const PM_TIMER: u64 = 8;
/// The PM timer's rate, Hz.
pub const PM_TIMER_HZ: u64 = 3_579_545;

const PMBA: usize = 0x40;
const PMBA_BASE_MASK: u32 = 0xffc0;
const PMBA_RTE: u32 = 1;
const PMREGMISC: usize = 0x80;
const PMIOSE: u8 = 1;
const TIMER_MASK: u32 = 0x00ff_ffff;

/// The function: its configuration space and its I/O block.
pub struct Piix4Pm {
    config: ConfigSpace,
    pm1: Arc<Mutex<AcpiPm>>,
    epoch: Instant,
}

impl Piix4Pm {
    /// The function, its PM1a registers being `pm1` (the fixed block's).
    pub fn new(pm1: Arc<Mutex<AcpiPm>>) -> Piix4Pm {
        // Class 06:80:00 (other bridge), revision 3, as QEMU's PIIX4 says.
        let mut config = ConfigSpace::new(0x8086, 0x7113, 0x03, [0x06, 0x80, 0x00]);
        config.set(PMBA, &PMBA_RTE.to_le_bytes());
        config.set_writable(PMBA, &PMBA_BASE_MASK.to_le_bytes());
        config.set_writable(PMREGMISC, &[PMIOSE]);
        Piix4Pm {
            config,
            pm1,
            epoch: Instant::now(),
        }
    }

    /// The PM timer's count now.
    fn timer(&self) -> u32 {
        let ns = self.epoch.elapsed().as_nanos();
        let ticks = ns * u128::from(PM_TIMER_HZ) / 1_000_000_000;
        (ticks as u32) & TIMER_MASK
    }

    /// The byte of the timer an access of `len` bytes at `offset` starts
    /// at, if it stays inside the timer's dword.
    fn timer_byte(offset: u64, len: usize) -> Option<usize> {
        let byte = usize::try_from(offset.checked_sub(PM_TIMER)?).ok()?;
        (matches!(len, 1 | 2 | 4) && byte + len <= 4).then_some(byte)
    }
}

impl PciFunction for Piix4Pm {
    fn config(&self) -> &ConfigSpace {
        &self.config
    }
    fn write_config(&mut self, at: usize, data: &[u8]) {
        self.config.write(at, data);
    }
    fn restore_config(&mut self, saved: &[u8; CONFIG_BYTES]) {
        self.config.restore(saved);
    }
}

impl MovableDevice for Piix4Pm {
    fn range(&self) -> Option<(u64, u64)> {
        if self.config.bytes()[PMREGMISC] & PMIOSE == 0 {
            return None;
        }
        let base = self.config.dword(PMBA) & PMBA_BASE_MASK;
        Some((u64::from(base), PM_IO_PORTS))
    }
}

impl BusDevice for Piix4Pm {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset < ACPI_PM_PORTS {
            lock(&self.pm1).read(offset, data);
        } else if let Some(byte) = Self::timer_byte(offset, data.len()) {
            let t = self.timer().to_le_bytes();
            data.copy_from_slice(&t[byte..byte + data.len()]);
        } else {
            lock(&self.pm1).note_ignored();
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset < ACPI_PM_PORTS {
            lock(&self.pm1).write(offset, data);
        } else {
            // The timer is read-only; nothing else is here.
            lock(&self.pm1).note_ignored();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn function() -> (Piix4Pm, Arc<AtomicU32>) {
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        let pm1 = AcpiPm::new(Box::new(move || {
            c.fetch_add(1, Ordering::SeqCst);
        }));
        (Piix4Pm::new(Arc::new(Mutex::new(pm1))), calls)
    }

    fn timer(f: &mut Piix4Pm) -> u32 {
        let mut b = [0u8; 4];
        f.read(PM_TIMER, &mut b);
        u32::from_le_bytes(b)
    }

    #[test]
    fn firmware_programs_the_block_and_counts_on_the_timer() {
        let (mut f, calls) = function();
        assert_eq!(f.config().dword(0), 0x7113_8086);
        assert_eq!(f.config().dword(PMBA), 1);
        assert_eq!(f.range(), None);
        // What OVMF's PlatformPei does on i440FX: PMBA 0xB000, then PMIOSE.
        f.write_config(PMBA, &0xb000u32.to_le_bytes());
        assert_eq!(f.range(), None);
        f.write_config(PMREGMISC, &[0xff]);
        assert_eq!(f.config().bytes()[PMREGMISC], PMIOSE);
        assert_eq!(f.range(), Some((0xb000, PM_IO_PORTS)));
        assert_eq!(f.config().dword(PMBA), 0xb001);
        // Low base bits are not writable.
        f.write_config(PMBA, &0xb03fu32.to_le_bytes());
        assert_eq!(f.range(), Some((0xb000, PM_IO_PORTS)));
        // The timer runs at 3.58 MHz: 10 ms are about 35,800 ticks.
        let a = timer(&mut f);
        std::thread::sleep(std::time::Duration::from_millis(10));
        let b = timer(&mut f);
        let ticks = b.wrapping_sub(a) & TIMER_MASK;
        assert!((35_000..200_000).contains(&ticks), "{ticks} ticks in 10 ms");
        assert_eq!(b & !TIMER_MASK, 0);
        // S5 through the block powers off like the fixed block.
        f.write(4, &((5u16 << 10) | (1 << 13)).to_le_bytes());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn odd_accesses_are_counted_and_harmless() {
        let (mut f, _) = function();
        let mut b = [0xffu8; 4];
        f.read(0x20, &mut b);
        assert_eq!(b, [0; 4]);
        f.read(PM_TIMER + 2, &mut b); // crosses the timer's dword
        f.read(PM_TIMER + 3, &mut [0u8; 1]); // a byte of it: fine
        f.write(PM_TIMER, &[1, 2, 3, 4]);
        f.read(u64::MAX, &mut b);
        f.read(PM_TIMER, &mut [0u8; 8]);
        assert_eq!(lock(&f.pm1).ignored_accesses(), 5);
        // A saved configuration space gives back PMBA and PMIOSE only.
        let mut saved = [0u8; CONFIG_BYTES];
        saved[PMBA..PMBA + 2].copy_from_slice(&0x0600u16.to_le_bytes());
        saved[PMREGMISC] = 0xff;
        saved[0] = 0x12;
        f.restore_config(&saved);
        assert_eq!(f.range(), Some((0x600, PM_IO_PORTS)));
        assert_eq!(f.config().dword(0), 0x7113_8086);
    }
}

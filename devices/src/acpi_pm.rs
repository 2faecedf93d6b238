//! The ACPI PM1a register block of a PCI machine (ports 0x600-0x605, named
//! by the FADT): event status, event enable and control. It is how an ACPI
//! guest powers itself off.
//!
//! Linux (and Windows) power off by writing `SLP_TYPx << 10 | SLP_EN` to
//! PM1a_CNT, with `SLP_TYPx` from the DSDT's `\_S5_` package (tandem's is
//! 5). That write is the only thing this block acts on: it calls the VMM's
//! power-off hook once. No fixed event ever happens (the FADT says there
//! are no fixed power or sleep buttons, no PM timer, and the RTC's
//! interrupts are not emulated), so the status register reads 0 and
//! ignores writes, and the control register reads SCI_EN alone (the
//! machine is always in ACPI mode; the FADT has no SMI command port). The
//! enable register keeps the event bits the guest writes, as the hardware
//! register does: ACPICA reads an enable bit back after setting it and
//! logs "Could not enable ... event" at error level when it did not stick
//! (Linux enables the global lock's and the RTC's at boot). Those bits
//! gate no event; a snapshot, a migration and a COLO checkpoint carry
//! them ([`AcpiPm::enable`], with the PCI bus's state). Other sleep states are not
//! offered in the DSDT: a
//! write asking for one is ignored and counted, as is any access that
//! makes no sense. Driven by whichever vCPU thread exits on the ports; it
//! never blocks and never panics on a guest's access.

use crate::bus::BusDevice;

/// The first port of the block.
pub const ACPI_PM_PORT: u64 = 0x600;
/// Ports the block takes: PM1a_EVT (status, enable), PM1a_CNT.
pub const ACPI_PM_PORTS: u64 = 6;
/// Bytes of PM1a_EVT_BLK and PM1a_CNT_BLK, as the FADT gives them.
pub const PM1_EVT_LEN: u8 = 4;
pub const PM1_CNT_LEN: u8 = 2;
/// `SLP_TYPx` of S5 (soft off), as the DSDT's `\_S5_` names it.
pub const S5_SLEEP_TYPE: u8 = 5;

const ENABLE: u64 = 2;
const CONTROL: u64 = 4;
/// PM1_EN's defined bits: TMR_EN, GBL_EN, PWRBTN_EN, SLPBTN_EN, RTC_EN,
/// PCIEXP_WAKE_DIS (ACPI 6.5, table 4.13); the reserved ones read 0.
const ENABLE_BITS: u16 = 1 | 1 << 5 | 1 << 8 | 1 << 9 | 1 << 10 | 1 << 14;
const SCI_EN: u16 = 1;
const SLP_EN: u16 = 1 << 13;
const SLP_TYP_SHIFT: u16 = 10;
const SLP_TYP_MASK: u16 = 0x7;

/// The registers; `power_off` runs (once) when the guest enters S5.
pub struct AcpiPm {
    power_off: Option<Box<dyn FnOnce() + Send>>,
    enable: u16,
    ignored: u64,
}

impl AcpiPm {
    /// A block that calls `power_off` when the guest asks for S5.
    pub fn new(power_off: Box<dyn FnOnce() + Send>) -> AcpiPm {
        AcpiPm {
            power_off: Some(power_off),
            enable: 0,
            ignored: 0,
        }
    }

    /// PM1_EN as the guest last wrote it.
    pub fn enable(&self) -> u16 {
        self.enable
    }

    /// Sets PM1_EN (a restore); reserved bits stay 0.
    pub fn set_enable(&mut self, v: u16) {
        self.enable = v & ENABLE_BITS;
    }

    /// Accesses that asked for nothing this block does (another sleep
    /// state, an access crossing a register).
    pub fn ignored_accesses(&self) -> u64 {
        self.ignored
    }

    /// Counts an access to a block that shares these registers (PIIX4's,
    /// `piix4_pm`) that reached none of its own.
    pub fn note_ignored(&mut self) {
        self.ignored += 1;
    }

    /// The 16-bit register an access of `len` bytes at `offset` lands in,
    /// and the byte in it; `None` (counted) if it crosses a register.
    fn register(&mut self, offset: u64, len: usize) -> Option<(u64, usize)> {
        let reg = offset & !1;
        let byte = (offset & 1) as usize;
        if !matches!(len, 1 | 2) || byte + len > 2 || offset >= ACPI_PM_PORTS {
            self.ignored += 1;
            return None;
        }
        Some((reg, byte))
    }

    fn control_written(&mut self, v: u16) {
        if v & SLP_EN == 0 {
            return;
        }
        let sleep_type = (v >> SLP_TYP_SHIFT) & SLP_TYP_MASK;
        match self.power_off.take() {
            Some(hook) if sleep_type == u16::from(S5_SLEEP_TYPE) => hook(),
            other => {
                self.power_off = other;
                self.ignored += 1;
            }
        }
    }
}

impl BusDevice for AcpiPm {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let Some((reg, byte)) = self.register(offset, data.len()) else {
            return;
        };
        let v = match reg {
            CONTROL => SCI_EN,
            ENABLE => self.enable,
            _ => 0,
        };
        data.copy_from_slice(&v.to_le_bytes()[byte..byte + data.len()]);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some((reg, byte)) = self.register(offset, data.len()) else {
            return;
        };
        match reg {
            ENABLE => {
                let mut b = self.enable.to_le_bytes();
                b[byte..byte + data.len()].copy_from_slice(data);
                self.enable = u16::from_le_bytes(b) & ENABLE_BITS;
            }
            CONTROL => {
                // SLP_TYP and SLP_EN are both in the high byte: a byte
                // write there says all of it.
                let mut b = [0u8; 2];
                b[byte..byte + data.len()].copy_from_slice(data);
                self.control_written(u16::from_le_bytes(b));
            }
            // Status (write 1 to clear): nothing to clear.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    fn block() -> (AcpiPm, Arc<AtomicU32>) {
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        let pm = AcpiPm::new(Box::new(move || {
            c.fetch_add(1, Ordering::SeqCst);
        }));
        (pm, calls)
    }

    fn s5() -> [u8; 2] {
        ((u16::from(S5_SLEEP_TYPE) << SLP_TYP_SHIFT) | SLP_EN).to_le_bytes()
    }

    #[test]
    fn s5_powers_off_once() {
        let (mut pm, calls) = block();
        // What ACPICA's legacy sleep does: SLP_TYP first, then with SLP_EN.
        pm.write(
            CONTROL,
            &(u16::from(S5_SLEEP_TYPE) << SLP_TYP_SHIFT).to_le_bytes(),
        );
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        pm.write(CONTROL, &s5());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        pm.write(CONTROL, &s5());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(pm.ignored_accesses(), 1);
    }

    #[test]
    fn s5_by_bytes_and_other_states() {
        let (mut pm, calls) = block();
        pm.write(CONTROL, &((3 << SLP_TYP_SHIFT) | SLP_EN).to_le_bytes()); // S3
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        let b = s5();
        pm.write(CONTROL, &b[..1]);
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        pm.write(CONTROL + 1, &b[1..]);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(pm.ignored_accesses(), 1);
    }

    #[test]
    fn registers_read_back_and_bad_accesses_are_counted() {
        let (mut pm, calls) = block();
        let mut v = [0xffu8; 2];
        pm.read(CONTROL, &mut v);
        assert_eq!(u16::from_le_bytes(v), SCI_EN);
        // Enable keeps its defined bits (what ACPICA reads back), by
        // bytes too; reserved bits read 0.
        pm.write(ENABLE, &[0x21, 0x01]);
        pm.read(ENABLE, &mut v);
        assert_eq!(v, [0x21, 0x01]);
        pm.write(ENABLE + 1, &[0xff]);
        pm.read(ENABLE, &mut v);
        assert_eq!(u16::from_le_bytes(v), 0x21 | 0x4700);
        // What a restore sets reads back the same, reserved bits dropped.
        pm.set_enable(0xffff);
        assert_eq!(pm.enable(), ENABLE_BITS);
        pm.write(ENABLE, &[0; 2]);
        pm.read(ENABLE, &mut v);
        assert_eq!(v, [0, 0]);
        assert_eq!(pm.enable(), 0);
        pm.write(0, &[0xff, 0xff]); // status: write-1-to-clear
        pm.read(0, &mut v);
        assert_eq!(v, [0, 0]);
        let mut wide = [0xffu8; 4];
        pm.read(0, &mut wide); // crosses registers
        assert_eq!(wide, [0; 4]);
        pm.write(1, &[0, 0]);
        pm.write(CONTROL, &[0; 8]);
        pm.write(ACPI_PM_PORTS, &[0]);
        pm.write(CONTROL, &[]);
        assert_eq!(pm.ignored_accesses(), 5);
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }
}

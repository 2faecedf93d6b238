//! A PCI machine's guest-facing registers as the vCPUs reach them: ports
//! 0xCF8-0xCFF, ECAM, the BAR window (with a virtio-pci block function in
//! slot 1, whose BAR the guest may move and whose memory decoding it may
//! turn on or off), the ACPI PM1a block and PIIX4's PM function at 00:01.3
//! (its configuration space through the ports and ECAM, its I/O block
//! wherever the guest put it). Any sequence of accesses must be served
//! without a panic; the power-off hook runs at most once.
//!
//! Input: 8 bytes per access: `ctl`, a little-endian 24-bit offset, a
//! little-endian 32-bit value. `ctl` bit 0: read (1) or write (0); bits
//! 1-2: width 1, 2, 4 or 8; bits 3-4: ports (offset modulo 8), ECAM
//! (offset modulo 1 MiB + 16), the window (offset modulo 64 KiB), the PM1a
//! block (offset modulo 8) or, with offset bit 23, the PM function's
//! block (offset modulo 64).
#![no_main]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use devices::acpi_pm::AcpiPm;
use devices::pci::{PciBus, PciEcam, PciWindow, ECAM_BUS_BYTES, PM_FUNCTION};
use devices::piix4_pm::Piix4Pm;
use devices::{BusDevice, MovableDevice};
use libfuzzer_sys::fuzz_target;
use tandem_fuzz::fixtures::{self, small_memory};

const WINDOW: u64 = 0xe000_0000;

fn access(dev: &mut dyn BusDevice, read: bool, at: u64, data: &mut [u8]) {
    if read {
        dev.read(at, data);
    } else {
        dev.write(at, data);
    }
}

fuzz_target!(|data: &[u8]| {
    let bus = Arc::new(Mutex::new(PciBus::new()));
    let (transport, _state) = fixtures::pci_block(small_memory());
    bus.lock()
        .unwrap()
        .add(1, Arc::new(Mutex::new(transport)))
        .unwrap();
    let mut ecam = PciEcam::new(bus.clone());
    let mut window = PciWindow::new(bus.clone(), WINDOW);
    let offs = Arc::new(AtomicU32::new(0));
    let o = offs.clone();
    let pm = Arc::new(Mutex::new(AcpiPm::new(Box::new(move || {
        o.fetch_add(1, Ordering::SeqCst);
    }))));
    let piix = Arc::new(Mutex::new(Piix4Pm::new(pm.clone())));
    let (slot, function) = PM_FUNCTION;
    bus.lock()
        .unwrap()
        .add_function(slot, function, piix.clone())
        .unwrap();
    for op in data.chunks_exact(8) {
        let ctl = op[0];
        let offset = u64::from(u32::from_le_bytes([op[1], op[2], op[3], 0]));
        let len = 1 << ((ctl >> 1) & 3);
        let mut bytes = [0u8; 8];
        bytes[..4].copy_from_slice(&op[4..8]);
        bytes[4..].copy_from_slice(&op[4..8]);
        let data = &mut bytes[..len];
        let read = ctl & 1 != 0;
        match (ctl >> 3) & 3 {
            0 => access(&mut *bus.lock().unwrap(), read, offset % 8, data),
            1 => access(&mut ecam, read, offset % (ECAM_BUS_BYTES + 16), data),
            2 => access(&mut window, read, offset % 0x1_0000, data),
            _ if offset & (1 << 23) != 0 => {
                let mut p = piix.lock().unwrap();
                let _ = p.range();
                access(&mut *p, read, offset % 64, data)
            }
            _ => access(&mut *pm.lock().unwrap(), read, offset % 8, data),
        }
    }
    assert!(offs.load(Ordering::SeqCst) <= 1, "power-off ran twice");
});

//! A hostile driver on a virtio-pci function: configuration-space and BAR
//! accesses from fuzzer bytes (BAR sizing and moves, MSI-X enable and
//! masks, the common configuration, the MSI-X table and pending bits, the
//! notify area, the device configuration), then the save → restore round
//! trip every state the function reached must pass.
//!
//! Input: 8 bytes per access: `ctl`, a little-endian 16-bit offset, a
//! byte left unused, a little-endian 32-bit value. `ctl` bit 0: read (1)
//! or write (0); bits 1-2: width 1, 2, 4 or 8; bit 3: configuration space
//! (offset modulo 256) instead of the BAR (offset modulo the BAR's size
//! plus 16, so that accesses run past its end too).

use std::io;

use devices::pci::{PciFunction, CONFIG_BYTES};
use devices::virtio::pci::{MsiRoutes, NotifyArea, PciTransport, BAR_SIZE};
use migration::Snapshottable;

use crate::mmio::live;

/// Hooks that accept everything (no KVM here).
pub struct NoKvm;

impl MsiRoutes for NoKvm {
    fn set(&mut self, _vector: usize, _address: u64, _data: u32) -> io::Result<()> {
        Ok(())
    }
}

impl NotifyArea for NoKvm {
    fn moved(&mut self, _at: Option<u64>) -> io::Result<()> {
        Ok(())
    }
}

/// A function and a probe of whether its device runs.
pub struct Probed {
    /// The function.
    pub transport: PciTransport,
    /// Whether the device behind it runs.
    pub running: Box<dyn Fn() -> bool>,
}

/// Plays the accesses in `ops` on `d`; after each one the device runs
/// exactly when the status says it does.
pub fn drive(d: &mut Probed, ops: &[u8]) {
    for op in ops.chunks_exact(8) {
        let ctl = op[0];
        let offset = u64::from(u16::from_le_bytes([op[1], op[2]]));
        let len = 1 << ((ctl >> 1) & 3);
        let mut bytes = [0u8; 8];
        bytes[..4].copy_from_slice(&op[4..8]);
        bytes[4..].copy_from_slice(&op[4..8]);
        let t = &mut d.transport;
        if ctl & 8 != 0 {
            let at = (offset as usize) % CONFIG_BYTES;
            let len = len.min(CONFIG_BYTES - at);
            if ctl & 1 != 0 {
                t.config().read(at, &mut bytes[..len]);
            } else {
                t.write_config(at, &bytes[..len]);
            }
        } else {
            let at = offset % (u64::from(BAR_SIZE) + 16);
            if ctl & 1 != 0 {
                t.read_bar(at, &mut bytes[..len]);
            } else {
                t.write_bar(at, &bytes[..len]);
            }
        }
        assert_eq!(
            (d.running)(),
            live(d.transport.status()),
            "device running vs status {:#x}",
            d.transport.status()
        );
    }
}

/// Saves `d`, restores the state (and the configuration space, as the PCI
/// bus's section carries it) into `fresh`: the restore must accept it,
/// save the same again, and run the device exactly when the state says so.
pub fn round_trip(d: &mut Probed, mut fresh: Probed) {
    let state = d.transport.save().expect("save a transport");
    let config = *d.transport.config().bytes();
    if let Err(e) = fresh.transport.check_state(&state.0, &state.1) {
        panic!("check_state refused a saved state: {e}\n{state:#x?}");
    }
    if let Err(e) = fresh.transport.restore(&state) {
        panic!("restore refused a saved state: {e}\n{state:#x?}");
    }
    fresh.transport.restore_config(&config);
    assert_eq!(
        fresh.transport.save().expect("save the restored transport"),
        state,
        "saved again after the restore"
    );
    assert_eq!(
        fresh.transport.config().bytes(),
        &config,
        "configuration space after the restore"
    );
    assert_eq!(
        (fresh.running)(),
        live(state.0.status),
        "running after restore"
    );
}

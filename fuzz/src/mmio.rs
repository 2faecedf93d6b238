//! A hostile driver on a virtio-mmio transport: register reads and writes
//! from fuzzer bytes, then the save → restore round trip every state the
//! transport reached must pass.
//!
//! Input: 6 bytes per access: `ctl`, `offset`, a little-endian value.
//! `ctl` bit 0: read (1) or write (0); bits 1-2: width 1, 2, 4 or 8;
//! bit 3: configuration space (0x100 + offset) instead of registers.

use devices::virtio::mmio::MmioTransport;
use devices::BusDevice;
use migration::Snapshottable;

/// A transport and a probe of whether its device runs (has been activated
/// and not reset since).
pub struct Probed {
    /// The transport.
    pub transport: MmioTransport,
    /// Whether the device behind it runs.
    pub running: Box<dyn Fn() -> bool>,
}

/// Whether a device in this status runs (DRIVER_OK after FEATURES_OK, and
/// no DEVICE_NEEDS_RESET).
pub fn live(status: u32) -> bool {
    status & 0xc == 0xc && status & 0x40 == 0
}

/// Plays the accesses in `ops` on `d`; after each one the device runs
/// exactly when the status says it does.
pub fn drive(d: &mut Probed, ops: &[u8]) {
    for op in ops.chunks_exact(6) {
        let (ctl, offset) = (op[0], u64::from(op[1]));
        let len = 1 << ((ctl >> 1) & 3);
        let offset = if ctl & 8 != 0 { 0x100 + offset } else { offset };
        let mut bytes = [0u8; 8];
        bytes[..4].copy_from_slice(&op[2..6]);
        bytes[4..].copy_from_slice(&op[2..6]);
        if ctl & 1 != 0 {
            d.transport.read(offset, &mut bytes[..len]);
        } else {
            d.transport.write(offset, &bytes[..len]);
        }
        assert_eq!(
            (d.running)(),
            live(d.transport.status()),
            "device running vs status {:#x}",
            d.transport.status()
        );
    }
}

/// What the driver reads at every register and the first configuration
/// bytes (reads change nothing).
pub fn reads(t: &mut MmioTransport) -> Vec<u32> {
    let mut out = Vec::new();
    for off in (0..0x100).step_by(4).chain((0x100..0x140).step_by(4)) {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        out.push(u32::from_le_bytes(b));
    }
    out
}

/// Saves `d`, restores the state into `fresh` (built for the same device):
/// the restore must accept it, save the same state again, read back the
/// same registers, and run the device exactly when the state says so.
pub fn round_trip(d: &mut Probed, mut fresh: Probed) {
    let state = d.transport.save().expect("save a transport");
    if let Err(e) = fresh.transport.check_state(&state) {
        panic!("check_state refused a saved state: {e}\n{state:#x?}");
    }
    if let Err(e) = fresh.transport.restore(&state) {
        panic!("restore refused a saved state: {e}\n{state:#x?}");
    }
    assert_eq!(
        fresh.transport.save().expect("save the restored transport"),
        state,
        "saved again after the restore"
    );
    assert_eq!(
        reads(&mut fresh.transport),
        reads(&mut d.transport),
        "registers after the restore"
    );
    assert_eq!(
        (fresh.running)(),
        live(state.status),
        "running after restore"
    );
}

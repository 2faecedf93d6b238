//! The virtio-mmio transport (guest-controlled registers) in front of a
//! virtio-blk device: any sequence of reads and writes must be served
//! without a panic, and whatever state it leaves must save, restore into a
//! fresh transport and read back the same there, with the device running
//! there exactly when it ran here.
//!
//! Input: 6 bytes per access: `ctl`, `offset`, a little-endian value.
//! `ctl` bit 0: read (1) or write (0); bits 1-2: width 1, 2, 4 or 8;
//! bit 3: configuration space (0x100 + offset) instead of registers.
#![no_main]

use std::fs::File;
use std::sync::{Arc, Mutex, OnceLock};

use devices::virtio::block::device::BlockState;
use devices::virtio::block::disk::DiskFile;
use devices::virtio::block::{Block, BlockConfig};
use devices::virtio::mmio::{Interrupt, MmioTransport};
use devices::{BusDevice, GuestMemoryMmap};
use libfuzzer_sys::fuzz_target;
use migration::Snapshottable;
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Guest memory (64 KiB) and a 64 KiB disk image, shared by every input.
/// Neither is written: the block handler never runs here.
fn fixtures() -> &'static (GuestMemoryMmap, File) {
    static FIXTURES: OnceLock<(GuestMemoryMmap, File)> = OnceLock::new();
    FIXTURES.get_or_init(|| {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let path = std::env::temp_dir().join(format!("tandem-fuzz-{}.img", std::process::id()));
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        file.set_len(0x10000).unwrap();
        (mem, file)
    })
}

/// A fresh transport in front of a fresh virtio-blk device, and the
/// device's state (whether it runs).
fn transport() -> (MmioTransport, Arc<Mutex<BlockState>>) {
    let (mem, file) = fixtures();
    let disk = DiskFile::from_file(file.try_clone().unwrap(), "fuzz.img".as_ref(), false).unwrap();
    let block = Block::new(
        BlockConfig::with_id("fuzz"),
        disk,
        EventFd::new(EFD_NONBLOCK).unwrap(),
    );
    let state = block.state();
    let interrupt = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    let evts = vec![EventFd::new(EFD_NONBLOCK).unwrap()];
    let t = MmioTransport::new(Box::new(block), mem.clone(), interrupt, evts).unwrap();
    (t, state)
}

/// Whether a device in this status runs (DRIVER_OK after FEATURES_OK, and
/// no DEVICE_NEEDS_RESET).
fn live(status: u32) -> bool {
    status & 0xc == 0xc && status & 0x40 == 0
}

/// What the driver reads at every register and the first configuration
/// bytes (reads change nothing).
fn reads(t: &mut MmioTransport) -> Vec<u32> {
    let mut out = Vec::new();
    for off in (0..0x100).step_by(4).chain((0x100..0x140).step_by(4)) {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        out.push(u32::from_le_bytes(b));
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let (mut t, dev) = transport();
    for op in data.chunks_exact(6) {
        let (ctl, offset) = (op[0], u64::from(op[1]));
        let len = 1 << ((ctl >> 1) & 3);
        let offset = if ctl & 8 != 0 { 0x100 + offset } else { offset };
        let mut bytes = [0u8; 8];
        bytes[..4].copy_from_slice(&op[2..6]);
        bytes[4..].copy_from_slice(&op[2..6]);
        if ctl & 1 != 0 {
            t.read(offset, &mut bytes[..len]);
        } else {
            t.write(offset, &bytes[..len]);
        }
        assert_eq!(dev.lock().unwrap().active.is_some(), live(t.status()));
    }
    let state = t.save().unwrap();
    let (mut fresh, fresh_dev) = transport();
    if let Err(e) = fresh.restore(&state) {
        panic!("restore refused a saved state: {e}\n{state:#x?}");
    }
    assert_eq!(
        fresh.save().unwrap(),
        state,
        "saved again after the restore"
    );
    assert_eq!(
        reads(&mut fresh),
        reads(&mut t),
        "registers after the restore"
    );
    assert_eq!(
        fresh_dev.lock().unwrap().active.is_some(),
        live(state.status)
    );
});

//! The virtio-pci transport (guest-controlled configuration space and BAR)
//! in front of a virtio-blk device: any sequence of accesses must be
//! served without a panic, and whatever state it leaves must save, restore
//! into a fresh function and save the same there, with the device running
//! there exactly when it ran here.
//!
//! Input: 8 bytes per access (see `tandem_fuzz::pci`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_fuzz::fixtures::{self, small_memory};
use tandem_fuzz::pci::{self, Probed};

fn block() -> Probed {
    let (transport, state) = fixtures::pci_block(small_memory());
    Probed {
        transport,
        running: Box::new(move || state.lock().unwrap().active.is_some()),
    }
}

fuzz_target!(|data: &[u8]| {
    let mut d = block();
    pci::drive(&mut d, data);
    pci::round_trip(&mut d, block());
});

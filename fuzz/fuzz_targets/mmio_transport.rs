//! The virtio-mmio transport (guest-controlled registers) in front of a
//! virtio-blk device: any sequence of reads and writes must be served
//! without a panic, and whatever state it leaves must save, restore into a
//! fresh transport and read back the same there, with the device running
//! there exactly when it ran here.
//!
//! Input: 6 bytes per access (see `tandem_fuzz::mmio`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_fuzz::fixtures::{self, small_memory};
use tandem_fuzz::mmio::{self, Probed};

fn block() -> Probed {
    let (transport, state) = fixtures::block(small_memory(), "fuzz", false);
    Probed {
        transport,
        running: Box::new(move || state.lock().unwrap().active.is_some()),
    }
}

fuzz_target!(|data: &[u8]| {
    let mut d = block();
    mmio::drive(&mut d, data);
    mmio::round_trip(&mut d, block());
});

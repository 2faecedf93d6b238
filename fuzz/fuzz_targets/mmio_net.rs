//! The virtio-mmio transport in front of a virtio-net device (on a real
//! tap, shared by every input: see `tandem_fuzz::fixtures`): any sequence
//! of register reads and writes must be served without a panic, and
//! whatever state it leaves must save and restore into a fresh transport
//! (a refused restore of a state the transport reached is a finding), read
//! back the same there, with the device running exactly when it ran here.
//!
//! Input: byte 0 bit 0: RSC on (the device then offers RSC_EXT); then
//! 6 bytes per access (see `tandem_fuzz::mmio`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_fuzz::fixtures::{self, small_memory};
use tandem_fuzz::mmio::{self, Probed};

const MAC: [u8; 6] = [0x02, 0x54, 0x4e, 0x00, 0x00, 0x01];

fn net(rsc: bool) -> Probed {
    let (transport, state) = fixtures::net(small_memory(), MAC, rsc);
    Probed {
        transport,
        running: Box::new(move || state.lock().unwrap().active.is_some()),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, ops)) = data.split_first() else {
        return;
    };
    let rsc = mode & 1 != 0;
    let mut d = net(rsc);
    mmio::drive(&mut d, ops);
    mmio::round_trip(&mut d, net(rsc));
});

//! A migration stream into the destination's receive short of KVM
//! (`tandem_fuzz::stream`: handshake, manifest check, memory batches checked
//! against the destination's layout and written, the state image checked
//! as a restore checks it): refused or taken, never a panic, a write
//! outside guest memory or an allocation over the frame limit.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tandem_fuzz::stream::receive(data);
});

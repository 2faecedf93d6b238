//! A migration over several streams (`--connections N`) into the
//! destination's receive short of KVM (`tandem_fuzz::stream::
//! receive_streams`: the main stream as `migration_stream` takes it, with
//! `Streams`, and up to three other streams read at once, each up to its
//! `Commit`): refused or taken, never a panic, a hang, a write outside
//! guest memory or an allocation over the frame limit.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tandem_fuzz::stream::receive_streams(data);
});

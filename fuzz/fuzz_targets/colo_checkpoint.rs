//! A COLO checkpoint into the secondary's reader short of KVM
//! (`tandem_fuzz::checkpoint`: batches checked and bounded, one state image
//! checked as a restore checks it, the commit; then the pages written):
//! refused or taken, never a panic, a write outside guest memory or an
//! allocation over the guest's size.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tandem_fuzz::checkpoint::receive(data);
});

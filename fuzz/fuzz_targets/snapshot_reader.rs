//! A snapshot file through the whole restore path short of KVM
//! (`tandem_fuzz::restore`: the container verified, every section read,
//! manifest, VM and vCPU states converted for KVM, device states checked
//! against fresh devices and restored, the memory image read into guest
//! memory): refused or restored, never a panic, an out-of-bounds access or
//! an allocation the file does not pay for.
//!
//! Input, two forms:
//! - a snapshot file (it starts with the magic). Most mutations break its
//!   CRC, which stops the reader at once, so one that ends in something
//!   like a trailer is also tried resealed (total length and CRC made
//!   right) to reach what lies behind the CRC;
//! - anything else: sections, which the target writes into a well-formed
//!   file (`tandem_fuzz::restore::assemble`), so that mutations that change
//!   a section's length reach the state decoders and the checks behind
//!   them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use migration::format::MAGIC;
use tandem_fuzz::restore::{assemble, resealed, restore};

fuzz_target!(|data: &[u8]| {
    if data.starts_with(&MAGIC) {
        let _ = restore(data);
        if let Some(fixed) = resealed(data) {
            let _ = restore(&fixed);
        }
    } else {
        let _ = restore(&assemble(data));
    }
});

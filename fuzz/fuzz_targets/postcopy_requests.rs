//! The destination's messages to a post-copy source (`PageRequest`s, then
//! `Done`) through the source's reading of them
//! (`vmm::migrate::postcopy::serve::requests`): each request checked
//! against the guest's layout and taken from the pages still to send at
//! most once; never a panic, and the count of pages left never goes wrong.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tandem_fuzz::postcopy::requests(data);
});

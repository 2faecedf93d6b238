//! Control API requests (one JSON line from any local client): parse or
//! refuse, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = vmm::api::Request::parse(data);
});

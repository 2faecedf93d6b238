//! Control API requests (one JSON line from any local client): parse or
//! refuse, never panic; a request taken serializes (as `tandem ctl` sends
//! it) to a line that parses back to the same request.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::api::Request;

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = Request::parse(data) {
        let line = serde_json::to_vec(&req).expect("a parsed request serializes");
        assert_eq!(Request::parse(&line).ok(), Some(req), "round trip");
    }
});

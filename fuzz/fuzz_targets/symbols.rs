//! Symbol files (`--guest-symbols`, user input): ELF bytes and System.map
//! text must parse or be refused, never panic; lookups stay in bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::profile::symbols::Symbols;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = Symbols::from_elf(data) {
        let _ = s.lookup(0xffff_ffff_8100_0000);
    }
    let s = Symbols::from_system_map(&String::from_utf8_lossy(data));
    for addr in [0, u64::MAX, 0xffff_ffff_8100_0000] {
        let _ = s.lookup(addr);
    }
});

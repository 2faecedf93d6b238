//! The guest profiler's stack walk on hostile guest memory: the input is
//! a page of page tables and stack words (guest-controlled) plus the
//! registers of the sample. The walk must end, stay within MAX_DEPTH and
//! never panic, whatever the memory holds.
#![no_main]

use devices::GuestMemoryMmap;
use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress};
use vmm::profile::stack::{kernel_chain, translate, Paging, MAX_DEPTH};

const MEM: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    if data.len() < 48 {
        return;
    }
    let word = |i: usize| u64::from_le_bytes(data[i * 8..i * 8 + 8].try_into().unwrap());
    let (rip, rbp, rsp, cr3, cr4, va) = (word(0), word(1), word(2), word(3), word(4), word(5));
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
    // The rest of the input is scattered over guest memory, 8 bytes at an
    // address the input also picks, so page tables can point into it.
    for chunk in data[48..].chunks_exact(16) {
        let at = u64::from_le_bytes(chunk[..8].try_into().unwrap()) % (MEM as u64 - 8);
        let _ = mem.write_slice(&chunk[8..], GuestAddress(at & !7));
    }
    let paging = Paging {
        cr0: 1 << 31,
        cr3,
        cr4,
        efer: 1 << 10,
    };
    let _ = translate(&mem, &paging, va);
    let (chain, _) = kernel_chain(&mem, &paging, rip, rbp, rsp);
    assert!(!chain.is_empty() && chain.len() <= MAX_DEPTH);
});

//! The instructions tandem completes for KVM's emulator, as a guest
//! controls them: any bytes at RIP (decoded in 64-bit or 32-bit mode) and,
//! for an x87 instruction, any register file, control and status words,
//! memory operand and RFLAGS. Decoding and executing must never panic,
//! and a decoded length never exceeds the bytes given.
//!
//! Input: byte 0 bit 0: 64-bit mode; bytes 1-15: the instruction; bytes
//! 16-95: the eight registers (10 bytes each, stack order); 96-97 FCW,
//! 98-99 FSW, 100 the abridged tag word; 101-110 the memory operand; 111-118
//! RFLAGS.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::host_emu::emulation::{decide, Completion};
use vmm::host_emu::x87::{execute, X87};

fuzz_target!(|data: &[u8]| {
    let mut d = [0u8; 119];
    let n = data.len().min(d.len());
    d[..n].copy_from_slice(&data[..n]);
    let long = d[0] & 1 != 0;
    let insn = &d[1..1 + data.len().saturating_sub(1).min(15)];
    let (op, len) = match decide(insn, long) {
        Completion::X87(op, decoded) => (Some(op), decoded.len),
        Completion::Fpu(f) => (None, f.decoded.len),
        _ => return,
    };
    assert!(len as usize <= insn.len(), "decoded {len} of {} bytes", insn.len());
    let Some(op) = op else {
        return;
    };
    let mut x = X87 {
        st: [[0; 10]; 8],
        fcw: u16::from_le_bytes([d[96], d[97]]),
        fsw: u16::from_le_bytes([d[98], d[99]]),
        ftw: d[100],
    };
    for (i, st) in x.st.iter_mut().enumerate() {
        st.copy_from_slice(&d[16 + 10 * i..26 + 10 * i]);
    }
    let input = &d[101..101 + op.reads().map_or(0, |k| k.width())];
    let mut rflags = [0u8; 8];
    rflags.copy_from_slice(&d[111..119]);
    if let Some(fx) = execute(&mut x, op, input, u64::from_le_bytes(rflags)) {
        if let (Some(store), Some(k)) = (&fx.store, op.writes()) {
            assert_eq!(store.len(), k.width(), "{op:?}");
        }
    }
});

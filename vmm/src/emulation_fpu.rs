//! The FPU control-register loads and stores KVM's instruction emulator
//! gives up on, completed in the VMM (see `emulation.rs`): FLDCW m16
//! (`D9 /5`), FNSTCW m16 (`D9 /7`), LDMXCSR m32 (`0F AE /2`) and STMXCSR
//! m32 (`0F AE /3`). Firmware uses them (OVMF's SEC and PEI phases, e.g. in
//! SetJump); a Linux guest here does not reach them in its kernel.
//!
//! Only 32- and 64-bit code (the caller refuses 16-bit code, whose ModRM
//! forms differ), and only memory operands without a SIB byte or
//! prefixes: `[reg]`, `[reg + disp8]`, `[reg + disp32]` and
//! `[rip + disp32]` (an absolute `[disp32]` outside 64-bit mode). Anything else is left to the caller's
//! "unsupported" path. Runs on the vCPU's thread, after the exit; pure
//! decoding apart from [`complete`].

use kvm_bindings::{kvm_regs, kvm_sregs};

/// Which register moves, and which way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FpuOp {
    /// FLDCW: memory -> the x87 control word.
    LoadFcw,
    /// FNSTCW: the x87 control word -> memory.
    StoreFcw,
    /// LDMXCSR: memory -> MXCSR.
    LoadMxcsr,
    /// STMXCSR: MXCSR -> memory.
    StoreMxcsr,
}

impl FpuOp {
    /// Bytes of the memory operand.
    pub fn width(self) -> usize {
        match self {
            FpuOp::LoadFcw | FpuOp::StoreFcw => 2,
            FpuOp::LoadMxcsr | FpuOp::StoreMxcsr => 4,
        }
    }
}

/// A memory operand: `base + disp`, the base a register (by its number in
/// ModRM order: rax, rcx, rdx, rbx, rsp, rbp, rsi, rdi) or the next RIP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Base {
    Reg(u8),
    /// RIP-relative in 64-bit mode; no base (absolute) otherwise.
    Rip,
}

/// A decoded instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FpuInsn {
    pub op: FpuOp,
    pub base: Base,
    pub disp: i64,
    /// Its length in bytes.
    pub len: u64,
}

/// Decodes `insn` if it is one of ours in a supported form.
pub fn decode(insn: &[u8]) -> Option<FpuInsn> {
    let (op, modrm_at) = match insn {
        [0xd9, m, ..] => match (m >> 3) & 7 {
            5 => (FpuOp::LoadFcw, 1),
            7 => (FpuOp::StoreFcw, 1),
            _ => return None,
        },
        [0x0f, 0xae, m, ..] => match (m >> 3) & 7 {
            2 => (FpuOp::LoadMxcsr, 2),
            3 => (FpuOp::StoreMxcsr, 2),
            _ => return None,
        },
        _ => return None,
    };
    let modrm = insn[modrm_at];
    let (md, rm) = (modrm >> 6, modrm & 7);
    let rest = &insn[modrm_at + 1..];
    let disp32 = |b: &[u8]| -> Option<i64> {
        Some(i64::from(i32::from_le_bytes(b.get(..4)?.try_into().ok()?)))
    };
    let (base, disp, disp_len) = match (md, rm) {
        (3, _) | (_, 4) => return None, // a register operand; a SIB byte
        (0, 5) => (Base::Rip, disp32(rest)?, 4),
        (0, r) => (Base::Reg(r), 0, 0),
        (1, r) => (Base::Reg(r), i64::from(*rest.first()? as i8), 1),
        (_, r) => (Base::Reg(r), disp32(rest)?, 4),
    };
    Some(FpuInsn {
        op,
        base,
        disp,
        len: (modrm_at + 1 + disp_len) as u64,
    })
}

/// The operand's linear address for a vCPU at `regs`/`sregs` (in 64-bit
/// mode with `long`).
pub fn address(i: &FpuInsn, regs: &kvm_regs, sregs: &kvm_sregs, long: bool) -> u64 {
    let d = i.disp as u64;
    match i.base {
        Base::Rip if long => regs.rip.wrapping_add(i.len).wrapping_add(d),
        Base::Rip => sregs.ds.base.wrapping_add(d & 0xffff_ffff),
        Base::Reg(r) => {
            let v = [
                regs.rax, regs.rcx, regs.rdx, regs.rbx, regs.rsp, regs.rbp, regs.rsi, regs.rdi,
            ][usize::from(r & 7)];
            let seg = if matches!(r, 4 | 5) {
                sregs.ss.base
            } else {
                sregs.ds.base
            };
            let a = v.wrapping_add(d);
            let a = if long { a } else { a & 0xffff_ffff };
            seg.wrapping_add(a)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_the_forms_firmware_uses() {
        // OVMF SEC: fldcw [rip+0x1447]; ldmxcsr [rip+0x1436].
        assert_eq!(
            decode(&[0xd9, 0x2d, 0x47, 0x14, 0, 0]),
            Some(FpuInsn {
                op: FpuOp::LoadFcw,
                base: Base::Rip,
                disp: 0x1447,
                len: 6
            })
        );
        assert_eq!(
            decode(&[0x0f, 0xae, 0x15, 0xfc, 0xff, 0xff, 0xff]),
            Some(FpuInsn {
                op: FpuOp::LoadMxcsr,
                base: Base::Rip,
                disp: -4,
                len: 7
            })
        );
        // OVMF PEI (SetJump): stmxcsr [rcx+0x50].
        assert_eq!(
            decode(&[0x0f, 0xae, 0x59, 0x50, 0xf3]),
            Some(FpuInsn {
                op: FpuOp::StoreMxcsr,
                base: Base::Reg(1),
                disp: 0x50,
                len: 4
            })
        );
        // fnstcw [rbp-8]; ldmxcsr [rax]; stmxcsr [rdx+0x1000].
        let i = decode(&[0xd9, 0x7d, 0xf8]).unwrap();
        assert_eq!(
            (i.op, i.base, i.disp, i.len),
            (FpuOp::StoreFcw, Base::Reg(5), -8, 3)
        );
        let i = decode(&[0x0f, 0xae, 0x10]).unwrap();
        assert_eq!(
            (i.op, i.base, i.disp, i.len),
            (FpuOp::LoadMxcsr, Base::Reg(0), 0, 3)
        );
        let i = decode(&[0x0f, 0xae, 0x9a, 0, 0x10, 0, 0]).unwrap();
        assert_eq!((i.base, i.disp, i.len), (Base::Reg(2), 0x1000, 7));
        // Not ours, or not a supported form: a SIB byte, a register
        // operand, other opcode extensions, cut short.
        for bad in [
            &[0x0f, 0xae, 0x14, 0x24][..],
            &[0x0f, 0xae, 0xd0],
            &[0x0f, 0xae, 0x38],
            &[0xd9, 0x00],
            &[0xd9, 0x2d, 0x47],
            &[0x0f, 0xae, 0x59],
            &[0x0f, 0xae],
            &[0xd9],
            &[0x90],
        ] {
            assert_eq!(decode(bad), None, "{bad:02x?}");
        }
    }

    #[test]
    fn addresses_follow_the_mode() {
        let regs = kvm_regs {
            rip: 0xfffd_27d7,
            rcx: 0x81_f340,
            rbp: 0x1_0000_0010,
            ..Default::default()
        };
        let sregs = kvm_sregs::default();
        let i = decode(&[0xd9, 0x2d, 0x47, 0x14, 0, 0]).unwrap();
        assert_eq!(address(&i, &regs, &sregs, true), 0xfffd_3c24);
        assert_eq!(address(&i, &regs, &sregs, false), 0x1447);
        let i = decode(&[0x0f, 0xae, 0x59, 0x50]).unwrap();
        assert_eq!(address(&i, &regs, &sregs, true), 0x81_f390);
        let i = decode(&[0xd9, 0x7d, 0xf8]).unwrap();
        assert_eq!(address(&i, &regs, &sregs, true), 0x1_0000_0008);
        assert_eq!(address(&i, &regs, &sregs, false), 0x8);
    }
}

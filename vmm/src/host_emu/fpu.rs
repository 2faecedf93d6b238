//! The FPU control-register loads and stores KVM's instruction emulator
//! gives up on, completed in the VMM (see `emulation.rs`): FLDCW m16
//! (`D9 /5`), FNSTCW m16 (`D9 /7`), LDMXCSR m32 (`0F AE /2`) and STMXCSR
//! m32 (`0F AE /3`). Firmware uses them (OVMF's SEC and PEI phases, e.g. in
//! SetJump); a Linux guest here does not reach them in its kernel.
//!
//! Recognition only: the operand is decoded by `modrm` (32- and
//! 64-bit code, any memory form); a register operand is not one of these
//! instructions. Runs on the vCPU's thread, after the exit; pure.

use crate::host_emu::modrm::{self, Decoded, Operand};

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

/// A decoded instruction: which move, and its memory operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FpuInsn {
    pub op: FpuOp,
    pub decoded: Decoded,
}

/// Decodes `insn` (in 64-bit mode if `long`) if it is one of ours.
pub fn decode(insn: &[u8], long: bool) -> Option<FpuInsn> {
    let decoded = modrm::decode(insn, long)?;
    if !matches!(decoded.operand, Operand::Mem(_)) {
        return None;
    }
    let op = match (decoded.opcode, decoded.reg()) {
        ([0xd9, 0], 5) => FpuOp::LoadFcw,
        ([0xd9, 0], 7) => FpuOp::StoreFcw,
        ([0x0f, 0xae], 2) => FpuOp::LoadMxcsr,
        ([0x0f, 0xae], 3) => FpuOp::StoreMxcsr,
        _ => return None,
    };
    Some(FpuInsn { op, decoded })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host_emu::modrm::Mem;

    fn mem(i: &FpuInsn) -> Mem {
        match i.decoded.operand {
            Operand::Mem(m) => m,
            Operand::Reg(r) => panic!("register {r}"),
        }
    }

    #[test]
    fn decodes_the_forms_firmware_uses() {
        // OVMF SEC: fldcw [rip+0x1447]; ldmxcsr [rip-4].
        let i = decode(&[0xd9, 0x2d, 0x47, 0x14, 0, 0], true).unwrap();
        assert_eq!(
            (i.op, mem(&i).rip, mem(&i).disp, i.decoded.len),
            (FpuOp::LoadFcw, true, 0x1447, 6)
        );
        let i = decode(&[0x0f, 0xae, 0x15, 0xfc, 0xff, 0xff, 0xff], true).unwrap();
        assert_eq!(
            (i.op, mem(&i).disp, i.decoded.len),
            (FpuOp::LoadMxcsr, -4, 7)
        );
        // OVMF PEI (SetJump): stmxcsr [rcx+0x50].
        let i = decode(&[0x0f, 0xae, 0x59, 0x50, 0xf3], true).unwrap();
        assert_eq!(
            (i.op, mem(&i).base, mem(&i).disp, i.decoded.len),
            (FpuOp::StoreMxcsr, Some(1), 0x50, 4)
        );
        // fnstcw [rbp-8]; ldmxcsr [rsp] (a SIB byte).
        let i = decode(&[0xd9, 0x7d, 0xf8], true).unwrap();
        assert_eq!(
            (i.op, mem(&i).base, mem(&i).disp),
            (FpuOp::StoreFcw, Some(5), -8)
        );
        let i = decode(&[0x0f, 0xae, 0x14, 0x24], true).unwrap();
        assert_eq!(
            (i.op, mem(&i).base, i.decoded.len),
            (FpuOp::LoadMxcsr, Some(4), 4)
        );
        // Not ours: a register operand, other opcode extensions (FXSAVE,
        // CLFLUSH, FLD), cut short.
        for bad in [
            &[0x0f, 0xae, 0xd0][..],
            &[0x0f, 0xae, 0x38],
            &[0x0f, 0xae, 0x00],
            &[0xd9, 0x00],
            &[0xd9, 0x2d, 0x47],
            &[0x0f, 0xae, 0x59],
            &[0x0f, 0xae],
            &[0xd9],
            &[0x90, 0x00],
        ] {
            assert_eq!(decode(bad, true), None, "{bad:02x?}");
        }
    }
}

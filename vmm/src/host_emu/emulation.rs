//! Completes, in the VMM, the few instructions KVM's emulator gives up on.
//!
//! On `kvm_pvm` hosts the guest kernel runs under KVM's instruction emulator,
//! which stops with `KVM_EXIT_INTERNAL_ERROR` (suberror 1, emulation failure)
//! on some instructions a Linux guest uses. The ones completed here, and how:
//!
//! | bytes   | instruction | completion                                       |
//! |---------|-------------|--------------------------------------------------|
//! | `CC`    | INT3        | RIP += 1, inject #BP (a trap: the frame points past it) |
//! | `0F 0B` | UD2         | inject #UD at RIP (BUG()/WARN() use it)           |
//! | `9B`    | FWAIT       | RIP += 1 (no x87 exception can be pending)        |
//! | `D9 /5`, `D9 /7`, `0F AE /2`, `0F AE /3` | FLDCW, FNSTCW, LDMXCSR, STMXCSR | the control register moved through `KVM_GET/SET_FPU` (`fpu`), RIP past it |
//! | `D8`-`DF` | x87 loads, stores, arithmetic, compares (`x87`) | executed on the register file from `KVM_GET_FPU`, the memory operand read or written, `KVM_SET_FPU`, RIP past it |
//!
//! Anything else is fatal: the caller stops the VM with the registers and the
//! instruction bytes in the message, never loops on it. On hosts with VT-x or
//! AMD-V these exits do not happen, so nothing here runs there. The same
//! completions serve firmware code (`--firmware`), whose bytes and operands
//! are read from the firmware image.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use devices::GuestMemoryMmap;

use crate::boot::firmware::Firmware;
use crate::host_emu::fpu::{self, FpuInsn, FpuOp};
use crate::host_emu::modrm::{self, Decoded, Operand};
use crate::host_emu::x87::{self, X87};
use kvm_bindings::{kvm_regs, kvm_sregs, KVM_INTERNAL_ERROR_EMULATION};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress};

const BP_VECTOR: u8 = 3;
const UD_VECTOR: u8 = 6;
const MAX_INSN_LEN: usize = 15;
const PAGE_SIZE: u64 = 4096;

/// How many instructions of each kind were completed (all vCPUs).
pub static COMPLETED_INT3: AtomicU64 = AtomicU64::new(0);
/// UD2 completions.
pub static COMPLETED_UD2: AtomicU64 = AtomicU64::new(0);
/// FWAIT completions.
pub static COMPLETED_FWAIT: AtomicU64 = AtomicU64::new(0);
/// FLDCW / FNSTCW / LDMXCSR / STMXCSR completions.
pub static COMPLETED_FPU: AtomicU64 = AtomicU64::new(0);
/// x87 arithmetic completions.
pub static COMPLETED_X87: AtomicU64 = AtomicU64::new(0);
const EFER_LMA: u64 = 1 << 10;
/// MXCSR bits software may set (the rest raise #GP; kept clear here).
const MXCSR_WRITABLE: u32 = 0xffff;

/// A one-line summary of the completions so far, for the log.
pub fn summary() -> String {
    format!(
        "instructions completed for the emulator: INT3 {}, UD2 {}, FWAIT {}, FPU control {}, x87 {}",
        COMPLETED_INT3.load(Ordering::Relaxed),
        COMPLETED_UD2.load(Ordering::Relaxed),
        COMPLETED_FWAIT.load(Ordering::Relaxed),
        COMPLETED_FPU.load(Ordering::Relaxed),
        COMPLETED_X87.load(Ordering::Relaxed)
    )
}

/// The counts as JSON, for the metrics file.
pub fn counts() -> serde_json::Value {
    serde_json::json!({
        "int3": COMPLETED_INT3.load(Ordering::Relaxed),
        "ud2": COMPLETED_UD2.load(Ordering::Relaxed),
        "fwait": COMPLETED_FWAIT.load(Ordering::Relaxed),
        "fpu_control": COMPLETED_FPU.load(Ordering::Relaxed),
        "x87": COMPLETED_X87.load(Ordering::Relaxed),
    })
}

/// Why an internal error could not be completed.
#[derive(Debug, thiserror::Error)]
pub enum EmulationError {
    #[error("KVM internal error (suberror {suberror}) at {state}")]
    NotEmulation { suberror: u32, state: String },
    #[error("KVM internal error (suberror {suberror}) on a host with hardware virtualization")]
    Hardware { suberror: u32 },
    #[error("emulation failure on an instruction tandem does not complete, at {state}")]
    Unsupported { state: String },
    #[error("cannot read or change vCPU state after an emulation failure: {0}")]
    Kvm(#[from] kvm_ioctls::Error),
}

/// What to do with the instruction at RIP.
#[derive(Debug, PartialEq, Eq)]
pub enum Completion {
    /// Advance RIP by this many bytes and inject this exception vector, if any.
    Complete { advance: u64, inject: Option<u8> },
    /// Move an FPU control register from or to memory (`fpu`).
    Fpu(FpuInsn),
    /// An x87 instruction (`x87`).
    X87(x87::Op, Decoded),
    /// Not an instruction we complete.
    Unsupported,
}

/// Decides how to complete the instruction whose first bytes are `insn`,
/// in 64-bit code if `long`.
pub fn decide(insn: &[u8], long: bool) -> Completion {
    match insn {
        [0xcc, ..] => Completion::Complete {
            advance: 1,
            inject: Some(BP_VECTOR),
        },
        [0x0f, 0x0b, ..] => Completion::Complete {
            advance: 0,
            inject: Some(UD_VECTOR),
        },
        [0x9b, ..] => Completion::Complete {
            advance: 1,
            inject: None,
        },
        _ => {
            if let Some(f) = fpu::decode(insn, long) {
                return Completion::Fpu(f);
            }
            let Some(d) = modrm::decode(insn, long) else {
                return Completion::Unsupported;
            };
            let escape = d.opcode[0];
            let is_mem = matches!(d.operand, Operand::Mem(_));
            match x87::decode(escape, d.modrm, is_mem) {
                Some(op) if (0xd8..=0xdf).contains(&escape) => Completion::X87(op, d),
                _ => Completion::Unsupported,
            }
        }
    }
}

/// The suberror of the KVM internal error `vcpu` just exited with (called
/// on that exit only; on another, a meaningless number).
pub fn internal_suberror(vcpu: &mut VcpuFd) -> u32 {
    // SAFETY: the union's members are plain integers, so any bit pattern is
    // a valid value; on KVM_EXIT_INTERNAL_ERROR the kernel filled the
    // `internal` member that is read here.
    unsafe { vcpu.get_kvm_run().__bindgen_anon_1.internal.suberror }
}

/// Handles a `KVM_EXIT_INTERNAL_ERROR` on `vcpu`: completes the instruction
/// and returns Ok, or returns an error describing the vCPU state.
pub fn handle_internal_error(
    vcpu: &mut VcpuFd,
    mem: &GuestMemoryMmap,
    rom: Option<&Firmware>,
) -> Result<(), EmulationError> {
    let suberror = internal_suberror(vcpu);
    let mut regs = vcpu.get_regs()?;
    let sregs = vcpu.get_sregs()?;
    let insn = read_insn(vcpu, mem, rom, &sregs, regs.rip);
    // 64-bit code: EFER.LMA and CS.L.
    let long = sregs.efer & EFER_LMA != 0 && sregs.cs.l != 0;
    if suberror != KVM_INTERNAL_ERROR_EMULATION {
        return Err(EmulationError::NotEmulation {
            suberror,
            state: describe(&regs, &sregs, &insn),
        });
    }
    match decide(&insn, long) {
        Completion::Complete { advance, inject } => {
            regs.rip = regs.rip.wrapping_add(advance);
            vcpu.set_regs(&regs)?;
            if let Some(vector) = inject {
                let mut events = vcpu.get_vcpu_events()?;
                events.exception.injected = 1;
                events.exception.nr = vector;
                events.exception.has_error_code = 0;
                events.exception.error_code = 0;
                events.flags = 0;
                vcpu.set_vcpu_events(&events)?;
            }
            let counter = match insn.first() {
                Some(0xcc) => &COMPLETED_INT3,
                Some(0x0f) => &COMPLETED_UD2,
                _ => &COMPLETED_FWAIT,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        Completion::Fpu(f) => {
            if !complete_fpu(vcpu, mem, rom, &regs, &sregs, &f)? {
                return Err(EmulationError::Unsupported {
                    state: describe(&regs, &sregs, &insn),
                });
            }
            regs.rip = regs.rip.wrapping_add(f.decoded.len);
            vcpu.set_regs(&regs)?;
            COMPLETED_FPU.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        Completion::X87(op, d) => {
            let before = regs;
            if !complete_x87(vcpu, mem, rom, &mut regs, &sregs, &d, op)? {
                return Err(EmulationError::Unsupported {
                    state: describe(&before, &sregs, &insn),
                });
            }
            COMPLETED_X87.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        Completion::Unsupported => Err(EmulationError::Unsupported {
            state: describe(&regs, &sregs, &insn),
        }),
    }
}

/// Moves the FPU control register of `f` from or to its memory operand;
/// false if the operand cannot be read (or, for a store, written: only
/// RAM takes stores).
fn complete_fpu(
    vcpu: &VcpuFd,
    mem: &GuestMemoryMmap,
    rom: Option<&Firmware>,
    regs: &kvm_regs,
    sregs: &kvm_sregs,
    f: &FpuInsn,
) -> Result<bool, EmulationError> {
    let Some(linear) = operand_address(&f.decoded, regs, sregs) else {
        return Ok(false);
    };
    let width = f.op.width();
    let mut fpu = vcpu.get_fpu()?;
    let mut value = [0u8; 4];
    match f.op {
        FpuOp::LoadFcw | FpuOp::LoadMxcsr => {
            if read_guest(vcpu, mem, rom, linear, &mut value[..width]) < width {
                return Ok(false);
            }
            if f.op == FpuOp::LoadFcw {
                fpu.fcw = u16::from_le_bytes([value[0], value[1]]);
            } else {
                fpu.mxcsr = u32::from_le_bytes(value) & MXCSR_WRITABLE;
            }
            vcpu.set_fpu(&fpu)?;
        }
        FpuOp::StoreFcw | FpuOp::StoreMxcsr => {
            value = if f.op == FpuOp::StoreFcw {
                u32::from(fpu.fcw).to_le_bytes()
            } else {
                fpu.mxcsr.to_le_bytes()
            };
            if !write_guest(vcpu, mem, linear, &value[..width]) {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// The linear address of `d`'s memory operand; None for a register
/// operand or 16-bit code (CS.D clear: `[bx+si]`, disp16, not decoded).
fn operand_address(d: &Decoded, regs: &kvm_regs, sregs: &kvm_sregs) -> Option<u64> {
    let long = sregs.efer & EFER_LMA != 0 && sregs.cs.l != 0;
    if !long && sregs.cs.db == 0 {
        return None;
    }
    match d.operand {
        Operand::Mem(m) => Some(modrm::address(d, &m, regs, sregs, long)),
        Operand::Reg(_) => None,
    }
}

/// Runs x87 instruction `op` (decoded as `d`): reads its memory operand,
/// executes it on the register file, writes the stored value, then the
/// register file, RFLAGS/AX and RIP. False (and nothing changed) if an
/// operand cannot be read or written or `x87` refuses it (an unmasked
/// exception).
fn complete_x87(
    vcpu: &VcpuFd,
    mem: &GuestMemoryMmap,
    rom: Option<&Firmware>,
    regs: &mut kvm_regs,
    sregs: &kvm_sregs,
    d: &Decoded,
    op: x87::Op,
) -> Result<bool, EmulationError> {
    let linear = operand_address(d, regs, sregs);
    let mut input = [0u8; 10];
    let n = op.reads().map_or(0, x87::MemKind::width);
    if n > 0 {
        match linear {
            Some(a) if read_guest(vcpu, mem, rom, a, &mut input[..n]) == n => {}
            _ => return Ok(false),
        }
    }
    let mut fpu = vcpu.get_fpu()?;
    let mut x = X87 {
        st: [[0; 10]; 8],
        fcw: fpu.fcw,
        fsw: fpu.fsw,
        ftw: fpu.ftwx,
    };
    for (st, fpr) in x.st.iter_mut().zip(fpu.fpr.iter()) {
        st.copy_from_slice(&fpr[..10]);
    }
    let Some(fx) = x87::execute(&mut x, op, &input[..n], regs.rflags) else {
        return Ok(false);
    };
    if let Some(bytes) = &fx.store {
        match linear {
            Some(a) if write_guest(vcpu, mem, a, bytes) => {}
            _ => return Ok(false),
        }
    }
    for (fpr, st) in fpu.fpr.iter_mut().zip(x.st.iter()) {
        fpr[..10].copy_from_slice(st);
    }
    (fpu.fcw, fpu.fsw, fpu.ftwx) = (x.fcw, x.fsw, x.ftw);
    vcpu.set_fpu(&fpu)?;
    if let Some(f) = fx.rflags {
        regs.rflags = f;
    }
    if let Some(ax) = fx.ax {
        regs.rax = (regs.rax & !0xffff) | u64::from(ax);
    }
    regs.rip = regs.rip.wrapping_add(d.len);
    vcpu.set_regs(regs)?;
    Ok(true)
}

/// Writes `bytes` at guest linear address `linear` into RAM (see
/// [`walk_pages`]); false if any part is not writable RAM.
fn write_guest(vcpu: &VcpuFd, mem: &GuestMemoryMmap, linear: u64, bytes: &[u8]) -> bool {
    let done = walk_pages(vcpu, linear, bytes.len(), true, |gpa, r| {
        mem.write_slice(&bytes[r], GuestAddress(gpa)).is_ok()
    });
    done == bytes.len()
}

/// Walks `len` bytes at guest linear address `linear` page by page through
/// the guest's own page tables (`KVM_TRANSLATE`), calling `each` with each
/// page's guest-physical address and its part of `0..len`. Stops at a page
/// that does not translate (or is read-only, for a `write`) or that `each`
/// refuses; returns how many bytes were done.
fn walk_pages(
    vcpu: &VcpuFd,
    mut linear: u64,
    len: usize,
    write: bool,
    mut each: impl FnMut(u64, std::ops::Range<usize>) -> bool,
) -> usize {
    let mut done = 0;
    while done < len {
        let Ok(t) = vcpu.translate_gva(linear) else {
            break;
        };
        if t.valid == 0 || (write && t.writeable == 0) {
            break;
        }
        let in_page = (PAGE_SIZE - (linear & (PAGE_SIZE - 1))) as usize;
        let n = in_page.min(len - done);
        if !each(t.physical_address, done..done + n) {
            break;
        }
        done += n;
        linear = linear.wrapping_add(n as u64);
    }
    done
}

/// Reads up to 15 bytes at the guest's RIP (see [`read_guest`]).
fn read_insn(
    vcpu: &VcpuFd,
    mem: &GuestMemoryMmap,
    rom: Option<&Firmware>,
    sregs: &kvm_sregs,
    rip: u64,
) -> Vec<u8> {
    let mut out = vec![0u8; MAX_INSN_LEN];
    let n = read_guest(vcpu, mem, rom, sregs.cs.base.wrapping_add(rip), &mut out);
    out.truncate(n);
    out
}

/// Reads `buf.len()` bytes at guest linear address `linear` from RAM or
/// the firmware image (see [`walk_pages`]). Returns how many bytes could
/// be read.
fn read_guest(
    vcpu: &VcpuFd,
    mem: &GuestMemoryMmap,
    rom: Option<&Firmware>,
    linear: u64,
    buf: &mut [u8],
) -> usize {
    walk_pages(vcpu, linear, buf.len(), false, |gpa, r| {
        let chunk = &mut buf[r];
        mem.read_slice(chunk, GuestAddress(gpa)).is_ok()
            || rom.is_some_and(|rom| rom.read(gpa, chunk))
    })
}

/// A one-paragraph dump of the vCPU for a fatal error.
pub fn describe(regs: &kvm_regs, sregs: &kvm_sregs, insn: &[u8]) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "RIP={:#018x} CPL={} bytes=[",
        regs.rip,
        sregs.cs.selector & 3
    );
    for (i, b) in insn.iter().enumerate() {
        let _ = write!(s, "{}{:02x}", if i > 0 { " " } else { "" }, b);
    }
    let _ = write!(
        s,
        "] RAX={:#x} RBX={:#x} RCX={:#x} RDX={:#x} RSI={:#x} RDI={:#x} RBP={:#x} RSP={:#x} \
         R8={:#x} R9={:#x} R10={:#x} R11={:#x} R12={:#x} R13={:#x} R14={:#x} R15={:#x} \
         RFLAGS={:#x} CR0={:#x} CR2={:#x} CR3={:#x} CR4={:#x} EFER={:#x}",
        regs.rax,
        regs.rbx,
        regs.rcx,
        regs.rdx,
        regs.rsi,
        regs.rdi,
        regs.rbp,
        regs.rsp,
        regs.r8,
        regs.r9,
        regs.r10,
        regs.r11,
        regs.r12,
        regs.r13,
        regs.r14,
        regs.r15,
        regs.rflags,
        sregs.cr0,
        sregs.cr2,
        sregs.cr3,
        sregs.cr4,
        sregs.efer
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decide_64(insn: &[u8]) -> Completion {
        decide(insn, true)
    }

    #[test]
    fn decides_each_known_instruction_and_refuses_the_rest() {
        assert_eq!(
            decide_64(&[0xcc, 0x90]),
            Completion::Complete {
                advance: 1,
                inject: Some(BP_VECTOR)
            }
        );
        assert_eq!(
            decide_64(&[0x0f, 0x0b]),
            Completion::Complete {
                advance: 0,
                inject: Some(UD_VECTOR)
            }
        );
        assert_eq!(
            decide_64(&[0x9b]),
            Completion::Complete {
                advance: 1,
                inject: None
            }
        );
        // The FPU control moves (forms in fpu's tests).
        assert!(matches!(
            decide_64(&[0x0f, 0xae, 0x59, 0x50]),
            Completion::Fpu(_)
        ));
        assert!(matches!(
            decide_64(&[0x0f, 0xae, 0x14, 0x24]),
            Completion::Fpu(_)
        ));
        // x87 arithmetic: fild dword [rsp+0xc]; fstp qword [rbp-0x18].
        assert!(matches!(
            decide_64(&[0xdb, 0x44, 0x24, 0x0c]),
            Completion::X87(x87::Op::Load(_), _)
        ));
        assert!(matches!(
            decide_64(&[0xdd, 0x5d, 0xe8]),
            Completion::X87(x87::Op::Store { .. }, _)
        ));
        // Not completed: fsin, fxsave (0F AE /0), an ordinary opcode.
        assert_eq!(decide_64(&[0xd9, 0xfe]), Completion::Unsupported);
        assert_eq!(decide_64(&[0x0f, 0xae, 0x00]), Completion::Unsupported);
        assert_eq!(decide_64(&[0x89, 0x04, 0x24]), Completion::Unsupported);
        assert_eq!(decide_64(&[0x0f]), Completion::Unsupported);
        assert_eq!(decide_64(&[]), Completion::Unsupported);
        assert_eq!(
            decide_64(&[0xf3, 0x0f, 0xb8, 0xc0]),
            Completion::Unsupported
        );
    }

    #[test]
    fn describe_names_rip_and_bytes() {
        let regs = kvm_regs {
            rip: 0x1234,
            ..Default::default()
        };
        let d = describe(&regs, &kvm_sregs::default(), &[0x0f, 0x01, 0xca]);
        assert!(d.contains("RIP=0x0000000000001234"), "{d}");
        assert!(d.contains("bytes=[0f 01 ca]"), "{d}");
    }
}

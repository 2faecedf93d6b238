//! Decodes the prefixes and the ModRM operand of an instruction KVM's
//! emulator gave up on, and computes a memory operand's linear address:
//! the part of x86 decoding the completions in `emulation` share
//! (`fpu`'s control moves and `x87`'s arithmetic).
//!
//! 32- and 64-bit code only: 16-bit addressing (`[bx+si]`, disp16, or an
//! address-size prefix outside 64-bit mode) is refused, as is anything
//! cut short. Pure; runs on the vCPU's thread after the exit and never
//! touches guest memory.

use kvm_bindings::{kvm_regs, kvm_sregs};

/// A segment override prefix, for the operand's base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment {
    Es,
    Cs,
    Ss,
    Ds,
    Fs,
    Gs,
}

/// What the ModRM byte names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// A register: ModRM.rm (0-7; REX.B is the caller's to apply, and x87
    /// register forms ignore it).
    Reg(u8),
    /// Memory at `base + index * scale + disp` in `seg`.
    Mem(Mem),
}

/// A memory operand (registers by number: rax 0 .. r15 15).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mem {
    /// None: no base register, an absolute disp32 (or RIP-relative, `rip`).
    pub base: Option<u8>,
    pub index: Option<(u8, u8)>,
    pub disp: i64,
    /// RIP-relative (64-bit mode's `mod 00 rm 101`).
    pub rip: bool,
    pub seg: Option<Segment>,
    /// A 0x67 prefix in 64-bit mode: the address is 32 bits wide.
    pub addr32: bool,
}

/// An instruction split into its parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoded {
    /// The opcode bytes (one or two: 0F xx), after the prefixes.
    pub opcode: [u8; 2],
    /// The ModRM byte itself.
    pub modrm: u8,
    pub operand: Operand,
    /// REX.W.
    pub rex_w: bool,
    /// Length of the whole instruction (none we decode has an immediate).
    pub len: u64,
}

impl Decoded {
    /// ModRM.reg: the opcode extension (`/digit`).
    pub fn reg(&self) -> u8 {
        (self.modrm >> 3) & 7
    }
}

/// The prefixes of `insn`: where the opcode starts, the segment override,
/// 32-bit addressing in 64-bit mode, and the REX byte (0: none). None if
/// cut short, too long or 16-bit addressing.
fn prefixes(insn: &[u8], long: bool) -> Option<(usize, Option<Segment>, bool, u8)> {
    let mut at = 0;
    let mut seg = None;
    let mut addr32 = false;
    let mut rex = 0u8;
    loop {
        let b = *insn.get(at)?;
        match b {
            0x26 => seg = Some(Segment::Es),
            0x2e => seg = Some(Segment::Cs),
            0x36 => seg = Some(Segment::Ss),
            0x3e => seg = Some(Segment::Ds),
            0x64 => seg = Some(Segment::Fs),
            0x65 => seg = Some(Segment::Gs),
            0x66 | 0xf2 | 0xf3 | 0xf0 => {}
            0x67 if long => addr32 = true,
            0x67 => return None, // 16-bit addressing
            0x40..=0x4f if long => {
                rex = b;
                at += 1;
                break;
            }
            _ => break,
        }
        rex = 0;
        at += 1;
        if at >= 15 {
            return None;
        }
    }
    Some((at, seg, addr32, rex))
}

/// Decodes `insn` as prefixes, a one-byte opcode or `0F xx`, and a ModRM
/// operand, in 64-bit mode if `long`. None if cut short or 16-bit
/// addressing.
pub fn decode(insn: &[u8], long: bool) -> Option<Decoded> {
    let (at, seg, addr32, rex) = prefixes(insn, long)?;
    let (opcode, modrm_at) = match *insn.get(at)? {
        0x0f => ([0x0f, *insn.get(at + 1)?], at + 2),
        op => ([op, 0], at + 1),
    };
    let modrm = *insn.get(modrm_at)?;
    let (md, rm) = (modrm >> 6, modrm & 7);
    let rex_b = (rex & 1) << 3;
    let rex_x = (rex & 2) << 2;
    let mut at = modrm_at + 1;
    let operand = if md == 3 {
        Operand::Reg(rm)
    } else {
        let mut mem = Mem {
            base: Some(rm | rex_b),
            index: None,
            disp: 0,
            rip: false,
            seg,
            addr32,
        };
        let mut no_base_disp32 = false;
        if rm == 4 {
            let sib = *insn.get(at)?;
            at += 1;
            let index = ((sib >> 3) & 7) | rex_x;
            if index != 4 {
                mem.index = Some((index, 1 << (sib >> 6)));
            }
            mem.base = Some((sib & 7) | rex_b);
            if sib & 7 == 5 && md == 0 {
                mem.base = None;
                no_base_disp32 = true;
            }
        } else if rm == 5 && md == 0 {
            mem.base = None;
            mem.rip = long;
            no_base_disp32 = true;
        }
        let disp_len = match md {
            0 if no_base_disp32 => 4,
            0 => 0,
            1 => 1,
            _ => 4,
        };
        let d = insn.get(at..at + disp_len)?;
        mem.disp = match disp_len {
            0 => 0,
            1 => i64::from(d[0] as i8),
            _ => i64::from(i32::from_le_bytes([d[0], d[1], d[2], d[3]])),
        };
        at += disp_len;
        Operand::Mem(mem)
    };
    Some(Decoded {
        opcode,
        modrm,
        operand,
        rex_w: rex & 8 != 0,
        len: at as u64,
    })
}

/// The 16 general registers in ModRM order.
fn gpr(regs: &kvm_regs, r: u8) -> u64 {
    [
        regs.rax, regs.rcx, regs.rdx, regs.rbx, regs.rsp, regs.rbp, regs.rsi, regs.rdi, regs.r8,
        regs.r9, regs.r10, regs.r11, regs.r12, regs.r13, regs.r14, regs.r15,
    ][usize::from(r & 15)]
}

/// The linear address of `mem` in instruction `d` for a vCPU at
/// `regs`/`sregs`, in 64-bit mode if `long`.
pub fn address(d: &Decoded, mem: &Mem, regs: &kvm_regs, sregs: &kvm_sregs, long: bool) -> u64 {
    let mut a = mem.disp as u64;
    if mem.rip {
        a = a.wrapping_add(regs.rip.wrapping_add(d.len));
    }
    if let Some(b) = mem.base {
        a = a.wrapping_add(gpr(regs, b));
    }
    if let Some((i, scale)) = mem.index {
        a = a.wrapping_add(gpr(regs, i).wrapping_mul(u64::from(scale)));
    }
    if !long || mem.addr32 {
        a &= 0xffff_ffff;
    }
    // In 64-bit mode only FS and GS have bases; outside it the default
    // segment is SS for an rsp or rbp base, else DS.
    let seg = match mem.seg {
        Some(Segment::Fs) => &sregs.fs,
        Some(Segment::Gs) => &sregs.gs,
        _ if long => return a,
        Some(Segment::Es) => &sregs.es,
        Some(Segment::Cs) => &sregs.cs,
        Some(Segment::Ss) => &sregs.ss,
        Some(Segment::Ds) => &sregs.ds,
        None if matches!(mem.base, Some(4 | 5)) => &sregs.ss,
        None => &sregs.ds,
    };
    let linear = seg.base.wrapping_add(a);
    if long {
        linear
    } else {
        linear & 0xffff_ffff
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem(d: &Decoded) -> Mem {
        match d.operand {
            Operand::Mem(m) => m,
            Operand::Reg(r) => panic!("register {r}"),
        }
    }

    #[test]
    fn decodes_the_forms_compilers_emit() {
        // fild dword [rsp+0xc]: DB 44 24 0C (a SIB byte, no index).
        let d = decode(&[0xdb, 0x44, 0x24, 0x0c], true).unwrap();
        assert_eq!((d.opcode, d.reg(), d.len), ([0xdb, 0], 0, 4));
        let m = mem(&d);
        assert_eq!((m.base, m.index, m.disp, m.rip), (Some(4), None, 12, false));
        // fstp qword [rbp-0x18]: DD 5D E8.
        let d = decode(&[0xdd, 0x5d, 0xe8], true).unwrap();
        assert_eq!(
            (d.reg(), mem(&d).base, mem(&d).disp, d.len),
            (3, Some(5), -24, 3)
        );
        // fld qword [rip+0x100]: DD 05 00 01 00 00.
        let d = decode(&[0xdd, 0x05, 0, 1, 0, 0], true).unwrap();
        assert!(mem(&d).rip);
        assert_eq!((mem(&d).disp, d.len), (0x100, 6));
        // Outside 64-bit mode the same form is an absolute disp32.
        let d = decode(&[0xdd, 0x05, 0, 1, 0, 0], false).unwrap();
        assert_eq!((mem(&d).rip, mem(&d).base), (false, None));
        // REX.B and REX.X: fild qword [r13+r9*8+0x10]: 43 DF 6C CD 10.
        let d = decode(&[0x43, 0xdf, 0x6c, 0xcd, 0x10], true).unwrap();
        let m = mem(&d);
        assert_eq!(
            (m.base, m.index, m.disp, d.len),
            (Some(13), Some((9, 8)), 16, 5)
        );
        // SIB with no base: [rax*4 + disp32].
        let d = decode(&[0xd9, 0x04, 0x85, 0x10, 0, 0, 0], true).unwrap();
        assert_eq!(
            (mem(&d).base, mem(&d).index, d.len),
            (None, Some((0, 4)), 7)
        );
        // A register form: fadd st, st(3): D8 C3.
        let d = decode(&[0xd8, 0xc3], true).unwrap();
        assert_eq!((d.operand, d.len), (Operand::Reg(3), 2));
        // Two-byte opcode with prefixes: fs stmxcsr [rcx+0x50].
        let d = decode(&[0x64, 0x0f, 0xae, 0x59, 0x50], true).unwrap();
        assert_eq!((d.opcode, d.reg(), d.len), ([0x0f, 0xae], 3, 5));
        assert_eq!(mem(&d).seg, Some(Segment::Fs));
        // REX.W.
        assert!(decode(&[0x48, 0xdf, 0x28], true).unwrap().rex_w);
        // In 32-bit code 0x48 is DEC EAX, not a REX prefix.
        assert_eq!(
            decode(&[0x48, 0xdf, 0x28], false).unwrap().opcode,
            [0x48, 0]
        );
    }

    #[test]
    fn refuses_what_is_cut_short_or_16_bit() {
        for bad in [
            &[][..],
            &[0xdb],
            &[0xdb, 0x44],
            &[0xdb, 0x44, 0x24],
            &[0xdd, 0x05, 0, 1],
            &[0x0f, 0xae],
            &[0x66; 20],
        ] {
            assert_eq!(decode(bad, true), None, "{bad:02x?}");
        }
        assert_eq!(decode(&[0x67, 0xd9, 0x00], false), None);
    }

    #[test]
    fn addresses_follow_mode_segment_and_sib() {
        let regs = kvm_regs {
            rip: 0x1000,
            rsp: 0x8000,
            rax: 3,
            r13: 0x2_0000_0000,
            r9: 2,
            ..Default::default()
        };
        let mut sregs = kvm_sregs::default();
        sregs.fs.base = 0x7000_0000;
        sregs.ss.base = 0x100;
        sregs.ds.base = 0x200;
        let at = |b: &[u8], long| {
            let d = decode(b, long).unwrap();
            address(&d, &mem(&d), &regs, &sregs, long)
        };
        assert_eq!(at(&[0xdb, 0x44, 0x24, 0x0c], true), 0x800c);
        assert_eq!(at(&[0xdb, 0x44, 0x24, 0x0c], false), 0x810c);
        assert_eq!(at(&[0xdd, 0x05, 0, 1, 0, 0], true), 0x1000 + 6 + 0x100);
        assert_eq!(at(&[0xdd, 0x05, 0, 1, 0, 0], false), 0x300);
        assert_eq!(at(&[0x43, 0xdf, 0x6c, 0xcd, 0x10], true), 0x2_0000_0020);
        assert_eq!(at(&[0x67, 0x43, 0xdf, 0x6c, 0xcd, 0x10], true), 0x20);
        assert_eq!(
            at(&[0x64, 0xd9, 0x04, 0x85, 0x10, 0, 0, 0], true),
            0x7000_001c
        );
        assert_eq!(at(&[0xd9, 0x04, 0x85, 0x10, 0, 0, 0], true), 0x1c);
    }
}

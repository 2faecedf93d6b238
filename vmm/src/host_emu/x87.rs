//! The x87 instructions KVM's emulator has no arithmetic for, completed in
//! the VMM for firmware (see `emulation.rs`): OVMF's drivers are built for
//! x86-64 without SSE code generation, so their `double` arithmetic is
//! x87 code, which the emulator on `kvm_pvm` hosts gives up on.
//!
//! This module owns the decoding (`decode`) and the execution (`execute`)
//! on the register file as `KVM_GET_FPU` gives it; the caller (the vCPU's
//! thread, in `emulation`) reads the memory operand, writes the stored
//! value and the flags back. Pure: no guest memory, no KVM.
//!
//! What it does: loads (FLD, FILD, FLDZ, FLD1), stores (FST, FSTP, FIST,
//! FISTP, FISTTP), the four operations in all their forms (FADD, FSUB,
//! FSUBR, FMUL, FDIV, FDIVR, with P and I variants), compares (FCOM,
//! FUCOM, FCOMI, FUCOMI and their popping forms, FTST, FNSTSW), FCMOVcc, FXCH,
//! FCHS, FABS, FSQRT, FRNDINT, FXAM, FFREE, FNINIT, FNCLEX. Arithmetic is
//! done in double precision (53-bit significands, not the x87's 64): exact
//! for what C code computes in `double` and stores as such. Exceptions
//! are the masked kind only: a fault the control word leaves unmasked is
//! refused (`None`), and the caller stops the VM rather than compute
//! something the guest did not ask for. Must never panic on any input.

use crate::host_emu::x87_float::{Ext, Round};

/// FSW bits.
const IE: u16 = 1;
const ZE: u16 = 1 << 2;
const SF: u16 = 1 << 6;
const C0: u16 = 1 << 8;
const C1: u16 = 1 << 9;
const C2: u16 = 1 << 10;
const C3: u16 = 1 << 14;
const TOP_SHIFT: u16 = 11;
/// RFLAGS bits FCOMI sets.
const CF: u64 = 1;
const PF: u64 = 1 << 2;
const ZF: u64 = 1 << 6;
const FCOMI_CLEARS: u64 = (1 << 11) | (1 << 7) | (1 << 4); // OF SF AF

/// A memory operand's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    F32,
    F64,
    F80,
    I16,
    I32,
    I64,
    /// FNSTSW m16: the status word.
    Status,
}

impl MemKind {
    pub fn width(self) -> usize {
        match self {
            MemKind::I16 | MemKind::Status => 2,
            MemKind::F32 | MemKind::I32 => 4,
            MemKind::F64 | MemKind::I64 => 8,
            MemKind::F80 => 10,
        }
    }
}

/// An operand: memory, or ST(i).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Src {
    Mem(MemKind),
    St(u8),
    Zero,
    One,
}

/// The four operations; `Sub`/`Div` are dest op src, `SubR`/`DivR`
/// src op dest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arith {
    Add,
    Mul,
    Sub,
    SubR,
    Div,
    DivR,
}

/// FCMOV's conditions (B, E, BE, U), each possibly negated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cond {
    /// 0 B (CF), 1 E (ZF), 2 BE (CF or ZF), 3 U (PF).
    pub test: u8,
    pub negate: bool,
}

impl Cond {
    fn holds(self, rflags: u64) -> bool {
        let v = match self.test & 3 {
            0 => rflags & CF != 0,
            1 => rflags & ZF != 0,
            2 => rflags & (CF | ZF) != 0,
            _ => rflags & PF != 0,
        };
        v != self.negate
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unary {
    Chs,
    Abs,
    Sqrt,
    RndInt,
}

/// A decoded x87 instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Push the operand.
    Load(Src),
    /// Store ST0 to memory (rounded by FCW, or truncated for FISTTP) or
    /// to ST(i), then pop if `pop`.
    Store {
        to: Src,
        pop: bool,
        truncate: bool,
    },
    /// ST(dest) = ST(dest) op src, then pop if `pop`.
    Arith {
        op: Arith,
        dest: u8,
        src: Src,
        pop: bool,
    },
    /// Compare ST0 with `src` into C3/C2/C0 (or ZF/PF/CF with `eflags`),
    /// then pop `pops` times.
    Compare {
        src: Src,
        pops: u8,
        eflags: bool,
    },
    Unary(Unary),
    /// FCMOVcc: ST0 = ST(i) if the condition holds on RFLAGS.
    CMov {
        cond: Cond,
        i: u8,
    },
    Xch(u8),
    Free(u8),
    Xam,
    /// FNSTSW AX.
    StswAx,
    Init,
    Clex,
}

impl Op {
    /// The memory operand this instruction reads, if any.
    pub fn reads(&self) -> Option<MemKind> {
        match *self {
            Op::Load(Src::Mem(k))
            | Op::Arith {
                src: Src::Mem(k), ..
            }
            | Op::Compare {
                src: Src::Mem(k), ..
            } => Some(k),
            _ => None,
        }
    }

    /// The memory operand this instruction writes, if any.
    pub fn writes(&self) -> Option<MemKind> {
        match *self {
            Op::Store {
                to: Src::Mem(k), ..
            } => Some(k),
            _ => None,
        }
    }
}

/// Decodes an x87 escape (`opcode` D8-DF) with its ModRM byte; `mem` says
/// whether ModRM names memory (mod != 3). None for what is not completed
/// here (the control moves are `fpu`'s).
pub fn decode(opcode: u8, modrm: u8, mem: bool) -> Option<Op> {
    let reg = (modrm >> 3) & 7;
    let i = modrm & 7;
    if mem {
        decode_mem(opcode, reg)
    } else {
        decode_reg(opcode, reg, i)
    }
}

fn arith_of(reg: u8) -> Option<Arith> {
    Some(match reg {
        0 => Arith::Add,
        1 => Arith::Mul,
        4 => Arith::Sub,
        5 => Arith::SubR,
        6 => Arith::Div,
        7 => Arith::DivR,
        _ => return None,
    })
}

fn decode_mem(opcode: u8, reg: u8) -> Option<Op> {
    use MemKind::*;
    // D8/DC/DA/DE: arithmetic and compares on f32/f64/i32/i16.
    let kind = match opcode {
        0xd8 => Some(F32),
        0xdc => Some(F64),
        0xda => Some(I32),
        0xde => Some(I16),
        _ => None,
    };
    if let Some(k) = kind {
        let src = Src::Mem(k);
        return Some(match reg {
            2 | 3 => Op::Compare {
                src,
                pops: reg - 2,
                eflags: false,
            },
            _ => Op::Arith {
                op: arith_of(reg)?,
                dest: 0,
                src,
                pop: false,
            },
        });
    }
    let store = |k, pop, truncate| Op::Store {
        to: Src::Mem(k),
        pop,
        truncate,
    };
    Some(match (opcode, reg) {
        (0xd9, 0) => Op::Load(Src::Mem(F32)),
        (0xd9, 2) => store(F32, false, false),
        (0xd9, 3) => store(F32, true, false),
        (0xdd, 0) => Op::Load(Src::Mem(F64)),
        (0xdd, 1) => store(I64, true, true),
        (0xdd, 2) => store(F64, false, false),
        (0xdd, 3) => store(F64, true, false),
        (0xdd, 7) => store(Status, false, false),
        (0xdb, 0) => Op::Load(Src::Mem(I32)),
        (0xdb, 1) => store(I32, true, true),
        (0xdb, 2) => store(I32, false, false),
        (0xdb, 3) => store(I32, true, false),
        (0xdb, 5) => Op::Load(Src::Mem(F80)),
        (0xdb, 7) => store(F80, true, false),
        (0xdf, 0) => Op::Load(Src::Mem(I16)),
        (0xdf, 1) => store(I16, true, true),
        (0xdf, 2) => store(I16, false, false),
        (0xdf, 3) => store(I16, true, false),
        (0xdf, 5) => Op::Load(Src::Mem(I64)),
        (0xdf, 7) => store(I64, true, false),
        _ => return None,
    })
}

fn decode_reg(opcode: u8, reg: u8, i: u8) -> Option<Op> {
    let st = Src::St(i);
    let cmp = |src, pops, eflags| Op::Compare { src, pops, eflags };
    Some(match (opcode, reg) {
        (0xd8, 2 | 3) => cmp(st, reg - 2, false),
        (0xd8, _) => Op::Arith {
            op: arith_of(reg)?,
            dest: 0,
            src: st,
            pop: false,
        },
        // DC and DE write ST(i), and their SUB/SUBR and DIV/DIVR
        // encodings are swapped against D8's.
        (0xdc | 0xde, 0 | 1 | 4..=7) => Op::Arith {
            op: arith_of(reg ^ u8::from(reg >= 4))?,
            dest: i,
            src: Src::St(0),
            pop: opcode == 0xde,
        },
        (0xde, 3) if i == 1 => cmp(Src::St(1), 2, false), // FCOMPP
        (0xd9, 0) => Op::Load(st),
        (0xd9, 1) => Op::Xch(i),
        (0xd9, 4) => match i {
            0 => Op::Unary(Unary::Chs),
            1 => Op::Unary(Unary::Abs),
            4 => cmp(Src::Zero, 0, false), // FTST
            5 => Op::Xam,
            _ => return None,
        },
        (0xd9, 5) => match i {
            0 => Op::Load(Src::One),
            6 => Op::Load(Src::Zero),
            _ => return None,
        },
        (0xd9, 7) => match i {
            2 => Op::Unary(Unary::Sqrt),
            4 => Op::Unary(Unary::RndInt),
            _ => return None,
        },
        (0xda, 5) if i == 1 => cmp(Src::St(1), 2, false), // FUCOMPP
        (0xda | 0xdb, 0..=3) => Op::CMov {
            cond: Cond {
                test: reg,
                negate: opcode == 0xdb,
            },
            i,
        },
        (0xdb, 4) => match i {
            2 => Op::Clex,
            3 => Op::Init,
            _ => return None,
        },
        (0xdb, 5 | 6) => cmp(st, 0, true), // FUCOMI, FCOMI
        (0xdf, 5 | 6) => cmp(st, 1, true), // FUCOMIP, FCOMIP
        (0xdd, 0) => Op::Free(i),
        (0xdd, 2 | 3) => Op::Store {
            to: st,
            pop: reg == 3,
            truncate: false,
        },
        (0xdd, 4 | 5) => cmp(st, reg - 4, false), // FUCOM, FUCOMP
        (0xdf, 4) if i == 0 => Op::StswAx,
        _ => return None,
    })
}

/// The register file as `KVM_GET_FPU` (FXSAVE) holds it: the registers in
/// stack order (`st[0]` is ST0), the abridged tag word by physical
/// register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct X87 {
    pub st: [[u8; 10]; 8],
    pub fcw: u16,
    pub fsw: u16,
    pub ftw: u8,
}

/// What the caller writes back besides the register file.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Effects {
    /// Bytes for the memory operand.
    pub store: Option<Vec<u8>>,
    /// New RFLAGS (FCOMI).
    pub rflags: Option<u64>,
    /// New AX (FNSTSW AX).
    pub ax: Option<u16>,
}

impl X87 {
    fn top(&self) -> u8 {
        ((self.fsw >> TOP_SHIFT) & 7) as u8
    }

    fn set_top(&mut self, top: u8) {
        self.fsw = (self.fsw & !(7 << TOP_SHIFT)) | (u16::from(top & 7) << TOP_SHIFT);
    }

    fn valid(&self, i: u8) -> bool {
        self.ftw & (1 << ((self.top() + i) & 7)) != 0
    }

    /// ST(i) as a double; an empty register is a stack underflow.
    fn get(&mut self, i: u8) -> Result<f64, Fault> {
        if !self.valid(i) {
            self.fsw = (self.fsw & !C1) | SF;
            return Err(Fault::Invalid);
        }
        Ok(Ext::from_bytes(&self.st[usize::from(i & 7)]).to_f64())
    }

    fn set(&mut self, i: u8, v: Ext) {
        self.st[usize::from(i & 7)] = v.to_bytes();
        self.ftw |= 1 << ((self.top() + i) & 7);
    }

    /// Pushes `v`; onto a full stack, pushes the indefinite instead
    /// (what a masked stack overflow does).
    fn push(&mut self, v: Ext) -> Result<(), Fault> {
        let full = self.ftw & (1 << (self.top().wrapping_sub(1) & 7)) != 0;
        self.st.rotate_right(1);
        self.set_top(self.top().wrapping_sub(1));
        if full {
            self.fsw |= SF | C1;
            self.set(0, Ext::INDEFINITE);
            return Err(Fault::Invalid);
        }
        self.set(0, v);
        Ok(())
    }

    fn pop(&mut self) {
        self.ftw &= !(1 << self.top());
        self.st.rotate_left(1);
        self.set_top(self.top() + 1);
    }
}

/// A floating-point exception the instruction raised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Invalid,
    ZeroDivide,
}

/// Executes `op` on `x`, with `input` the memory operand's bytes (as many
/// as `op.reads()` says) and `rflags` the vCPU's. None if the instruction
/// raises an exception the control word does not mask (nothing changed).
pub fn execute(x: &mut X87, op: Op, input: &[u8], rflags: u64) -> Option<Effects> {
    let mut next = *x;
    let mut fx = Effects::default();
    match run(&mut next, op, input, rflags, &mut fx) {
        Ok(()) => {}
        Err(fault) => {
            let (flag, mask) = match fault {
                Fault::Invalid => (IE, 1),
                Fault::ZeroDivide => (ZE, 1 << 2),
            };
            if x.fcw & mask == 0 {
                return None;
            }
            // Masked: the default result was written where it goes, and
            // the flag is sticky.
            next.fsw |= flag;
        }
    }
    *x = next;
    Some(fx)
}

/// The operand's value; memory from `input`.
fn value(x: &mut X87, src: Src, input: &[u8]) -> Result<Ext, Fault> {
    let le = |n: usize| -> u64 {
        let mut b = [0u8; 8];
        let n = n.min(input.len());
        b[..n].copy_from_slice(&input[..n]);
        u64::from_le_bytes(b)
    };
    Ok(match src {
        Src::Zero => Ext::ZERO,
        Src::One => Ext::from_f64(1.0),
        Src::St(i) => {
            x.get(i)?;
            Ext::from_bytes(&x.st[usize::from(i & 7)])
        }
        Src::Mem(k) => match k {
            MemKind::F32 => Ext::from_f64(f64::from(f32::from_bits(le(4) as u32))),
            MemKind::F64 => Ext::from_f64(f64::from_bits(le(8))),
            MemKind::F80 => {
                let mut b = [0u8; 10];
                let n = input.len().min(10);
                b[..n].copy_from_slice(&input[..n]);
                Ext::from_bytes(&b)
            }
            MemKind::I16 => Ext::from_i64(i64::from(le(2) as u16 as i16)),
            MemKind::I32 => Ext::from_i64(i64::from(le(4) as u32 as i32)),
            MemKind::I64 => Ext::from_i64(le(8) as i64),
            MemKind::Status => Ext::ZERO,
        },
    })
}

fn run(x: &mut X87, op: Op, input: &[u8], rflags: u64, fx: &mut Effects) -> Result<(), Fault> {
    x.fsw &= !C1;
    match op {
        Op::Load(src) => match value(x, src, input) {
            Ok(v) => x.push(v),
            Err(f) => x.push(Ext::INDEFINITE).and(Err(f)),
        },
        Op::Store { to, pop, truncate } => store(x, to, pop, truncate, fx),
        Op::Arith { op, dest, src, pop } => {
            let (a, b) = match (x.get(dest), value(x, src, input)) {
                (Ok(a), Ok(b)) => (a, b.to_f64()),
                _ => {
                    x.set(dest, Ext::INDEFINITE);
                    if pop {
                        x.pop();
                    }
                    return Err(Fault::Invalid);
                }
            };
            let (r, fault) = arith(op, a, b);
            x.set(dest, Ext::from_f64(r));
            if pop {
                x.pop();
            }
            fault.map_or(Ok(()), Err)
        }
        Op::Compare { src, pops, eflags } => compare(x, src, pops, eflags, input, rflags, fx),
        Op::Unary(u) => unary(x, u),
        Op::CMov { cond, i } => cmov(x, cond, i, rflags),
        Op::Xch(i) => {
            let (a, b) = (x.valid(0), x.valid(i));
            let (va, vb) = (x.st[0], x.st[usize::from(i & 7)]);
            if !(a && b) {
                x.fsw |= SF;
                x.set(0, Ext::INDEFINITE);
                x.set(i, Ext::INDEFINITE);
                return Err(Fault::Invalid);
            }
            x.st[0] = vb;
            x.st[usize::from(i & 7)] = va;
            Ok(())
        }
        Op::Free(i) => {
            x.ftw &= !(1 << ((x.top() + i) & 7));
            Ok(())
        }
        Op::Xam => {
            xam(x);
            Ok(())
        }
        Op::StswAx => {
            fx.ax = Some(x.fsw);
            Ok(())
        }
        Op::Init => {
            x.fcw = 0x37f;
            x.fsw = 0;
            x.ftw = 0;
            Ok(())
        }
        Op::Clex => {
            x.fsw &= !(0x80ff);
            Ok(())
        }
    }
}

/// FCMOVcc: ST0 = ST(i) when `cond` holds on `rflags`.
fn cmov(x: &mut X87, cond: Cond, i: u8, rflags: u64) -> Result<(), Fault> {
    let v = value(x, Src::St(i), &[]);
    let top = x.get(0);
    match (top, v) {
        (Ok(_), Ok(v)) => {
            if cond.holds(rflags) {
                x.set(0, v);
            }
            Ok(())
        }
        _ => {
            x.set(0, Ext::INDEFINITE);
            Err(Fault::Invalid)
        }
    }
}

/// FCOM/FUCOM/FCOMI and kin: ST0 against `src`, into C3/C2/C0 or (with
/// `eflags`) ZF/PF/CF, then `pops` pops.
fn compare(
    x: &mut X87,
    src: Src,
    pops: u8,
    eflags: bool,
    input: &[u8],
    rflags: u64,
    fx: &mut Effects,
) -> Result<(), Fault> {
    let (a, b) = (x.get(0), value(x, src, input));
    let empty = a.is_err() || b.is_err();
    let r = match (a, b) {
        (Ok(a), Ok(b)) => a.partial_cmp(&b.to_f64()),
        _ => None,
    };
    let (c3, c2, c0) = match r {
        Some(std::cmp::Ordering::Greater) => (false, false, false),
        Some(std::cmp::Ordering::Less) => (false, false, true),
        Some(std::cmp::Ordering::Equal) => (true, false, false),
        None => (true, true, true),
    };
    if eflags {
        let mut f = rflags & !(ZF | PF | CF | FCOMI_CLEARS);
        f |= if c3 { ZF } else { 0 } | if c2 { PF } else { 0 } | if c0 { CF } else { 0 };
        fx.rflags = Some(f);
    } else {
        x.fsw &= !(C3 | C2 | C0);
        x.fsw |= if c3 { C3 } else { 0 } | if c2 { C2 } else { 0 } | if c0 { C0 } else { 0 };
    }
    for _ in 0..pops {
        x.pop();
    }
    // An empty register is invalid; a NaN operand compares
    // unordered without a fault (FUCOM's rule, applied to FCOM too).
    if empty {
        return Err(Fault::Invalid);
    }
    Ok(())
}

/// FCHS, FABS, FSQRT, FRNDINT on ST0.
fn unary(x: &mut X87, u: Unary) -> Result<(), Fault> {
    let a = x.get(0)?;
    let r = match u {
        Unary::Chs => -a,
        Unary::Abs => a.abs(),
        Unary::Sqrt => a.sqrt(),
        Unary::RndInt => match Round::from_fcw(x.fcw) {
            Round::Nearest => a.round_ties_even(),
            Round::Down => a.floor(),
            Round::Up => a.ceil(),
            Round::Zero => a.trunc(),
        },
    };
    x.set(0, Ext::from_f64(r));
    if r.is_nan() && !a.is_nan() {
        return Err(Fault::Invalid);
    }
    Ok(())
}

fn arith(op: Arith, a: f64, b: f64) -> (f64, Option<Fault>) {
    let r = match op {
        Arith::Add => a + b,
        Arith::Mul => a * b,
        Arith::Sub => a - b,
        Arith::SubR => b - a,
        Arith::Div => a / b,
        Arith::DivR => b / a,
    };
    let divisor = match op {
        Arith::Div => b,
        Arith::DivR => a,
        _ => 1.0,
    };
    let fault = if r.is_nan() && !a.is_nan() && !b.is_nan() {
        Some(Fault::Invalid)
    } else if divisor == 0.0 && r.is_infinite() {
        Some(Fault::ZeroDivide)
    } else {
        None
    };
    (r, fault)
}

fn store(x: &mut X87, to: Src, pop: bool, truncate: bool, fx: &mut Effects) -> Result<(), Fault> {
    if to == Src::Mem(MemKind::Status) {
        // FNSTSW m16 stores the status word and leaves the stack alone.
        fx.store = Some(x.fsw.to_le_bytes().to_vec());
        return Ok(());
    }
    let v = x.get(0).map(|_| Ext::from_bytes(&x.st[0]));
    let mut fault = v.err();
    let v = v.unwrap_or(Ext::INDEFINITE);
    match to {
        Src::St(i) => x.set(i, v),
        Src::Mem(k) => {
            let bytes = match k {
                MemKind::F32 => (v.to_f64() as f32).to_bits().to_le_bytes().to_vec(),
                MemKind::F64 => v.to_f64().to_bits().to_le_bytes().to_vec(),
                MemKind::F80 => v.to_bytes().to_vec(),
                MemKind::Status | MemKind::I16 | MemKind::I32 | MemKind::I64 => {
                    let bits = 8 * k.width() as u32;
                    let round = if truncate {
                        Round::Zero
                    } else {
                        Round::from_fcw(x.fcw)
                    };
                    // Out of range: the integer indefinite (the lowest value).
                    let n = v.to_int(round, bits).unwrap_or_else(|| {
                        fault = Some(Fault::Invalid);
                        i64::MIN >> (64 - bits)
                    });
                    n.to_le_bytes()[..k.width()].to_vec()
                }
            };
            fx.store = Some(bytes);
        }
        Src::Zero | Src::One => {}
    }
    if pop {
        x.pop();
    }
    fault.map_or(Ok(()), Err)
}

fn xam(x: &mut X87) {
    let v = Ext::from_bytes(&x.st[0]);
    x.fsw &= !(C3 | C2 | C1 | C0);
    if v.sign {
        x.fsw |= C1;
    }
    x.fsw |= if !x.valid(0) {
        C3 | C0
    } else if v.is_nan() {
        C0
    } else if v.exp == 0x7fff {
        C2 | C0
    } else if v.mant == 0 {
        C3
    } else if v.exp == 0 {
        C3 | C2
    } else {
        C2
    };
}

#[cfg(test)]
mod tests;

//! Unit tests of the x87 completions: decoding of each form, and programs
//! of a few instructions run against the register file.

use super::*;

/// A reset x87 (FNINIT's state).
fn fresh() -> X87 {
    X87 {
        st: [[0; 10]; 8],
        fcw: 0x37f,
        fsw: 0,
        ftw: 0,
    }
}

fn st(x: &X87, i: usize) -> f64 {
    Ext::from_bytes(&x.st[i]).to_f64()
}

/// Decodes the bytes (opcode, ModRM) and runs them with memory `input`.
fn step(x: &mut X87, bytes: [u8; 2], input: &[u8]) -> Effects {
    let op = decode(bytes[0], bytes[1], bytes[1] >> 6 != 3).expect("decodes");
    execute(x, op, input, 0x2).expect("completes")
}

#[test]
fn decodes_what_compilers_emit() {
    // fild dword [..] (DB /0), fstp qword [..] (DD /3).
    assert_eq!(
        decode(0xdb, 0x44, true),
        Some(Op::Load(Src::Mem(MemKind::I32)))
    );
    assert_eq!(
        decode(0xdd, 0x5d, true),
        Some(Op::Store {
            to: Src::Mem(MemKind::F64),
            pop: true,
            truncate: false
        })
    );
    // fdivp st(1), st (DE F9): ST1 = ST1 / ST0, pop.
    assert_eq!(
        decode(0xde, 0xf9, false),
        Some(Op::Arith {
            op: Arith::Div,
            dest: 1,
            src: Src::St(0),
            pop: true
        })
    );
    // fsubrp st(1), st (DE E9 in Intel's table is FSUBP: ST1 = ST1 - ST0).
    assert_eq!(
        decode(0xde, 0xe9, false),
        Some(Op::Arith {
            op: Arith::Sub,
            dest: 1,
            src: Src::St(0),
            pop: true
        })
    );
    // fsub st, st(2) (D8 E2): ST0 = ST0 - ST2.
    assert_eq!(
        decode(0xd8, 0xe2, false),
        Some(Op::Arith {
            op: Arith::Sub,
            dest: 0,
            src: Src::St(2),
            pop: false
        })
    );
    // fucomip st, st(1) (DF E9), fnstsw ax (DF E0), fcompp (DE D9).
    assert_eq!(
        decode(0xdf, 0xe9, false),
        Some(Op::Compare {
            src: Src::St(1),
            pops: 1,
            eflags: true
        })
    );
    assert_eq!(decode(0xdf, 0xe0, false), Some(Op::StswAx));
    assert!(matches!(
        decode(0xde, 0xd9, false),
        Some(Op::Compare { pops: 2, .. })
    ));
    // Not completed here: FLDCW (fpu's), FSTENV, FSIN, FBLD.
    for (op, m, mem) in [
        (0xd9, 0x28, true),
        (0xd9, 0x30, true),
        (0xd9, 0xfe, false),
        (0xdf, 0x20, true),
        (0xd9, 0x08, true),
    ] {
        assert_eq!(decode(op, m, mem), None, "{op:02x} {m:02x}");
    }
}

#[test]
fn never_panics_on_any_opcode_and_modrm() {
    for op in 0xd8..=0xdf {
        for m in 0..=255u8 {
            for mem in [false, true] {
                if let Some(o) = decode(op, m, mem) {
                    let input = [0xffu8; 10];
                    let mut x = fresh();
                    let _ = execute(&mut x, o, &input[..o.reads().map_or(0, |k| k.width())], 0);
                    let _ = execute(&mut x, o, &[], 0);
                    let mut full = fresh();
                    full.ftw = 0xff;
                    let _ = execute(&mut full, o, &input, 0);
                }
            }
        }
    }
}

#[test]
fn int_to_double_and_back() {
    // (double)i / 1000.0 as an -mno-sse compiler writes it:
    // fild dword [i]; fdiv qword [k]; fstp qword [out].
    let mut x = fresh();
    step(&mut x, [0xdb, 0x00], &1234i32.to_le_bytes());
    assert_eq!(x.fsw >> 11 & 7, 7);
    assert_eq!(x.ftw, 1 << 7);
    step(&mut x, [0xdc, 0x30], &1000f64.to_le_bytes());
    let out = step(&mut x, [0xdd, 0x18], &[]);
    assert_eq!(out.store, Some(1.234f64.to_le_bytes().to_vec()));
    assert_eq!((x.fsw >> 11 & 7, x.ftw), (0, 0));
    // fld qword; fistp qword rounds to nearest even; fisttp truncates.
    step(&mut x, [0xdd, 0x00], &2.5f64.to_le_bytes());
    let out = step(&mut x, [0xdf, 0x38], &[]);
    assert_eq!(out.store, Some(2i64.to_le_bytes().to_vec()));
    step(&mut x, [0xdd, 0x00], &(-2.7f64).to_le_bytes());
    let out = step(&mut x, [0xdb, 0x08], &[]);
    assert_eq!(out.store, Some((-2i32).to_le_bytes().to_vec()));
    assert_eq!(x.ftw, 0);
}

#[test]
fn register_forms_and_the_stack() {
    let mut x = fresh();
    step(&mut x, [0xd9, 0xe8], &[]); // fld1
    step(&mut x, [0xdd, 0x00], &8f64.to_le_bytes()); // ST0 = 8, ST1 = 1
    step(&mut x, [0xd9, 0xc1], &[]); // fld st(1): 1, 8, 1
    assert_eq!((st(&x, 0), st(&x, 1), st(&x, 2)), (1.0, 8.0, 1.0));
    step(&mut x, [0xde, 0xe9], &[]); // fsubp st(1), st: ST1 = 8 - 1, pop
    assert_eq!((st(&x, 0), st(&x, 1)), (7.0, 1.0));
    step(&mut x, [0xd9, 0xc9], &[]); // fxch st(1)
    assert_eq!((st(&x, 0), st(&x, 1)), (1.0, 7.0));
    step(&mut x, [0xde, 0xf9], &[]); // fdivp: ST1 = 7 / 1
    assert_eq!(st(&x, 0), 7.0);
    step(&mut x, [0xd9, 0xe0], &[]); // fchs
    step(&mut x, [0xd9, 0xfa], &[]); // fsqrt of -7: invalid, masked
    assert!(st(&x, 0).is_nan());
    assert_ne!(x.fsw & IE, 0);
    step(&mut x, [0xdb, 0xe2], &[]); // fnclex
    assert_eq!(x.fsw & 0x80ff, 0);
    step(&mut x, [0xdd, 0xd8], &[]); // fstp st(0): pop
    assert_eq!(x.ftw, 0);
}

#[test]
fn compares_set_condition_codes_or_flags() {
    let mut x = fresh();
    step(&mut x, [0xdd, 0x00], &3f64.to_le_bytes());
    step(&mut x, [0xd8, 0x10], &5f32.to_le_bytes()); // fcom dword: 3 < 5
    assert_eq!(x.fsw & (C3 | C2 | C0), C0);
    step(&mut x, [0xdc, 0x10], &3f64.to_le_bytes()); // equal
    assert_eq!(x.fsw & (C3 | C2 | C0), C3);
    let out = step(&mut x, [0xdf, 0x00], &2i16.to_le_bytes()); // fild word 2
    assert_eq!(out, Effects::default());
    // fcomip st, st(1): 2 vs 3, CF set, pops.
    let fx = execute(&mut x, decode(0xdf, 0xf1, false).unwrap(), &[], 0x8c3).unwrap();
    assert_eq!(fx.rflags, Some(0x2 | CF));
    assert_eq!(st(&x, 0), 3.0);
    let fx = step(&mut x, [0xdf, 0xe0], &[]); // fnstsw ax
    assert_eq!(fx.ax, Some(x.fsw));
    let fx = step(&mut x, [0xdd, 0x38], &[]); // fnstsw word [..]
    assert_eq!(fx.store, Some(x.fsw.to_le_bytes().to_vec()));
    // On an empty stack too, without a fault.
    let mut empty = fresh();
    empty.fsw = 0x3800;
    let fx = step(&mut empty, [0xdd, 0x38], &[]);
    assert_eq!((fx.store, empty.fsw), (Some(vec![0, 0x38]), 0x3800));
    step(&mut x, [0xd9, 0xe5], &[]); // fxam: a normal positive
    assert_eq!(x.fsw & (C3 | C2 | C1 | C0), C2);
}

#[test]
fn conditional_moves_follow_rflags() {
    let mut x = fresh();
    step(&mut x, [0xd9, 0xe8], &[]); // fld1
    step(&mut x, [0xd9, 0xee], &[]); // fldz: ST0 0, ST1 1
    let run = |x: &mut X87, b: [u8; 2], rflags| {
        execute(x, decode(b[0], b[1], false).unwrap(), &[], rflags).unwrap();
    };
    // fcmovnbe st, st(1) (DB D1): moves when CF and ZF are both clear.
    run(&mut x, [0xdb, 0xd1], CF);
    assert_eq!(st(&x, 0), 0.0);
    run(&mut x, [0xdb, 0xd1], 0);
    assert_eq!(st(&x, 0), 1.0);
    step(&mut x, [0xd9, 0xe0], &[]); // fchs: ST0 -1
                                     // fcmove (DA C9) on ZF; fcmovu (DA D9) on PF; fcmovnb (DB C1) on !CF.
    run(&mut x, [0xda, 0xc9], 0);
    assert_eq!(st(&x, 0), -1.0);
    run(&mut x, [0xda, 0xc9], ZF);
    assert_eq!(st(&x, 0), 1.0);
    step(&mut x, [0xd9, 0xe0], &[]);
    run(&mut x, [0xda, 0xd9], PF);
    assert_eq!(st(&x, 0), 1.0);
    step(&mut x, [0xd9, 0xe0], &[]);
    run(&mut x, [0xdb, 0xc1], CF);
    assert_eq!(st(&x, 0), -1.0);
    assert_eq!(x.fsw >> 11 & 7, 6);
}

#[test]
fn faults_unmasked_are_refused_masked_give_defaults() {
    // Stack underflow with IM clear: refused, nothing changed.
    let mut x = fresh();
    x.fcw = 0x37e;
    let before = x;
    assert_eq!(
        execute(&mut x, decode(0xdd, 0x18, true).unwrap(), &[], 0),
        None
    );
    assert_eq!(x, before);
    // Masked: the indefinite is stored (QNaN for a double, the lowest
    // integer for an integer store).
    let mut x = fresh();
    let fx = step(&mut x, [0xdd, 0x18], &[]);
    assert_eq!(
        fx.store,
        Some(Ext::INDEFINITE.to_f64().to_bits().to_le_bytes().to_vec())
    );
    assert_ne!(x.fsw & (IE | SF), 0);
    let mut x = fresh();
    step(&mut x, [0xdd, 0x00], &1e20f64.to_le_bytes());
    let fx = step(&mut x, [0xdb, 0x18], &[]);
    assert_eq!(fx.store, Some(i32::MIN.to_le_bytes().to_vec()));
    // Division by zero: masked gives infinity and ZE; unmasked refused.
    let mut x = fresh();
    step(&mut x, [0xd9, 0xe8], &[]);
    step(&mut x, [0xdc, 0x30], &0f64.to_le_bytes());
    assert_eq!(st(&x, 0), f64::INFINITY);
    assert_ne!(x.fsw & ZE, 0);
    x.fcw = 0x37b;
    assert_eq!(
        execute(
            &mut x,
            decode(0xdc, 0x30, true).unwrap(),
            &0f64.to_le_bytes(),
            0
        ),
        None
    );
    // A ninth push overflows: the indefinite, SF and C1.
    let mut x = fresh();
    for _ in 0..8 {
        step(&mut x, [0xd9, 0xe8], &[]);
    }
    step(&mut x, [0xd9, 0xee], &[]);
    assert!(st(&x, 0).is_nan());
    assert_eq!(x.fsw & (SF | C1 | IE), SF | C1 | IE);
}

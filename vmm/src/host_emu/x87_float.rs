//! The x87's 80-bit extended format: conversions to and from `f64` and
//! integers, for the x87 completions (`x87`). Pure.
//!
//! Integers convert exactly both ways (with the x87's four rounding
//! modes); `f64` converts exactly into the format and rounds to nearest
//! even out of it. Arithmetic is done by the caller in `f64`.

/// An 80-bit extended value as the x87 and FXSAVE keep it: 64-bit
/// significand with an explicit integer bit, 15-bit exponent (bias
/// 16383), sign.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ext {
    pub sign: bool,
    pub exp: u16,
    pub mant: u64,
}

const BIAS: i32 = 16383;
const EXP_MAX: u16 = 0x7fff;
const INT_BIT: u64 = 1 << 63;
const QUIET_BIT: u64 = 1 << 62;

/// The x87's rounding modes (FCW.RC).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round {
    Nearest,
    Down,
    Up,
    Zero,
}

impl Round {
    /// From the control word's RC field (bits 10-11).
    pub fn from_fcw(fcw: u16) -> Round {
        match (fcw >> 10) & 3 {
            0 => Round::Nearest,
            1 => Round::Down,
            2 => Round::Up,
            _ => Round::Zero,
        }
    }
}

impl Ext {
    pub const ZERO: Ext = Ext {
        sign: false,
        exp: 0,
        mant: 0,
    };
    /// The "real indefinite" a masked invalid operation gives: a negative
    /// quiet NaN.
    pub const INDEFINITE: Ext = Ext {
        sign: true,
        exp: EXP_MAX,
        mant: INT_BIT | QUIET_BIT,
    };

    /// From the 10 bytes of memory or FXSAVE (little-endian).
    pub fn from_bytes(b: &[u8; 10]) -> Ext {
        let mut m = [0u8; 8];
        m.copy_from_slice(&b[..8]);
        let se = u16::from_le_bytes([b[8], b[9]]);
        Ext {
            sign: se & 0x8000 != 0,
            exp: se & EXP_MAX,
            mant: u64::from_le_bytes(m),
        }
    }

    /// To the 10 bytes of memory or FXSAVE.
    pub fn to_bytes(self) -> [u8; 10] {
        let mut b = [0u8; 10];
        b[..8].copy_from_slice(&self.mant.to_le_bytes());
        let se = self.exp | if self.sign { 0x8000 } else { 0 };
        b[8..].copy_from_slice(&se.to_le_bytes());
        b
    }

    /// A NaN (exponent all ones, significand other than the integer bit).
    pub fn is_nan(self) -> bool {
        self.exp == EXP_MAX && self.mant << 1 != 0
    }

    /// Exact: every double is an extended value.
    pub fn from_f64(x: f64) -> Ext {
        let bits = x.to_bits();
        let sign = bits >> 63 != 0;
        let e = ((bits >> 52) & 0x7ff) as i32;
        let f = bits & ((1 << 52) - 1);
        let (exp, mant) = match (e, f) {
            (0, 0) => (0, 0),
            (0, f) => {
                // A double denormal: f * 2^-1074, normal here.
                let lz = f.leading_zeros() as i32;
                ((63 - lz - 1074 + BIAS) as u16, f << lz)
            }
            (0x7ff, 0) => (EXP_MAX, INT_BIT),
            (0x7ff, f) => (EXP_MAX, INT_BIT | QUIET_BIT | (f << 11)),
            (e, f) => ((e - 1023 + BIAS) as u16, INT_BIT | (f << 11)),
        };
        Ext { sign, exp, mant }
    }

    /// Rounded to nearest even (NaNs stay NaNs, quieted; values beyond
    /// the double's range become infinities or zeros).
    pub fn to_f64(self) -> f64 {
        let signed = |v: f64| if self.sign { -v } else { v };
        if self.exp == EXP_MAX {
            if self.mant << 1 == 0 {
                return signed(f64::INFINITY);
            }
            let payload = (self.mant << 1) >> 12;
            let bits = (0x7ffu64 << 52) | (1 << 51) | payload;
            return signed(f64::from_bits(bits));
        }
        if self.mant == 0 {
            return signed(0.0);
        }
        // value = mant * 2^(exp - BIAS - 63); `as` rounds to nearest even,
        // and scaling by a power of two is exact within the normal range.
        let m = self.mant as f64;
        signed(scale(m, i32::from(self.exp) - BIAS - 63))
    }

    /// Exact.
    pub fn from_i64(v: i64) -> Ext {
        if v == 0 {
            return Ext::ZERO;
        }
        let a = v.unsigned_abs();
        let lz = a.leading_zeros();
        Ext {
            sign: v < 0,
            exp: (BIAS + 63 - lz as i32) as u16,
            mant: a << lz,
        }
    }

    /// Rounded by `round` to an integer of `bits` bits (16, 32 or 64); None
    /// if it does not fit (or is a NaN or infinity): the caller stores the
    /// "integer indefinite" and signals invalid.
    pub fn to_int(self, round: Round, bits: u32) -> Option<i64> {
        if self.exp == EXP_MAX {
            return None;
        }
        if self.mant == 0 {
            return Some(0);
        }
        let e = i32::from(self.exp) - BIAS; // value = mant * 2^(e - 63)
        if e >= 64 {
            return None;
        }
        // Integer part and the bits below it: `half` the first of them,
        // `sticky` whether any other is set.
        let (int, half, sticky) = if e >= 63 {
            (u128::from(self.mant), false, false)
        } else if e >= 0 {
            let shift = 63 - e as u32;
            let rest = self.mant & ((1u64 << shift) - 1);
            let half_bit = 1u64 << (shift - 1);
            (
                u128::from(self.mant >> shift),
                rest & half_bit != 0,
                rest & (half_bit - 1) != 0,
            )
        } else if e == -1 {
            (0, true, self.mant << 1 != 0)
        } else {
            (0, false, true)
        };
        let inexact = half || sticky;
        let up = match round {
            Round::Nearest => half && (sticky || int & 1 == 1),
            Round::Zero => false,
            Round::Down => self.sign && inexact,
            Round::Up => !self.sign && inexact,
        };
        let magnitude = int + u128::from(up);
        let limit = 1u128 << (bits - 1);
        if self.sign {
            if magnitude > limit {
                return None;
            }
            Some((-(magnitude as i128)) as i64)
        } else {
            if magnitude >= limit {
                return None;
            }
            Some(magnitude as i64)
        }
    }
}

/// `x * 2^n` (exact unless the result leaves the double's normal range).
fn scale(mut x: f64, mut n: i32) -> f64 {
    let step = |k: i32| f64::from_bits(((k + 1023) as u64) << 52);
    while n > 1000 {
        x *= step(1000);
        n -= 1000;
        if x.is_infinite() {
            return x;
        }
    }
    while n < -1000 {
        x *= step(-1000);
        n += 1000;
        if x == 0.0 {
            return x;
        }
    }
    x * step(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_round_trip_exactly() {
        for x in [
            0.0,
            -0.0,
            1.0,
            -2.5,
            0.1,
            1e300,
            -1e-300,
            f64::MAX,
            f64::MIN_POSITIVE,
            5e-324,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1234567.875,
        ] {
            let e = Ext::from_f64(x);
            assert_eq!(e.to_f64().to_bits(), x.to_bits(), "{x}");
            assert_eq!(Ext::from_bytes(&e.to_bytes()), e);
        }
        assert!(Ext::from_f64(f64::NAN).to_f64().is_nan());
        assert!(Ext::INDEFINITE.to_f64().is_nan());
        // 1.0 is exponent 16383, significand 1 << 63.
        assert_eq!(
            Ext::from_f64(1.0).to_bytes(),
            [0, 0, 0, 0, 0, 0, 0, 0x80, 0xff, 0x3f]
        );
    }

    #[test]
    fn extended_values_round_to_nearest_even() {
        // 1 + 2^-53 (a tie) rounds to 1; 1 + 3*2^-54 rounds up.
        let one = Ext::from_f64(1.0);
        let tie = Ext {
            mant: one.mant | (1 << 10),
            ..one
        };
        assert_eq!(tie.to_f64(), 1.0);
        let above = Ext {
            mant: one.mant | (3 << 9),
            ..one
        };
        assert_eq!(above.to_f64(), 1.0 + f64::EPSILON);
        // Beyond the double's range.
        let huge = Ext { exp: 0x7000, ..one };
        assert_eq!(huge.to_f64(), f64::INFINITY);
        let tiny = Ext { exp: 1, ..one };
        assert_eq!(tiny.to_f64(), 0.0);
    }

    #[test]
    fn integers_convert_exactly_and_round_by_mode() {
        for v in [0i64, 1, -1, 42, -100_000, i64::MAX, i64::MIN, 1 << 53 | 1] {
            assert_eq!(Ext::from_i64(v).to_int(Round::Nearest, 64), Some(v), "{v}");
        }
        assert_eq!(Ext::from_i64(-7).to_f64(), -7.0);
        let r = |x: f64, m, bits| Ext::from_f64(x).to_int(m, bits);
        assert_eq!(r(2.5, Round::Nearest, 32), Some(2));
        assert_eq!(r(3.5, Round::Nearest, 32), Some(4));
        assert_eq!(r(-2.5, Round::Nearest, 32), Some(-2));
        assert_eq!(r(2.7, Round::Zero, 32), Some(2));
        assert_eq!(r(-2.7, Round::Zero, 32), Some(-2));
        assert_eq!(r(2.1, Round::Up, 32), Some(3));
        assert_eq!(r(-2.1, Round::Down, 32), Some(-3));
        assert_eq!(r(0.5, Round::Nearest, 32), Some(0));
        assert_eq!(r(0.75, Round::Nearest, 32), Some(1));
        assert_eq!(r(0.25, Round::Up, 32), Some(1));
        assert_eq!(r(-0.25, Round::Up, 32), Some(0));
        assert_eq!(r(32767.0, Round::Nearest, 16), Some(32767));
        assert_eq!(r(-32768.0, Round::Nearest, 16), Some(-32768));
        assert_eq!(r(32768.0, Round::Nearest, 16), None);
        assert_eq!(r(1e30, Round::Nearest, 64), None);
        assert_eq!(r(f64::NAN, Round::Nearest, 32), None);
        assert_eq!(r(f64::INFINITY, Round::Zero, 64), None);
    }
}

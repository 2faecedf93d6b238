//! The CMOS real-time clock and its RAM, as PCs have it (an MC146818):
//! port 0x70 selects a register (bit 7 masks NMIs), port 0x71 reads or
//! writes it. Firmware and Windows read the wall-clock date and time here,
//! and firmware the memory-size bytes.
//!
//! The clock is the host's wall clock plus an offset in whole seconds that
//! the guest sets by writing the time registers (directly, or with `SET` in
//! register B held while it writes them all, as Linux does). Its registers
//! are computed at each read, in the format register B asks for (BCD or
//! binary, 24- or 12-hour), so a read never races an update and `UIP`
//! (register A, bit 7) always reads 0.
//!
//! Not emulated: the RTC's interrupts (periodic, alarm, update-ended):
//! register C reads 0 and IRQ 8 is never raised. Alarm registers are plain
//! RAM. Driven by whichever vCPU thread exits on the ports; never blocks
//! and never panics, whatever the guest writes (a date that does not exist
//! leaves the clock where it was, and is counted).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use migration::devices::RtcState;
use time::{Date, Month, OffsetDateTime, PrimitiveDateTime, Time};

use crate::bus::BusDevice;

/// The first of the RTC's two ports.
pub const RTC_PORT: u64 = 0x70;
/// Index and data.
pub const RTC_PORTS: u64 = 2;
/// Bytes of CMOS RAM, registers included.
pub const CMOS_BYTES: usize = 128;

const SECONDS: usize = 0x00;
const MINUTES: usize = 0x02;
const HOURS: usize = 0x04;
const WEEKDAY: usize = 0x06;
const DAY: usize = 0x07;
const MONTH: usize = 0x08;
const YEAR: usize = 0x09;
const REG_A: usize = 0x0a;
const REG_B: usize = 0x0b;
const REG_C: usize = 0x0c;
const REG_D: usize = 0x0d;
/// The century, where QEMU and SeaBIOS keep it (ACPI's FADT can name it).
const CENTURY: usize = 0x32;
/// The registers that hold the time: read from the clock, written to it.
const TIME_REGS: [usize; 8] = [SECONDS, MINUTES, HOURS, WEEKDAY, DAY, MONTH, YEAR, CENTURY];

const A_UIP: u8 = 0x80;
/// 32.768 kHz time base, 1024 Hz periodic rate: what firmware sets.
const A_DEFAULT: u8 = 0x26;
const B_SET: u8 = 0x80;
const B_BINARY: u8 = 0x04;
const B_24H: u8 = 0x02;
/// Valid RAM and time: the battery is good.
const D_VRT: u8 = 0x80;
const HOUR_PM: u8 = 0x80;

/// A saved RTC state that is not one.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RtcError {
    /// CMOS RAM of another size than 128 bytes.
    #[error("{0} bytes of CMOS RAM, not {CMOS_BYTES}")]
    RamSize(usize),
}

/// Where guest memory lies, as the memory-size bytes tell firmware.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemorySizes {
    /// Bytes of RAM below 4 GiB (from address 0).
    pub below_4g: u64,
    /// Bytes of RAM from 4 GiB up.
    pub above_4g: u64,
}

/// The wall clock: seconds since the Unix epoch.
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// The host's wall clock.
pub fn host_clock() -> Clock {
    Arc::new(|| match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    })
}

/// The RTC with its CMOS RAM.
pub struct Rtc {
    index: u8,
    ram: [u8; CMOS_BYTES],
    offset_s: i64,
    clock: Clock,
    bad_dates: u64,
}

impl Rtc {
    /// An RTC on `clock` showing its time, with the memory-size bytes for
    /// `mem`, in BCD and 24-hour mode as firmware leaves it.
    pub fn new(mem: MemorySizes, clock: Clock) -> Rtc {
        let mut ram = [0u8; CMOS_BYTES];
        ram[REG_A] = A_DEFAULT;
        ram[REG_B] = B_24H;
        ram[REG_D] = D_VRT;
        let mut put16 = |at: usize, v: u64| {
            let v = v.min(0xffff);
            ram[at] = v as u8;
            ram[at + 1] = (v >> 8) as u8;
        };
        // Base memory in KiB (640); memory above 1 MiB in KiB, twice (the
        // second copy is the one BIOSes read); memory above 16 MiB (below
        // 4 GiB) in 64 KiB units.
        put16(0x15, 640);
        let above_1m = mem.below_4g.saturating_sub(1 << 20) >> 10;
        put16(0x17, above_1m);
        put16(0x30, above_1m);
        put16(0x34, mem.below_4g.saturating_sub(16 << 20) >> 16);
        // Memory above 4 GiB in 64 KiB units, three bytes.
        let high = (mem.above_4g >> 16).min(0xff_ffff);
        ram[0x5b] = high as u8;
        ram[0x5c] = (high >> 8) as u8;
        ram[0x5d] = (high >> 16) as u8;
        // The PC checksum over bytes 0x10-0x2d, big-endian at 0x2e.
        let sum = ram[0x10..=0x2d].iter().map(|&b| u16::from(b)).sum::<u16>();
        [ram[0x2e], ram[0x2f]] = sum.to_be_bytes();
        Rtc {
            index: 0,
            ram,
            offset_s: 0,
            clock,
            bad_dates: 0,
        }
    }

    /// Writes the guest made of dates that do not exist (ignored).
    pub fn bad_dates(&self) -> u64 {
        self.bad_dates
    }

    /// The RTC's state, for a snapshot.
    pub fn state(&self) -> RtcState {
        RtcState {
            index: self.index,
            ram: self.ram.to_vec(),
            offset_s: self.offset_s,
        }
    }

    /// Puts the RTC in a saved state; refused (nothing changes) unless it
    /// holds exactly the CMOS RAM's 128 bytes.
    pub fn restore(&mut self, s: &RtcState) -> Result<(), RtcError> {
        self.ram = <[u8; CMOS_BYTES]>::try_from(s.ram.as_slice())
            .map_err(|_| RtcError::RamSize(s.ram.len()))?;
        self.index = s.index;
        self.offset_s = s.offset_s;
        Ok(())
    }

    fn now(&self) -> i64 {
        (self.clock)().saturating_add(self.offset_s)
    }

    fn frozen(&self) -> bool {
        self.ram[REG_B] & B_SET != 0
    }

    fn read_reg(&self, reg: usize) -> u8 {
        match reg {
            REG_A => self.ram[REG_A] & !A_UIP,
            REG_C => 0,
            REG_D => D_VRT,
            r if TIME_REGS.contains(&r) && !self.frozen() => {
                encode_time(self.now(), self.ram[REG_B])[r]
            }
            r => self.ram[r],
        }
    }

    fn write_reg(&mut self, reg: usize, v: u8) {
        match reg {
            REG_A => self.ram[REG_A] = v & !A_UIP,
            REG_B => {
                let was_set = self.frozen();
                if v & B_SET != 0 && !was_set {
                    // The clock stops where it is: the guest writes the
                    // registers it wants changed and lets it go again.
                    self.hold_time();
                }
                self.ram[REG_B] = v;
                if v & B_SET == 0 && was_set {
                    self.set_from_registers();
                }
            }
            REG_C | REG_D => {}
            r if TIME_REGS.contains(&r) => {
                if self.frozen() {
                    self.ram[r] = v;
                } else {
                    self.hold_time();
                    self.ram[r] = v;
                    self.set_from_registers();
                }
            }
            r => self.ram[r] = v,
        }
    }

    /// Copies the running time into the time registers.
    fn hold_time(&mut self) {
        let now = encode_time(self.now(), self.ram[REG_B]);
        for r in TIME_REGS {
            self.ram[r] = now[r];
        }
    }

    /// Sets the clock to what the time registers say.
    fn set_from_registers(&mut self) {
        match decode_time(&self.ram, self.ram[REG_B]) {
            Some(t) => self.offset_s = t.saturating_sub((self.clock)()),
            None => {
                self.bad_dates += 1;
                log::warn!("rtc: the guest set a date that does not exist; the clock runs on");
            }
        }
    }
}

impl BusDevice for Rtc {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0xff);
        if let (1, Some(b)) = (offset, data.first_mut()) {
            *b = self.read_reg(usize::from(self.index & 0x7f));
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&v) = data.first() else { return };
        match offset {
            0 => self.index = v,
            1 => self.write_reg(usize::from(self.index & 0x7f), v),
            _ => {}
        }
    }
}

fn to_bcd(v: u8) -> u8 {
    ((v / 10) << 4) | (v % 10)
}

fn from_bcd(v: u8) -> Option<u8> {
    let (hi, lo) = (v >> 4, v & 0xf);
    (hi <= 9 && lo <= 9).then_some(hi * 10 + lo)
}

/// The time registers (indexed by register number) for `t`, in register
/// B's format.
fn encode_time(t: i64, reg_b: u8) -> [u8; CMOS_BYTES] {
    // Out of the calendar's range only if the guest set a clock ten
    // thousand years off; it then reads the epoch.
    let dt = OffsetDateTime::from_unix_timestamp(t).unwrap_or(OffsetDateTime::UNIX_EPOCH);
    let fmt = |v: u8| if reg_b & B_BINARY != 0 { v } else { to_bcd(v) };
    let mut r = [0u8; CMOS_BYTES];
    r[SECONDS] = fmt(dt.second());
    r[MINUTES] = fmt(dt.minute());
    r[HOURS] = if reg_b & B_24H != 0 {
        fmt(dt.hour())
    } else {
        let h12 = match dt.hour() % 12 {
            0 => 12,
            h => h,
        };
        fmt(h12) | if dt.hour() >= 12 { HOUR_PM } else { 0 }
    };
    r[WEEKDAY] = fmt(dt.weekday().number_from_sunday());
    r[DAY] = fmt(dt.day());
    r[MONTH] = fmt(u8::from(dt.month()));
    let year = dt.year().rem_euclid(10_000);
    r[YEAR] = fmt((year % 100) as u8);
    r[CENTURY] = fmt((year / 100) as u8);
    r
}

/// The time the time registers hold, in register B's format; `None` if
/// they do not hold a date and time that exist.
fn decode_time(ram: &[u8; CMOS_BYTES], reg_b: u8) -> Option<i64> {
    let get = |r: usize| -> Option<u8> {
        let v = ram[r];
        if reg_b & B_BINARY != 0 {
            Some(v)
        } else {
            from_bcd(v)
        }
    };
    let hour = if reg_b & B_24H != 0 {
        get(HOURS)?
    } else {
        let pm = ram[HOURS] & HOUR_PM != 0;
        let h = {
            let v = ram[HOURS] & !HOUR_PM;
            if reg_b & B_BINARY != 0 {
                v
            } else {
                from_bcd(v)?
            }
        };
        match (h, pm) {
            (1..=11, false) => h,
            (12, false) => 0,
            (1..=11, true) => h + 12,
            (12, true) => 12,
            _ => return None,
        }
    };
    let year = i32::from(get(CENTURY)?) * 100 + i32::from(get(YEAR)?);
    let month = Month::try_from(get(MONTH)?).ok()?;
    let date = Date::from_calendar_date(year, month, get(DAY)?).ok()?;
    let time = Time::from_hms(hour, get(MINUTES)?, get(SECONDS)?).ok()?;
    Some(
        PrimitiveDateTime::new(date, time)
            .assume_utc()
            .unix_timestamp(),
    )
}

#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicI64, Ordering};

use super::*;

/// 2026-12-03 16:41:26 UTC, a Thursday.
const T0: i64 = 1_796_316_086;

fn rtc_at(t: Arc<AtomicI64>, mem: MemorySizes) -> Rtc {
    Rtc::new(mem, Arc::new(move || t.load(Ordering::SeqCst)))
}

fn rtc() -> (Rtc, Arc<AtomicI64>) {
    let t = Arc::new(AtomicI64::new(T0));
    (rtc_at(t.clone(), MemorySizes::default()), t)
}

fn get(rtc: &mut Rtc, reg: u8) -> u8 {
    rtc.write(0, &[reg]);
    let mut b = [0u8];
    rtc.read(1, &mut b);
    b[0]
}

fn set(rtc: &mut Rtc, reg: u8, v: u8) {
    rtc.write(0, &[reg]);
    rtc.write(1, &[v]);
}

/// Seconds, minutes, hours, weekday, day, month, year, century.
fn time_regs(rtc: &mut Rtc) -> [u8; 8] {
    TIME_REGS.map(|r| get(rtc, r as u8))
}

#[test]
fn reads_the_wall_clock_in_bcd_and_24_hours() {
    let (mut r, t) = rtc();
    assert_eq!(
        time_regs(&mut r),
        [0x26, 0x41, 0x16, 0x05, 0x03, 0x12, 0x26, 0x20]
    );
    t.store(T0 + 35, Ordering::SeqCst);
    assert_eq!(get(&mut r, 0), 0x01);
    assert_eq!(get(&mut r, 2), 0x42);
    // The status registers: no update in progress, no interrupt flags,
    // the battery good.
    assert_eq!(get(&mut r, 0x0a), A_DEFAULT);
    assert_eq!(get(&mut r, 0x0c), 0);
    assert_eq!(get(&mut r, 0x0d), D_VRT);
}

#[test]
fn binary_and_12_hour_formats() {
    let (mut r, _) = rtc();
    set(&mut r, 0x0b, B_BINARY);
    assert_eq!(time_regs(&mut r), [26, 41, 4 | HOUR_PM, 5, 3, 12, 26, 20]);
    set(&mut r, 0x0b, 0);
    assert_eq!(get(&mut r, 4), 0x04 | HOUR_PM);
}

#[test]
fn linux_sets_the_clock_with_set_held_and_it_runs_on() {
    let (mut r, t) = rtc();
    // 2031-02-28 23:59:58, as Linux's mc146818_set_time writes it.
    set(&mut r, 0x0b, B_24H | B_SET);
    for (reg, v) in [
        (0, 0x58),
        (2, 0x59),
        (4, 0x23),
        (7, 0x28),
        (8, 0x02),
        (9, 0x31),
    ] {
        set(&mut r, reg, v);
    }
    // Held while SET is on, whatever the host clock does.
    t.store(T0 + 100, Ordering::SeqCst);
    assert_eq!(get(&mut r, 0), 0x58);
    set(&mut r, 0x0b, B_24H);
    t.store(T0 + 103, Ordering::SeqCst);
    // Three seconds later it is March.
    assert_eq!(
        time_regs(&mut r),
        [0x01, 0x00, 0x00, 0x07, 0x01, 0x03, 0x31, 0x20]
    );
    assert_eq!(r.state().offset_s, 1_930_089_598 - (T0 + 100));
    assert_eq!(r.bad_dates(), 0);
}

#[test]
fn one_register_written_while_the_clock_runs() {
    let (mut r, _) = rtc();
    set(&mut r, 9, 0x30);
    assert_eq!(
        time_regs(&mut r),
        [0x26, 0x41, 0x16, 0x03, 0x03, 0x12, 0x30, 0x20]
    );
}

#[test]
fn dates_that_do_not_exist_are_counted_and_ignored() {
    let (mut r, _) = rtc();
    let before = time_regs(&mut r);
    // Month 13, seconds not in BCD, hour 24, century not in BCD, day 0.
    for (reg, v) in [(8, 0x13), (0, 0x1a), (4, 0x24), (0x32, 0xff), (7, 0x00)] {
        set(&mut r, reg, v);
        assert_eq!(time_regs(&mut r), before, "register {reg:#x} = {v:#x}");
    }
    assert_eq!((r.bad_dates(), r.state().offset_s), (5, 0));
    // 3 February is a date; 30 February is not.
    set(&mut r, 8, 0x02);
    set(&mut r, 7, 0x30);
    assert_eq!(r.bad_dates(), 6);
    assert_eq!((get(&mut r, 7), get(&mut r, 8)), (0x03, 0x02));
}

#[test]
fn memory_size_bytes() {
    let t = Arc::new(AtomicI64::new(T0));
    let mut r = rtc_at(
        t,
        MemorySizes {
            below_4g: 3 << 30,
            above_4g: 3 << 30,
        },
    );
    let word = |r: &mut Rtc, at: u8| u32::from(get(r, at)) | u32::from(get(r, at + 1)) << 8;
    assert_eq!(word(&mut r, 0x15), 640);
    assert_eq!(word(&mut r, 0x17), 0xffff, "capped");
    assert_eq!(word(&mut r, 0x30), 0xffff, "capped");
    assert_eq!(word(&mut r, 0x34), ((3 << 30) - (16 << 20)) >> 16);
    let high = word(&mut r, 0x5b) | u32::from(get(&mut r, 0x5d)) << 16;
    assert_eq!(high, (3 << 30) >> 16);
    let sum: u32 = (0x10..=0x2d).map(|i| u32::from(get(&mut r, i))).sum();
    assert_eq!(
        u32::from(get(&mut r, 0x2e)) << 8 | u32::from(get(&mut r, 0x2f)),
        sum
    );

    let mut small = rtc_at(
        Arc::new(AtomicI64::new(T0)),
        MemorySizes {
            below_4g: 48 << 20,
            above_4g: 0,
        },
    );
    assert_eq!(word(&mut small, 0x30), 47 * 1024);
    assert_eq!(word(&mut small, 0x34), (32 << 20) >> 16);
    assert_eq!(get(&mut small, 0x5b), 0);
}

#[test]
fn state_round_trip_keeps_the_guests_offset_and_ram() {
    let (mut r, t) = rtc();
    set(&mut r, 9, 0x35);
    set(&mut r, 0x40, 0xab);
    let s = r.state();
    // Restored an hour later (host time): the guest's clock is an hour on.
    t.store(T0 + 3600, Ordering::SeqCst);
    let (mut fresh, _) = rtc();
    let clock = t.clone();
    fresh.clock = Arc::new(move || clock.load(Ordering::SeqCst));
    fresh.restore(&s).unwrap();
    assert_eq!(get(&mut fresh, 0x40), 0xab);
    assert_eq!(
        time_regs(&mut fresh),
        [0x26, 0x41, 0x17, 0x02, 0x03, 0x12, 0x35, 0x20]
    );
    let bad = RtcState {
        ram: vec![0; 127],
        ..s
    };
    assert_eq!(fresh.restore(&bad), Err(RtcError::RamSize(127)));
    assert_eq!(
        get(&mut fresh, 0x40),
        0xab,
        "a refused state changes nothing"
    );
}

#[test]
fn every_access_is_answered_without_a_panic() {
    let (mut r, _) = rtc();
    for index in 0..=255u8 {
        for len in 0..4 {
            for offset in 0..4 {
                let mut b = vec![0u8; len];
                r.write(0, &[index]);
                r.read(offset, &mut b);
                if offset == 0 {
                    assert!(b.iter().all(|&x| x == 0xff), "port 0x70 reads all ones");
                }
                r.write(offset, &b);
                r.write(offset, &vec![index; len]);
            }
        }
    }
    // The index's bit 7 is the NMI mask: register 0x8b is register B.
    r.write(0, &[0x8b]);
    r.write(1, &[B_24H | B_BINARY]);
    assert_eq!(get(&mut r, 0x0b), B_24H | B_BINARY);
}

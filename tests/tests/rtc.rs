//! The CMOS RTC on a real guest (the run's base guest, restored): the
//! guest kernel's rtc_cmos driver reads the host's wall-clock time from
//! it; its RAM, read through /dev/nvram, holds the memory-size bytes and
//! a valid PC checksum; a time the guest sets with `hwclock -w` keeps its
//! offset to the host's clock; and that offset survives a snapshot and a
//! restore in a new process (the RTC's `dev.rtc` state section).

use std::time::Duration;

use tandem_tests::base::{device_args, disk_copy, scratch, HOST_IP0, PREFIX};
use tandem_tests::netns::NetNs;
use tandem_tests::rtc::{assert_offset, set_ahead};
use tandem_tests::{ctl, phase, tandem_bin, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
/// The RTC is set this far ahead of the host: a year, a day, an hour.
const AHEAD_S: i64 = 366 * 86_400 + 3_600;
const AHEAD: f64 = AHEAD_S as f64;
/// How much of the offset setting it may lose: the time from the host's
/// clock read to the guest's `date -s` (one guest command).
const SET_SLACK: f64 = 3.0;

/// The guest's CMOS RAM from byte 14 on (what /dev/nvram gives), as bytes.
fn nvram(vm: &mut TestVm) -> Vec<u8> {
    let out = vm.ok("od -An -tx1 -v /dev/nvram", CMD);
    out.split_whitespace()
        .map(|b| u8::from_str_radix(b, 16).unwrap_or_else(|_| panic!("od: {out}")))
        .collect()
}

#[test]
fn the_rtc_keeps_the_guests_time_across_a_snapshot() {
    phase("start");
    let ns = NetNs::new("rtc");
    ns.add_tap("tap0", &format!("{HOST_IP0}/{PREFIX}"));
    let sock = scratch("rtc.sock");
    let snap = scratch("rtc.snap");
    let copy = disk_copy();
    let s = sock.to_str().unwrap();
    let mut vm = TestVm::restore_base_on(&ns, ["tap0", "tap1"], &copy, &["--api-sock", s]);
    vm.remove_on_drop(snap.clone());
    vm.remove_on_drop(copy.clone());

    phase("restored");
    let name = vm.ok("cat /sys/class/rtc/rtc0/name", CMD);
    assert!(name.contains("rtc_cmos"), "rtc0 is {name}");
    assert_offset(&mut vm, 0.0, 0.0, "restored base");

    // CMOS 0x34/0x35: RAM above 16 MiB in 64 KiB units (the base guest
    // has 128 MiB); 0x2e/0x2f: the checksum of 0x10-0x2d.
    let ram = nvram(&mut vm);
    assert_eq!(ram.len(), 128 - 14, "{ram:x?}");
    let cmos = |i: usize| ram[i - 14];
    let above_16m = u16::from_le_bytes([cmos(0x34), cmos(0x35)]);
    assert_eq!(above_16m, 112 * 16, "{ram:x?}");
    let sum: u16 = (0x10..=0x2d).map(|i| u16::from(cmos(i))).sum();
    assert_eq!(u16::from_be_bytes([cmos(0x2e), cmos(0x2f)]), sum);

    phase("nvram read");
    set_ahead(&mut vm, AHEAD_S);
    let (lo, hi) = assert_offset(&mut vm, AHEAD - SET_SLACK, AHEAD, "after hwclock -w");

    phase("set");
    let (code, a) = ctl(&sock, &["snapshot", snap.to_str().unwrap()]);
    assert_eq!(code, 0, "{a}");
    vm.kill();
    // Host time passes between the snapshot and the restore: the RTC
    // keeps its offset to the host's clock, not the time it showed.
    std::thread::sleep(Duration::from_secs(3));
    let args = device_args(["tap0", "tap1"], &copy);
    let mut restore = vec!["--restore", snap.to_str().unwrap()];
    restore.extend(args.iter().map(String::as_str));
    let mut again = TestVm::start_with(ns.command(tandem_bin().to_str().unwrap()), &restore);
    again.ok("true", CMD);
    phase("restored from the snapshot");
    assert_offset(&mut again, lo, hi, "restored from the snapshot");
    drop(again);
    drop(vm);
}

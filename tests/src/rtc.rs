//! The guest's CMOS RTC as tests see it: its offset to the host's wall
//! clock (read from /sys/class/rtc/rtc0), and a guest setting it ahead
//! with `hwclock -w` (its system clock put back right after).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::{TestVm, CMD_TIMEOUT};

/// The host's wall clock, in seconds since the epoch.
pub fn host_now() -> i64 {
    host_secs() as i64
}

fn host_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs_f64()
}

/// The guest RTC's time minus the host's, in seconds, as the range one
/// read can tell (the read takes a guest command; the RTC reads in whole
/// seconds).
pub fn offset(vm: &mut TestVm) -> (f64, f64) {
    let before = host_secs();
    let out = vm.ok("cat /sys/class/rtc/rtc0/since_epoch", CMD_TIMEOUT);
    let after = host_secs();
    let t: f64 = out
        .parse()
        .unwrap_or_else(|_| panic!("since_epoch: not a number: {out}"));
    (t - after, t + 1.0 - before)
}

/// Asserts that the guest's RTC runs between `lo` and `hi` seconds from
/// the host's clock (a read's range meets that one); returns the range read.
pub fn assert_offset(vm: &mut TestVm, lo: f64, hi: f64, when: &str) -> (f64, f64) {
    let (a, b) = offset(vm);
    eprintln!("{when}: the guest's RTC is {a:.1} to {b:.1} s from the host's clock (want {lo:.1} to {hi:.1})");
    assert!(
        a <= hi && lo <= b,
        "{when}: the guest's RTC is {a:.1} to {b:.1} s from the host's clock, not {lo:.1} to {hi:.1}"
    );
    (a, b)
}

/// The guest sets its RTC `ahead` seconds ahead of the host's clock, the
/// way `hwclock -w` does (from its system clock, which it then puts back:
/// a restored guest's clock runs behind the host's by the time its
/// snapshot waited).
pub fn set_ahead(vm: &mut TestVm, ahead: i64) {
    let at = host_now() + ahead;
    vm.ok(
        &format!(
            "t=$(date +%s); date -u -s @{at} >/dev/null && hwclock -w -u; \
             r=$?; date -u -s @$t >/dev/null; [ $r = 0 ]"
        ),
        CMD_TIMEOUT,
    );
}

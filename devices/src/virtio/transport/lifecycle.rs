//! The rules of the device status register (virtio 1.2, sections 2.1 and
//! 3.1.1; 4.2.2 for MMIO), as pure functions of the status value: which bit
//! a driver may set next, which values a transport can ever hold, and which
//! of them mean the device is running.
//!
//! The driver sets ACKNOWLEDGE, DRIVER, FEATURES_OK and DRIVER_OK in that
//! order (a write with several new bits is taken bit by bit in that order),
//! and clears them only by writing 0 (a reset).
//! FAILED may be set at any time; after it (or after DEVICE_NEEDS_RESET)
//! only a reset moves the status on. DEVICE_NEEDS_RESET is the device's: it
//! is set only when the start on DRIVER_OK fails. Other bits are ignored.
//! Saved states are checked against the same rules, so a restore accepts
//! exactly the values the register writes can produce.

use super::super::status::{
    ACKNOWLEDGE, DEVICE_NEEDS_RESET, DRIVER, DRIVER_OK, FAILED, FEATURES_OK,
};

/// The bits a driver sets while it brings the device up, in their order.
const PROGRESS: [u32; 4] = [ACKNOWLEDGE, DRIVER, FEATURES_OK, DRIVER_OK];
/// All of [`PROGRESS`]: the driver has finished bringing the device up.
const COMPLETE: u32 = ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK;
/// Bits a driver may write.
pub(crate) const DRIVER_BITS: u32 = COMPLETE | FAILED;
/// Bits a status can hold at all.
const KNOWN: u32 = DRIVER_BITS | DEVICE_NEEDS_RESET;

/// How many of [`PROGRESS`] `status` holds, if it holds a leading run of
/// them and nothing out of order.
fn progress(status: u32) -> Option<usize> {
    let bits = status & COMPLETE;
    (0..=PROGRESS.len()).find(|&n| PROGRESS[..n].iter().fold(0, |a, b| a | b) == bits)
}

/// The one bit the driver may set next, or `None` when the status is
/// complete, FAILED or DEVICE_NEEDS_RESET (only a reset follows).
pub(crate) fn next_bit(status: u32) -> Option<u32> {
    if status & (FAILED | DEVICE_NEEDS_RESET) != 0 {
        return None;
    }
    PROGRESS.get(progress(status)?).copied()
}

/// Whether the device runs in this status: the driver set DRIVER_OK after
/// an accepted FEATURES_OK and the start did not fail.
pub(crate) fn is_live(status: u32) -> bool {
    status & COMPLETE == COMPLETE && status & DEVICE_NEEDS_RESET == 0
}

/// Why a transport can never hold `status`; `None` when it can.
pub(crate) fn unreachable(status: u32) -> Option<&'static str> {
    if status & !KNOWN != 0 {
        Some("unknown bits are never stored")
    } else if progress(status).is_none() {
        Some("the driver sets ACKNOWLEDGE, DRIVER, FEATURES_OK, DRIVER_OK in that order")
    } else if status & DEVICE_NEEDS_RESET != 0 && status & COMPLETE != COMPLETE {
        Some("DEVICE_NEEDS_RESET is only set when a start on DRIVER_OK fails")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driver_order_one_bit_at_a_time() {
        assert_eq!(next_bit(0), Some(ACKNOWLEDGE));
        assert_eq!(next_bit(ACKNOWLEDGE), Some(DRIVER));
        assert_eq!(next_bit(ACKNOWLEDGE | DRIVER), Some(FEATURES_OK));
        assert_eq!(next_bit(COMPLETE & !DRIVER_OK), Some(DRIVER_OK));
        assert_eq!(next_bit(COMPLETE), None);
        assert_eq!(next_bit(ACKNOWLEDGE | FAILED), None);
        assert_eq!(next_bit(COMPLETE | DEVICE_NEEDS_RESET), None);
        assert_eq!(next_bit(DRIVER), None, "out of order");
    }

    #[test]
    fn reachable_values_are_exactly_the_ones_the_rules_produce() {
        // Every value the rules can produce, by a walk over all of them.
        let mut reached = vec![0u32];
        let mut i = 0;
        while let Some(&s) = reached.get(i) {
            let mut next = vec![s | FAILED];
            next.extend(next_bit(s).map(|b| s | b));
            if s & COMPLETE == COMPLETE && s & FAILED == 0 {
                next.push(s | DEVICE_NEEDS_RESET);
            }
            for n in next {
                if !reached.contains(&n) {
                    reached.push(n);
                }
            }
            i += 1;
        }
        for s in 0..0x200u32 {
            assert_eq!(
                unreachable(s).is_none(),
                reached.contains(&s),
                "{s:#x}: {:?}",
                unreachable(s)
            );
        }
        assert!(is_live(COMPLETE) && is_live(COMPLETE | FAILED));
        assert!(!is_live(COMPLETE | DEVICE_NEEDS_RESET) && !is_live(COMPLETE & !FEATURES_OK));
    }
}

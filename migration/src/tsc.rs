//! The guest's TSC frequency across hosts: what a restore does when this host's differs.
//!
//! A guest calibrates its clocks against the TSC frequency it booted with; run at another
//! rate, its time runs fast or slow. A snapshot therefore records each vCPU's frequency
//! (`KVM_GET_TSC_KHZ`), and a restore on a host whose frequency differs asks KVM to run the
//! guest's TSC at the saved rate (`KVM_SET_TSC_KHZ`: hardware TSC scaling, or within KVM's
//! tolerance of 250 ppm nothing at all). When KVM refuses, the restore is refused: a guest
//! whose clock drifts is worse than one that does not start.
//!
//! Pure: the vmm reads the host's frequency and makes the ioctl (the `set` closure of
//! [`match_tsc`]); this module decides and words the refusal. No KVM call, no thread.

use std::fmt::Display;

/// How a restore matched the guest's TSC frequency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TscMatch {
    /// This host runs the guest's TSC at its saved frequency already.
    Same,
    /// KVM took the saved frequency for this vCPU (it scales the TSC).
    Set,
}

/// KVM cannot give the guest its TSC frequency on this host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the snapshot's guest TSC runs at {saved_khz} kHz, this host's at {host_khz} kHz, \
     and KVM cannot scale it here ({reason})"
)]
pub struct TscMismatch {
    /// The frequency in the snapshot.
    pub saved_khz: u32,
    /// This host's (a fresh vCPU's) frequency.
    pub host_khz: u32,
    /// Why KVM refused.
    pub reason: String,
}

/// Matches a vCPU's saved TSC frequency with this host's `host_khz`: nothing to do when
/// they are equal, otherwise `set(saved_khz)` (the vmm's `KVM_SET_TSC_KHZ`) must succeed.
pub fn match_tsc<E: Display>(
    saved_khz: u32,
    host_khz: u32,
    set: impl FnOnce(u32) -> Result<(), E>,
) -> Result<TscMatch, TscMismatch> {
    if saved_khz == host_khz {
        return Ok(TscMatch::Same);
    }
    set(saved_khz)
        .map(|()| TscMatch::Set)
        .map_err(|e| TscMismatch {
            saved_khz,
            host_khz,
            reason: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_equal_frequency_asks_nothing_of_kvm() {
        let r = match_tsc(2_894_560, 2_894_560, |_| -> Result<(), String> {
            panic!("no KVM_SET_TSC_KHZ when the frequencies agree")
        });
        assert_eq!(r, Ok(TscMatch::Same));
    }

    #[test]
    fn another_frequency_is_set_when_kvm_can_scale() {
        let mut asked = None;
        let r = match_tsc(2_400_000, 2_894_560, |khz| {
            asked = Some(khz);
            Ok::<(), String>(())
        });
        assert_eq!(r, Ok(TscMatch::Set));
        assert_eq!(asked, Some(2_400_000), "the saved frequency is asked for");
    }

    #[test]
    fn another_frequency_is_refused_naming_both_when_kvm_cannot() {
        let r = match_tsc(2_400_000, 2_894_560, |_| {
            Err("set the TSC frequency: Operation not permitted (os error 1)")
        });
        let e = r.unwrap_err();
        assert_eq!((e.saved_khz, e.host_khz), (2_400_000, 2_894_560));
        assert_eq!(
            e.to_string(),
            "the snapshot's guest TSC runs at 2400000 kHz, this host's at 2894560 kHz, \
             and KVM cannot scale it here (set the TSC frequency: Operation not permitted \
             (os error 1))"
        );
    }
}

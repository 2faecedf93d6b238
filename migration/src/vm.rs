//! The state of the VM-wide in-kernel devices, as data: PIC, IOAPIC, PIT and kvmclock.
//!
//! This module owns the serde shape of the `vm` state section. The irqchips are kept as
//! the raw 512-byte chip area of `kvm_irqchip` (a kernel ABI that has not changed since it
//! was introduced; its layout is a C union, so bytes are its honest form); the PIT and the
//! clock are structured. Conversions from and to `kvm-bindings` live in [`crate::kvm`].

use serde::{Deserialize, Serialize};

/// Size of the chip area of `kvm_irqchip`.
pub const IRQCHIP_LEN: usize = 512;

/// VM-wide state saved once per VM.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmState {
    /// The master 8259 PIC (`KVM_IRQCHIP_PIC_MASTER`): 512 bytes.
    #[serde(with = "crate::hex")]
    pub pic_master: Vec<u8>,
    /// The slave 8259 PIC (`KVM_IRQCHIP_PIC_SLAVE`): 512 bytes.
    #[serde(with = "crate::hex")]
    pub pic_slave: Vec<u8>,
    /// The IOAPIC (`KVM_IRQCHIP_IOAPIC`): 512 bytes.
    #[serde(with = "crate::hex")]
    pub ioapic: Vec<u8>,
    /// The in-kernel PIT (`KVM_GET_PIT2`).
    pub pit: PitState,
    /// kvmclock (`KVM_GET_CLOCK`).
    pub clock: ClockState,
}

/// The in-kernel i8254 PIT (`kvm_pit_state2`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PitState {
    /// The three counters.
    pub channels: [PitChannel; 3],
    /// `KVM_PIT_FLAGS_*` (speaker dummy, ...).
    pub flags: u32,
}

/// One PIT counter (`kvm_pit_channel_state`).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PitChannel {
    pub count: u32,
    pub latched_count: u16,
    pub count_latched: u8,
    pub status_latched: u8,
    pub status: u8,
    pub read_state: u8,
    pub write_state: u8,
    pub write_latch: u8,
    pub rw_mode: u8,
    pub mode: u8,
    pub bcd: u8,
    pub gate: u8,
    /// Host time (ns) the count was loaded; the kernel rebases it on restore.
    pub count_load_time: i64,
}

/// kvmclock (`kvm_clock_data`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClockState {
    /// Guest clock in ns.
    pub clock: u64,
    /// `KVM_CLOCK_*` flags as returned by `KVM_GET_CLOCK`.
    pub flags: u32,
    /// Host realtime (ns) at save, meaningful with `KVM_CLOCK_REALTIME`.
    pub realtime: u64,
    /// Host TSC at save, meaningful with `KVM_CLOCK_HOST_TSC`.
    pub host_tsc: u64,
}

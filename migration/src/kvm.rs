//! The KVM structures a snapshot holds, their serde form, and the checks they pass before
//! an ioctl sees them.
//!
//! [`KvmVcpuState`] and [`KvmVmState`] are what the vmm's `KVM_GET_*` ioctls return and
//! its `KVM_SET_*` ioctls take, and they are also what the state sections hold: each
//! kvm-bindings structure is written with kvm-bindings' own serde (its bytes), read back
//! strictly ([`crate::kvm_serde`]: exact sizes, bounded lists). The hand-written part is
//! what kvm-bindings does not provide: the FPU ([`crate::vcpu::Fpu`], see there), and the
//! checks of meaning that a size check cannot make (a count field within its array, an
//! irqchip saved under the right chip id), done by `to_kvm` before anything is applied.
//! This module makes no KVM call.
//!
//! Restore order that KVM needs (the vmm's job; as Firecracker and QEMU do it):
//! - VM, before any vCPU runs: `KVM_SET_PIT2`, `KVM_SET_CLOCK`, `KVM_SET_IRQCHIP` ×3
//!   (PIC master, PIC slave, IOAPIC);
//! - each vCPU: `KVM_SET_CPUID2` with the saved entries (the guest keeps the CPU it saw,
//!   whatever this host would offer), the TSC frequency ([`crate::tsc`]), then mp_state,
//!   regs, sregs, xsave (or fpu), xcrs, debug regs, LAPIC, MSRs, vcpu events (last: it may
//!   inject what the others prepared).

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_fpu, kvm_irqchip, kvm_lapic_state,
    kvm_mp_state, kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
    kvm_xsave, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KVM_MAX_CPUID_ENTRIES, KVM_MAX_MSR_ENTRIES, KVM_MAX_XCRS,
};
use serde::{Deserialize, Deserializer, Serialize};
use zerocopy::IntoBytes;

use crate::kvm_serde::{self, exact};
use crate::vcpu::{Fpu, VcpuState};

/// A saved state that KVM would not take.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvmStateError {
    /// A byte area has the wrong length.
    #[error("{what} is {found} bytes, KVM takes {expected}")]
    Length {
        /// Which area.
        what: &'static str,
        /// Its length in the snapshot.
        found: usize,
        /// The length KVM takes.
        expected: usize,
    },
    /// A list is longer than the kernel's array.
    #[error("{what}: {found} entries, KVM takes at most {max}")]
    TooMany {
        /// Which list.
        what: &'static str,
        /// Entries in the snapshot.
        found: usize,
        /// The kernel's limit.
        max: usize,
    },
    /// An irqchip is saved under the wrong chip id.
    #[error("{what} has chip id {found}, KVM's is {expected}")]
    ChipId {
        /// Which chip.
        what: &'static str,
        /// The id in the snapshot.
        found: u32,
        /// The id of that chip.
        expected: u32,
    },
}

type Result<T> = std::result::Result<T, KvmStateError>;

fn exact_len<'a>(what: &'static str, bytes: &'a [u8], expected: usize) -> Result<&'a [u8]> {
    if bytes.len() == expected {
        Ok(bytes)
    } else {
        Err(KvmStateError::Length {
            what,
            found: bytes.len(),
            expected,
        })
    }
}

fn at_most(what: &'static str, found: usize, max: usize) -> Result<()> {
    if found <= max {
        Ok(())
    } else {
        Err(KvmStateError::TooMany { what, found, max })
    }
}

impl From<&kvm_fpu> for Fpu {
    fn from(f: &kvm_fpu) -> Self {
        Fpu {
            fpr: f.fpr.as_flattened().to_vec(),
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm.as_flattened().to_vec(),
            mxcsr: f.mxcsr,
        }
    }
}

impl TryFrom<&Fpu> for kvm_fpu {
    type Error = KvmStateError;

    fn try_from(f: &Fpu) -> Result<Self> {
        let mut k = kvm_fpu {
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            mxcsr: f.mxcsr,
            ..Default::default()
        };
        k.fpr
            .as_flattened_mut()
            .copy_from_slice(exact_len("FPU registers", &f.fpr, 8 * 16)?);
        k.xmm
            .as_flattened_mut()
            .copy_from_slice(exact_len("XMM registers", &f.xmm, 16 * 16)?);
        Ok(k)
    }
}

/// `#[serde(with)]` for `kvm_fpu`, through the [`Fpu`] mirror.
mod fpu_serde {
    use super::*;
    use serde::de::Error as _;
    use serde::Serializer;

    pub fn serialize<S: Serializer>(f: &kvm_fpu, s: S) -> std::result::Result<S::Ok, S::Error> {
        Fpu::from(f).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<kvm_fpu, D::Error> {
        kvm_fpu::try_from(&Fpu::deserialize(d)?).map_err(D::Error::custom)
    }
}

fn msr_list<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<kvm_msr_entry>, D::Error> {
    kvm_serde::list(d, "MSRs", KVM_MAX_MSR_ENTRIES)
}

fn cpuid_list<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<kvm_cpuid_entry2>, D::Error> {
    kvm_serde::list(d, "CPUID entries", KVM_MAX_CPUID_ENTRIES)
}

/// One vCPU's state as the `KVM_GET_*` ioctls return it, and as its section holds it.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvmVcpuState {
    /// General-purpose registers.
    #[serde(with = "exact")]
    pub regs: kvm_regs,
    /// Segment, control and descriptor-table registers.
    #[serde(with = "exact")]
    pub sregs: kvm_sregs,
    /// Legacy FPU/SSE state (a hand-written mirror in the file, see [`crate::vcpu`]).
    #[serde(with = "fpu_serde")]
    pub fpu: kvm_fpu,
    /// The 4096-byte xsave area (`KVM_GET_XSAVE`; the vmm refuses hosts with a larger one).
    #[serde(with = "exact")]
    pub xsave: kvm_xsave,
    /// Extended control registers.
    #[serde(with = "exact")]
    pub xcrs: kvm_xcrs,
    /// Model-specific registers, at most `KVM_MAX_MSR_ENTRIES`.
    #[serde(deserialize_with = "msr_list")]
    pub msrs: Vec<kvm_msr_entry>,
    /// The local APIC register page.
    #[serde(with = "exact")]
    pub lapic: kvm_lapic_state,
    /// `KVM_MP_STATE_*` (runnable, halted, init received, ...).
    #[serde(with = "exact")]
    pub mp_state: kvm_mp_state,
    /// Pending exceptions, interrupts, NMIs and SMIs.
    #[serde(with = "exact")]
    pub events: kvm_vcpu_events,
    /// Debug registers.
    #[serde(with = "exact")]
    pub debugregs: kvm_debugregs,
    /// The CPUID the guest sees (`KVM_GET_CPUID2`), at most `KVM_MAX_CPUID_ENTRIES`.
    #[serde(deserialize_with = "cpuid_list")]
    pub cpuid: Vec<kvm_cpuid_entry2>,
    /// The guest's TSC frequency in kHz (`KVM_GET_TSC_KHZ`).
    pub tsc_khz: u32,
}

// By hand: `kvm_xsave` has neither `Clone` nor `PartialEq`.
impl Clone for KvmVcpuState {
    fn clone(&self) -> Self {
        let mut xsave = kvm_xsave::default();
        xsave.region = self.xsave.region;
        KvmVcpuState {
            xsave,
            msrs: self.msrs.clone(),
            cpuid: self.cpuid.clone(),
            ..*self
        }
    }
}

impl PartialEq for KvmVcpuState {
    fn eq(&self, o: &Self) -> bool {
        self.regs == o.regs
            && self.sregs == o.sregs
            && self.fpu == o.fpu
            && self.xsave.region == o.xsave.region
            && self.xcrs == o.xcrs
            && self.msrs == o.msrs
            && self.lapic == o.lapic
            && self.mp_state == o.mp_state
            && self.events == o.events
            && self.debugregs == o.debugregs
            && self.cpuid == o.cpuid
            && self.tsc_khz == o.tsc_khz
    }
}

impl VcpuState {
    /// The section for vCPU `id`, from what the vmm read from KVM.
    pub fn from_kvm(id: u32, k: &KvmVcpuState) -> Self {
        VcpuState { id, kvm: k.clone() }
    }

    /// The structures for the `KVM_SET_*` ioctls; refuses counts over the kernel's arrays.
    pub fn to_kvm(&self) -> Result<KvmVcpuState> {
        let k = &self.kvm;
        at_most("XCRs", k.xcrs.nr_xcrs as usize, KVM_MAX_XCRS as usize)?;
        at_most("MSRs", k.msrs.len(), KVM_MAX_MSR_ENTRIES)?;
        at_most("CPUID entries", k.cpuid.len(), KVM_MAX_CPUID_ENTRIES)?;
        Ok(k.clone())
    }
}

/// The VM-wide state as the `KVM_GET_*` ioctls return it, and as the `vm` section holds it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvmVmState {
    /// The master 8259 PIC (`KVM_IRQCHIP_PIC_MASTER`).
    #[serde(with = "exact")]
    pub pic_master: kvm_irqchip,
    /// The slave 8259 PIC (`KVM_IRQCHIP_PIC_SLAVE`).
    #[serde(with = "exact")]
    pub pic_slave: kvm_irqchip,
    /// The IOAPIC (`KVM_IRQCHIP_IOAPIC`).
    #[serde(with = "exact")]
    pub ioapic: kvm_irqchip,
    /// The in-kernel PIT (`KVM_GET_PIT2`).
    #[serde(with = "exact")]
    pub pit: kvm_pit_state2,
    /// kvmclock (`KVM_GET_CLOCK`).
    #[serde(with = "exact")]
    pub clock: kvm_clock_data,
}

// By hand: `kvm_irqchip` (a union inside) has no `PartialEq`; its bytes are its value.
impl PartialEq for KvmVmState {
    fn eq(&self, o: &Self) -> bool {
        self.pic_master.as_bytes() == o.pic_master.as_bytes()
            && self.pic_slave.as_bytes() == o.pic_slave.as_bytes()
            && self.ioapic.as_bytes() == o.ioapic.as_bytes()
            && self.pit == o.pit
            && self.clock == o.clock
    }
}

impl KvmVmState {
    /// The section, from what the vmm read from KVM (the same structures).
    pub fn from_kvm(k: &KvmVmState) -> Self {
        k.clone()
    }

    /// The structures for the `KVM_SET_*` ioctls; refuses a chip saved under another id.
    pub fn to_kvm(&self) -> Result<KvmVmState> {
        for (chip, what, expected) in [
            (&self.pic_master, "PIC master state", KVM_IRQCHIP_PIC_MASTER),
            (&self.pic_slave, "PIC slave state", KVM_IRQCHIP_PIC_SLAVE),
            (&self.ioapic, "IOAPIC state", KVM_IRQCHIP_IOAPIC),
        ] {
            if chip.chip_id != expected {
                return Err(KvmStateError::ChipId {
                    what,
                    found: chip.chip_id,
                    expected,
                });
            }
        }
        Ok(self.clone())
    }
}

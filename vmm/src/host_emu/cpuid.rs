//! The CPUID table each vCPU gets: KVM's supported set, with this vCPU's
//! APIC id and topology, and (on emulated hosts only) without the KVM
//! paravirtual features whose hypercalls hang there.

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::Kvm;

use crate::host_emu::HostKind;

const LEAF_FEATURES: u32 = 1;
const LEAF_EXT_TOPOLOGY: u32 = 0xb;
const LEAF_EXT_TOPOLOGY_V2: u32 = 0x1f;
const LEAF_KVM_FEATURES: u32 = 0x4000_0001;
const ECX_HYPERVISOR: u32 = 1 << 31;
const EDX_HTT: u32 = 1 << 28;
/// KVM_FEATURE_PV_UNHALT, PV_TLB_FLUSH, PV_SEND_IPI, PV_SCHED_YIELD.
const KVM_PV_FEATURES_THAT_HANG: u32 = (1 << 7) | (1 << 9) | (1 << 11) | (1 << 13);

/// Errors from building the table.
#[derive(Debug, thiserror::Error)]
pub enum CpuidError {
    #[error("KVM did not report its supported CPUID: {0}")]
    Supported(kvm_ioctls::Error),
}

/// KVM's supported CPUID, read once and adjusted per vCPU.
pub fn supported(kvm: &Kvm) -> Result<CpuId, CpuidError> {
    kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(CpuidError::Supported)
}

/// The table for vCPU `id` of `count`.
pub fn for_vcpu(base: &CpuId, id: u8, count: u8, host: HostKind) -> CpuId {
    let mut cpuid = base.clone();
    for e in cpuid.as_mut_slice() {
        match e.function {
            LEAF_FEATURES => {
                e.ebx = (e.ebx & 0x0000_ffff) | (u32::from(id) << 24) | (u32::from(count) << 16);
                e.ecx |= ECX_HYPERVISOR;
                if count > 1 {
                    e.edx |= EDX_HTT;
                } else {
                    e.edx &= !EDX_HTT;
                }
            }
            LEAF_EXT_TOPOLOGY | LEAF_EXT_TOPOLOGY_V2 => e.edx = u32::from(id),
            LEAF_KVM_FEATURES if host == HostKind::Emulated => {
                e.eax &= !KVM_PV_FEATURES_THAT_HANG;
            }
            _ => {}
        }
    }
    cpuid
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    fn table() -> CpuId {
        let entries = [
            kvm_cpuid_entry2 {
                function: LEAF_FEATURES,
                ebx: 0xffff_0800,
                edx: EDX_HTT,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: LEAF_KVM_FEATURES,
                eax: 0xffff_ffff,
                ..Default::default()
            },
        ];
        CpuId::from_entries(&entries).unwrap()
    }

    #[test]
    fn apic_id_topology_and_pv_mask() {
        let t = for_vcpu(&table(), 3, 4, HostKind::Emulated);
        let e = t.as_slice();
        assert_eq!(e[0].ebx, 0x0304_0800);
        assert_ne!(e[0].ecx & ECX_HYPERVISOR, 0);
        assert_eq!(e[1].eax & KVM_PV_FEATURES_THAT_HANG, 0);
        let one = for_vcpu(&table(), 0, 1, HostKind::Hardware);
        assert_eq!(one.as_slice()[0].edx & EDX_HTT, 0);
        assert_eq!(
            one.as_slice()[1].eax,
            0xffff_ffff,
            "hardware hosts keep PV features"
        );
    }
}

//! The state of one vCPU as data: the `vcpu.N` section of a snapshot.
//!
//! This module owns the serde shape of a vCPU's section: its index and the structures
//! `KVM_GET_*` returned ([`KvmVcpuState`], written with kvm-bindings' own serde, see
//! [`crate::kvm`]). The one hand-written mirror left is [`Fpu`]: `kvm_fpu` has no serde
//! impl in kvm-bindings 0.14 (nor the zerocopy derives its impls are built on), so the FPU
//! is written field by field, its register files as hex. This module has no KVM in it.

use serde::{Deserialize, Serialize};

pub use crate::kvm::KvmVcpuState;

/// Everything saved for one vCPU (restore order in [`crate::kvm`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VcpuState {
    /// The vCPU's index (APIC id at creation).
    pub id: u32,
    /// Its registers, LAPIC, MSRs, pending events, CPUID and TSC frequency.
    pub kvm: KvmVcpuState,
}

/// Legacy FPU and SSE state (`kvm_fpu`), kept by hand: see the module doc.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fpu {
    /// The eight x87 registers, 16 bytes each: 128 bytes.
    #[serde(with = "crate::hex")]
    pub fpr: Vec<u8>,
    /// Control word.
    pub fcw: u16,
    /// Status word.
    pub fsw: u16,
    /// Abridged tag word.
    pub ftwx: u8,
    /// Last opcode.
    pub last_opcode: u16,
    /// Last instruction pointer.
    pub last_ip: u64,
    /// Last data pointer.
    pub last_dp: u64,
    /// The sixteen XMM registers, 16 bytes each: 256 bytes.
    #[serde(with = "crate::hex")]
    pub xmm: Vec<u8>,
    /// SSE control and status.
    pub mxcsr: u32,
}

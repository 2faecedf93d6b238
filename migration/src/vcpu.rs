//! The state of one vCPU, as data: what `KVM_GET_*` returns, in tandem's own stable form.
//!
//! This module owns the serde shape of a vCPU's state section (`vcpu.N`). The fields mirror
//! the kernel's structures by name, so the JSON reads like the KVM API documentation, but
//! they are tandem's: the snapshot format does not depend on bindgen layouts. Opaque kernel
//! blobs (the xsave area, the LAPIC register page) are bytes, written as hex. The
//! conversions from and to `kvm-bindings` types live in [`crate::kvm`]; this module has no
//! KVM in it.

use serde::{Deserialize, Serialize};

/// Everything saved for one vCPU, in the order KVM wants it restored (see [`crate::kvm`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VcpuState {
    /// The vCPU's index (APIC id at creation).
    pub id: u32,
    /// General-purpose registers.
    pub regs: Regs,
    /// Segment, control and descriptor-table registers.
    pub sregs: Sregs,
    /// Legacy FPU/SSE state (`KVM_GET_FPU`).
    pub fpu: Fpu,
    /// The xsave area (`KVM_GET_XSAVE` / `KVM_GET_XSAVE2`), as bytes; empty when not saved.
    #[serde(with = "crate::hex")]
    pub xsave: Vec<u8>,
    /// Extended control registers.
    pub xcrs: Vec<Xcr>,
    /// Model-specific registers.
    pub msrs: Vec<Msr>,
    /// The local APIC register page: exactly 1024 bytes.
    #[serde(with = "crate::hex")]
    pub lapic: Vec<u8>,
    /// `KVM_MP_STATE_*` (runnable, halted, init received, ...).
    pub mp_state: u32,
    /// Pending exceptions, interrupts, NMIs and SMIs.
    pub events: VcpuEvents,
    /// Debug registers.
    pub debugregs: DebugRegs,
}

/// General-purpose registers (`kvm_regs`).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Regs {
    pub rax: u64,
    pub rbx: u64,
    pub rcx: u64,
    pub rdx: u64,
    pub rsi: u64,
    pub rdi: u64,
    pub rsp: u64,
    pub rbp: u64,
    pub r8: u64,
    pub r9: u64,
    pub r10: u64,
    pub r11: u64,
    pub r12: u64,
    pub r13: u64,
    pub r14: u64,
    pub r15: u64,
    pub rip: u64,
    pub rflags: u64,
}

/// A segment register (`kvm_segment`).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Segment {
    pub base: u64,
    pub limit: u32,
    pub selector: u16,
    #[serde(rename = "type")]
    pub type_: u8,
    pub present: u8,
    pub dpl: u8,
    pub db: u8,
    pub s: u8,
    pub l: u8,
    pub g: u8,
    pub avl: u8,
    pub unusable: u8,
}

/// A descriptor-table register (`kvm_dtable`).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DTable {
    pub base: u64,
    pub limit: u16,
}

/// Special registers (`kvm_sregs`).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sregs {
    pub cs: Segment,
    pub ds: Segment,
    pub es: Segment,
    pub fs: Segment,
    pub gs: Segment,
    pub ss: Segment,
    pub tr: Segment,
    pub ldt: Segment,
    pub gdt: DTable,
    pub idt: DTable,
    pub cr0: u64,
    pub cr2: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub cr8: u64,
    pub efer: u64,
    pub apic_base: u64,
    /// Bitmap of pending external interrupts (one bit per vector).
    pub interrupt_bitmap: [u64; 4],
}

/// Legacy FPU and SSE state (`kvm_fpu`).
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

/// One extended control register (`kvm_xcr`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Xcr {
    /// Which XCR (0 = XCR0).
    pub xcr: u32,
    /// Its value.
    pub value: u64,
}

/// One model-specific register (`kvm_msr_entry`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Msr {
    /// The MSR's index.
    pub index: u32,
    /// Its value.
    pub data: u64,
}

/// Debug registers (`kvm_debugregs`).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DebugRegs {
    pub db: [u64; 4],
    pub dr6: u64,
    pub dr7: u64,
    pub flags: u64,
}

/// Pending events (`kvm_vcpu_events`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VcpuEvents {
    /// The exception being delivered or pending.
    pub exception: ExceptionEvent,
    /// The interrupt being delivered.
    pub interrupt: InterruptEvent,
    /// NMI state.
    pub nmi: NmiEvent,
    /// The SIPI vector.
    pub sipi_vector: u32,
    /// `KVM_VCPUEVENT_VALID_*`: which of the optional fields are meaningful.
    pub flags: u32,
    /// SMM state.
    pub smi: SmiEvent,
    /// A triple fault is pending.
    pub triple_fault_pending: u8,
    /// `exception_payload` is meaningful.
    pub exception_has_payload: u8,
    /// Payload of the pending exception (CR2 or DR6).
    pub exception_payload: u64,
}

/// The exception part of [`VcpuEvents`].
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExceptionEvent {
    pub injected: u8,
    pub nr: u8,
    pub has_error_code: u8,
    pub pending: u8,
    pub error_code: u32,
}

/// The interrupt part of [`VcpuEvents`].
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterruptEvent {
    pub injected: u8,
    pub nr: u8,
    pub soft: u8,
    pub shadow: u8,
}

/// The NMI part of [`VcpuEvents`].
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NmiEvent {
    pub injected: u8,
    pub pending: u8,
    pub masked: u8,
}

/// The SMM part of [`VcpuEvents`].
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SmiEvent {
    pub smm: u8,
    pub pending: u8,
    pub smm_inside_nmi: u8,
    pub latched_init: u8,
}

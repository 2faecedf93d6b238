//! The `ioctl` requests the narrow thread kinds may make, one by one: a
//! vCPU's (`KVM_RUN`, its own state, the MSI routes and doorbells a guest
//! reprograms from an MMIO exit, a tap's offloads from a feature
//! negotiation), the device thread's (a tap's offloads), and the terminal
//! requests every thread may make (restoring the terminal on SIGTERM runs
//! on whichever thread the signal lands). The VMM and stream kinds make
//! the VM and restore it, and keep whole request types ([`super::rules`]).
//!
//! Lists found by reading the code and by tracing every `ioctl` of the
//! whole guest suite per thread name (`strace -f -Y -e raw=ioctl`); see
//! docs/sandbox.md for how to redo that. Pure data, read when a thread is
//! confined. Never does: list a request that makes a VM, a vCPU, a device
//! or a memory slot (`KVM_CREATE_*`, `KVM_SET_USER_MEMORY_REGION`) for
//! these kinds.

use std::mem::size_of;
use std::os::raw::c_uint;

use kvm_bindings::{
    kvm_cpuid2, kvm_debugregs, kvm_fpu, kvm_ioeventfd, kvm_irq_routing, kvm_irqfd, kvm_lapic_state,
    kvm_mp_state, kvm_msrs, kvm_regs, kvm_sregs, kvm_translation, kvm_vcpu_events, kvm_xcrs,
    kvm_xsave, KVMIO,
};
use vmm_sys_util::ioctl::{ioctl_expr, _IOC_NONE, _IOC_READ, _IOC_WRITE};

/// A request with no data.
const fn io(ty: c_uint, nr: c_uint) -> u64 {
    ioctl_expr(_IOC_NONE, ty, nr, 0) as u64
}

/// A request that reads a `T` from the kernel.
const fn ior<T>(nr: c_uint) -> u64 {
    ioctl_expr(_IOC_READ, KVMIO, nr, size_of::<T>() as c_uint) as u64
}

/// A request that writes a `T` to the kernel.
const fn iow<T>(ty: c_uint, nr: c_uint) -> u64 {
    ioctl_expr(_IOC_WRITE, ty, nr, size_of::<T>() as c_uint) as u64
}

/// A request that does both.
const fn iowr<T>(nr: c_uint) -> u64 {
    ioctl_expr(_IOC_READ | _IOC_WRITE, KVMIO, nr, size_of::<T>() as c_uint) as u64
}

/// `KVM_RUN`: first, as it is by far the most frequent.
pub const KVM_RUN: u64 = io(KVMIO, 0x80);

/// What a vCPU thread asks of KVM: running, its own state saved and
/// restored on its thread (snapshots, migrations, COLO checkpoints, the
/// profiler's samples), the TSC frequency, address translation (the
/// instruction emulator), and what an MMIO exit into virtio-pci's MSI-X
/// table or a queue's notify address changes (routes, doorbells, irqfds).
pub const VCPU_KVM: &[u64] = &[
    KVM_RUN,
    io(KVMIO, 0x03),                     // KVM_CHECK_EXTENSION
    io(KVMIO, 0xa2),                     // KVM_SET_TSC_KHZ
    io(KVMIO, 0xa3),                     // KVM_GET_TSC_KHZ
    io(KVMIO, 0xad),                     // KVM_KVMCLOCK_CTRL
    ior::<kvm_regs>(0x81),               // KVM_GET_REGS
    iow::<kvm_regs>(KVMIO, 0x82),        // KVM_SET_REGS
    ior::<kvm_sregs>(0x83),              // KVM_GET_SREGS
    iow::<kvm_sregs>(KVMIO, 0x84),       // KVM_SET_SREGS
    iowr::<kvm_translation>(0x85),       // KVM_TRANSLATE
    iowr::<kvm_msrs>(0x88),              // KVM_GET_MSRS
    iow::<kvm_msrs>(KVMIO, 0x89),        // KVM_SET_MSRS
    ior::<kvm_fpu>(0x8c),                // KVM_GET_FPU
    iow::<kvm_fpu>(KVMIO, 0x8d),         // KVM_SET_FPU
    ior::<kvm_lapic_state>(0x8e),        // KVM_GET_LAPIC
    iow::<kvm_lapic_state>(KVMIO, 0x8f), // KVM_SET_LAPIC
    iow::<kvm_cpuid2>(KVMIO, 0x90),      // KVM_SET_CPUID2
    iowr::<kvm_cpuid2>(0x91),            // KVM_GET_CPUID2
    ior::<kvm_mp_state>(0x98),           // KVM_GET_MP_STATE
    iow::<kvm_mp_state>(KVMIO, 0x99),    // KVM_SET_MP_STATE
    ior::<kvm_vcpu_events>(0x9f),        // KVM_GET_VCPU_EVENTS
    iow::<kvm_vcpu_events>(KVMIO, 0xa0), // KVM_SET_VCPU_EVENTS
    ior::<kvm_debugregs>(0xa1),          // KVM_GET_DEBUGREGS
    iow::<kvm_debugregs>(KVMIO, 0xa2),   // KVM_SET_DEBUGREGS
    ior::<kvm_xsave>(0xa4),              // KVM_GET_XSAVE
    iow::<kvm_xsave>(KVMIO, 0xa5),       // KVM_SET_XSAVE
    ior::<kvm_xcrs>(0xa6),               // KVM_GET_XCRS
    iow::<kvm_xcrs>(KVMIO, 0xa7),        // KVM_SET_XCRS
    ior::<kvm_xsave>(0xcf),              // KVM_GET_XSAVE2
    iow::<kvm_irq_routing>(KVMIO, 0x6a), // KVM_SET_GSI_ROUTING
    iow::<kvm_irqfd>(KVMIO, 0x76),       // KVM_IRQFD
    iow::<kvm_ioeventfd>(KVMIO, 0x79),   // KVM_IOEVENTFD
];

/// `TUNSETOFFLOAD`: a tap's offloads, set when the guest's virtio-net
/// driver accepts features (on a vCPU's MMIO exit or the device thread).
pub const TUN_SET_OFFLOAD: u64 = iow::<c_uint>(b'T' as c_uint, 208);

/// The terminal's attributes, read and set (`TCGETS`, `TCSETS`): the
/// console's raw mode is undone on SIGTERM, SIGHUP or SIGINT by whichever
/// thread the signal reaches.
pub const TERMINAL: &[u64] = &[libc::TCGETS, libc::TCSETS];

#[cfg(test)]
mod tests {
    use super::*;

    /// The numbers built here are those traced on this host (strace's raw
    /// values) and those of <linux/kvm.h>.
    #[test]
    fn requests_are_the_kernels_numbers() {
        let vcpu: std::collections::BTreeSet<u64> = VCPU_KVM.iter().copied().collect();
        for traced in [
            0xae80, 0xaea2, 0xaea3, 0x4004ae99, 0x4008ae6a, 0x4008ae89, 0x4008ae90, 0x4040ae79,
            0x4040aea0, 0x4080aea2, 0x4090ae82, 0x4138ae84, 0x4188aea7, 0x41a0ae8d, 0x4400ae8f,
            0x5000aea5, 0x8004ae98, 0x8040ae9f, 0x8080aea1, 0x8090ae81, 0x8138ae83, 0x8188aea6,
            0x81a0ae8c, 0x8400ae8e, 0x9000aea4, 0xc008ae88, 0xc008ae91, 0xc018ae85,
        ] {
            assert!(vcpu.contains(&traced), "{traced:#x}");
        }
        assert_eq!(VCPU_KVM.len(), vcpu.len(), "a request is listed twice");
        assert_eq!(TUN_SET_OFFLOAD, 0x400454d0);
        // Nothing that makes a VM, a vCPU, a device or a memory slot.
        for made in [0xae01, 0xae41, 0x4020ae46, 0xae60, 0xc00caee0] {
            assert!(!vcpu.contains(&made), "{made:#x}");
        }
    }
}

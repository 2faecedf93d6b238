//! The state of the VM-wide in-kernel devices as data: the `vm` section of a snapshot.
//!
//! PIC master and slave, IOAPIC (`kvm_irqchip`), PIT (`kvm_pit_state2`) and kvmclock
//! (`kvm_clock_data`): every one has a serde impl in kvm-bindings, so the section holds
//! the structures the ioctls return, as they are ([`crate::kvm::KvmVmState`]); nothing is
//! mirrored by hand. This module has no KVM in it.

/// VM-wide state saved once per VM: the same type as what the `KVM_GET_*` ioctls return.
pub type VmState = crate::kvm::KvmVmState;

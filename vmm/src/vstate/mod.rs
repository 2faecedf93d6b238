//! The VM's state at the KVM level: the vCPUs (one thread each, [`vcpu`],
//! driven as a group by [`vcpus`]), guest RAM and its dirty log
//! ([`memory`]), a snapshot's pages mapped over it ([`file_map`]), its
//! missing pages served through a userfaultfd in post-copy ([`uffd`]), a
//! vCPU's and the VM-wide state as data ([`vcpu_state`],
//! [`vm_state`]), how the VM ends ([`exit`]) and the exits counted
//! ([`exit_counts`]).
//!
//! Part of the VM core: driven through `vm::VmHandle` by the VMM thread
//! and by the threads above the core (control, migration, COLO). Never
//! does: import those layers (streams, migration, COLO, the API, the CLI).

pub mod exit;
pub mod exit_counts;
pub mod file_map;
pub mod memory;
pub mod uffd;
pub mod vcpu;
pub mod vcpu_state;
pub mod vcpus;
pub mod vm_state;

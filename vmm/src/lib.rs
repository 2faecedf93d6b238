//! tandem: a KVM virtual machine monitor.
//!
//! `vm` builds and runs a VM from a `config::VmConfig`: guest RAM and its
//! dirty log (`memory`), the devices (`device_manager`), the vCPU threads
//! (`vcpu`, driven as a group by `vcpus`); `boot` loads Linux; `console`
//! connects the serial port to the user's terminal; `api` serves the
//! control socket and `control` maps its verbs onto the VM; `snapshot` and
//! `vcpu_state` save and restore; `host`, `cpuid` and `emulation` hold what
//! this host's KVM needs (see each module); `profile` samples where the
//! guest spends its time; `kvm_util` is the one KVM error.

pub mod api;
pub mod boot;
pub mod config;
pub mod console;
pub mod control;
pub mod cpuid;
pub mod device_manager;
pub mod emulation;
pub mod exit;
pub mod exit_counts;
pub mod host;
pub mod kvm_util;
pub mod memory;
pub mod pause;
pub mod profile;
pub mod run_args;
pub mod snapshot;
pub mod vcpu;
pub mod vcpu_state;
pub mod vcpus;
pub mod vm;

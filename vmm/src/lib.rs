//! tandem: a KVM virtual machine monitor.
//!
//! `builder` makes a `vm::Vm` from a `config::VmConfig` (booted, restored
//! or incoming); `vm_loop` runs it on the VMM thread to its end; other
//! threads drive it through a `vm::VmHandle` (pause, resume, capture and
//! apply its `vm_state::VmState`, memory and dirty log, throttle). Its
//! parts: guest RAM and its dirty log (`memory`), the devices
//! (`device_manager`) and the thread of their event loop (`device_thread`),
//! the vCPU threads (`vcpu`, driven as a group by `vcpus`); `boot` loads
//! Linux; `console` connects the serial port to the user's terminal; `api`
//! serves the control socket and `control` maps its verbs onto the
//! `VmHandle`; `snapshot` writes and reads a `VmState` and memory as a
//! file, `vcpu_state` reads and writes a vCPU's; `migrate` sends a running
//! VM to another tandem (its own thread) and receives one (`--incoming`); `host`, `cpuid` and
//! `emulation` hold what this host's KVM needs (see each module);
//! `profile` samples where the guest spends its time; `kvm_util` is the
//! one KVM error.

pub mod api;
pub mod boot;
pub mod builder;
pub mod colo;
pub mod config;
pub mod console;
pub mod control;
pub mod device_manager;
pub mod device_thread;
pub mod host_emu;
pub mod kvm_util;
pub mod migrate;
pub mod pause;
pub mod probe;
pub mod profile;
pub mod run_args;
pub mod snapshot;
pub mod streams;
pub mod vm;
pub mod vm_loop;
pub mod vstate;

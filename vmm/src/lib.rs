//! tandem: a KVM virtual machine monitor.
//!
//! The modules, one line each, by layer, bottom up. A module imports only
//! from its own layer or those below it (`tests/layering.rs` checks that
//! the core names nothing above it, and that no two modules import each
//! other in a circle).
//!
//! Host and boot, at the bottom:
//! - [`kvm_util`]: the one KVM error (which ioctl failed).
//! - [`host_emu`]: this host's kind of KVM and its workarounds (CPUID,
//!   instructions KVM's emulator gives up on, x87), entered only behind the
//!   host-kind check.
//! - [`sandbox`]: each thread's seccomp filter, installed by the thread
//!   itself, and the line a denied call prints.
//! - [`boot`]: loading Linux or firmware, the guest's memory layout, MP
//!   and ACPI tables.
//!
//! The VM core (knows nothing of the layers above):
//! - [`config`]: what to run, as data (`VmConfig`, devices, TLS paths).
//! - [`pause`]: the gates and kicks that stop vCPU and device threads.
//! - [`profile`]: the guest profiler (sampled guest stacks).
//! - [`vstate`]: vCPUs, guest RAM and its dirty log, vCPU and VM state,
//!   how the VM ends, exit counts.
//! - [`console`]: the serial port on the user's terminal.
//! - [`device_manager`]: the devices' wiring (buses, virtio over MMIO or
//!   PCI, MSI routes, disks' backends) and their state.
//! - [`device_thread`]: the devices' event loop thread and its turns.
//! - [`snapshot`]: a VM's state and memory as a file, written and checked.
//! - [`vm`]: `VmHandle`, how other threads drive a running VM (pause,
//!   resume, capture and apply state, dirty log, throttle, metrics).
//!
//! Streams, used by both features:
//! - [`streams`]: addresses, connections, TLS and its pump thread.
//!
//! The features:
//! - [`migrate`]: live migration, sending (its own thread) and receiving.
//! - [`colo`]: COLO, a primary/secondary pair (sync, checkpoints,
//!   proxies, disk replication, failover).
//!
//! The API:
//! - [`api`]: the control socket, its requests and answers.
//! - [`control`]: the API's verbs mapped onto the running VM.
//!
//! The CLI (nothing else imports it):
//! - [`cli`]: the `tandem` command line: `tandem run` (its options and
//!   config file, booting, restoring, receiving) and the `tandem ctl` verbs,
//!   the migration client and its jitter probe and plots.
//!
//! On top:
//! - [`builder`]: makes a VM from a `VmConfig` (booted, restored, incoming).
//! - [`vm_loop`]: runs it on the VMM thread to its end (API, metrics).

pub mod api;
pub mod boot;
pub mod builder;
pub mod cli;
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
pub mod profile;
pub mod sandbox;
pub mod snapshot;
pub mod streams;
pub mod vm;
pub mod vm_loop;
pub mod vstate;

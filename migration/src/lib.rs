//! tandem's migration crate: the state traits and the versioned snapshot file format.
//!
//! This crate owns what a saved VM *is*, as data, and how it is laid out in a file:
//! - [`format`](mod@format): the container (magic, version, named sections, CRC) and its verification;
//! - [`memory`]: guest RAM as runs of non-zero pages, checked against the VM's layout;
//! - [`protocol`]: the live-migration wire protocol (messages, framing, checks);
//! - [`vcpu`], [`vm`], [`devices`]: serde `State` types for every component;
//! - [`kvm`]: the `kvm-bindings` structures the vCPU and VM sections hold, and their checks;
//! - [`kvm_serde`]: kvm-bindings' serde of those structures, held to exact sizes;
//! - [`tsc`]: whether a restore can give the guest its saved TSC frequency;
//! - [`manifest`]: what VM a snapshot is of, and the compatibility check of a restore.
//!
//! It makes no KVM call, starts no thread and touches no guest memory: the vmm reads state
//! through its ioctls, hands it here as data, and applies what comes back. Everything read
//! from a file is treated as hostile: verified before use, never a cause of a panic or of
//! an allocation larger than the file.
//!
//! State sections are JSON (`serde_json`): each is small (a vCPU is a few tens of KiB), JSON
//! is self-describing and debuggable with `jq`. KVM structures are written as kvm-bindings
//! writes them (their bytes, a JSON array of numbers); other binary areas are hex strings.
//! Every state type denies unknown fields: the format version covers the container *and*
//! the schema of each section, so a change to either bumps [`format::FORMAT_VERSION`].
//!
//! # Section names in a tandem snapshot
//! `manifest` (first), `vm`, `vcpu.<index>`, `dev.<device id>`, `memory` (last, the
//! bulk); see [`section`].
//!
//! # How the vmm uses it
//! Save, with every vCPU paused: a [`SnapshotWriter`] over a `BufWriter<File>`; write the
//! [`Manifest`]; the [`vm::VmState`] (via [`kvm::KvmVmState`]); one [`vcpu::VcpuState`]
//! per vCPU (via [`kvm::KvmVcpuState`]); each device's [`Snapshottable::save`] as a
//! [`devices::DeviceState`]; then [`write_memory`] over the guest's regions; `finish`, then
//! fsync and rename into place so that a crash never leaves a half-written file under the
//! final name.
//!
//! Restore, before any vCPU runs: [`SnapshotReader::open`] (verifies the whole file); read
//! the manifest and [`check_compatible`] with the configuration asked for (log the notes);
//! read and convert *every* state section (`to_kvm`, device states) and
//! [`validate_memory`] against the new VM's layout, so that a bad file fails before the VM
//! is touched; then [`read_memory`] into the fresh (zeroed) guest memory, set the VM
//! state, each vCPU's state (order in [`kvm`]), restore devices, and resume.

pub mod devices;
pub mod format;
pub mod hex;
#[cfg(target_arch = "x86_64")]
pub mod kvm;
#[cfg(target_arch = "x86_64")]
pub mod kvm_serde;
pub mod manifest;
pub mod memory;
pub mod protocol;
pub mod tsc;
#[cfg(target_arch = "x86_64")]
pub mod vcpu;
#[cfg(target_arch = "x86_64")]
pub mod vm;

use serde::de::DeserializeOwned;
use serde::Serialize;

pub use format::{FormatError, SectionKind, SnapshotReader, SnapshotWriter};
pub use manifest::{check_compatible, CompatError, DeviceConfig, FirmwareId, Manifest};
pub use memory::{read_memory, validate_memory, write_memory, MemoryError};

/// A component whose state can be saved as data and put back.
///
/// `save` is called with the VM paused and must not change the component; `restore` is
/// called on a component freshly built from the same configuration (checked with
/// [`check_compatible`]) before the VM first runs, and must validate the state it is given:
/// it came from a file.
pub trait Snapshottable {
    /// The component's state, as stored in its section.
    type State: Serialize + DeserializeOwned;
    /// What can go wrong saving or restoring.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Captures the component's state.
    fn save(&self) -> Result<Self::State, Self::Error>;

    /// Puts a saved state back.
    fn restore(&mut self, state: &Self::State) -> Result<(), Self::Error>;
}

/// Names of the sections of a tandem snapshot.
pub mod section {
    pub use crate::manifest::MANIFEST_SECTION as MANIFEST;

    /// The VM-wide state ([`crate::vm::VmState`]).
    pub const VM: &str = "vm";
    /// Guest memory ([`crate::memory`]).
    pub const MEMORY: &str = "memory";

    /// The state of vCPU `index` ([`crate::vcpu::VcpuState`]).
    pub fn vcpu(index: u32) -> String {
        format!("vcpu.{index}")
    }

    /// The state of device `id` ([`crate::devices::DeviceState`]).
    pub fn device(id: &str) -> String {
        format!("dev.{id}")
    }
}

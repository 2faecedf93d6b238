//! Live migration, the vmm's side: the migration thread that sends a
//! running VM ([`source`]), the incoming side that receives one into a VM
//! built paused ([`dest`]), the pages on the stream ([`pages`]) and the
//! progress and report ([`status`]). Its streams (addresses, TLS) are
//! `crate::streams`, shared with COLO.
//!
//! The wire protocol itself (messages, framing, checks) is
//! `migration::protocol`; the state the stream carries is the snapshot's
//! (`snapshot::state_image`, checked by the same loader as a restore).

pub mod dest;
pub mod inline;
pub mod joined;
pub mod lanes;
pub mod pages;
pub mod postcopy;
pub mod source;
pub mod status;

pub use source::{Ended, Migration};
pub use status::{Mode, Params, Phase, Status};

use std::sync::Arc;

use migration::protocol::ProtocolError;

use crate::streams::Transport;
use crate::vm::VmHandle;

/// A VM with the streams it opens: what the migration thread and a COLO
/// primary are given (the VM core knows no streams). Derefs to the VM.
#[derive(Clone)]
pub struct VmLink {
    pub vm: VmHandle,
    /// TLS or plain TCP, loaded once when the VM was built.
    pub transport: Arc<Transport>,
}

impl VmLink {
    /// How this VM's migration and COLO streams cross the network.
    pub fn transport(&self) -> &Transport {
        &self.transport
    }
}

impl std::ops::Deref for VmLink {
    type Target = VmHandle;

    fn deref(&self) -> &VmHandle {
        &self.vm
    }
}

/// Why the destination refuses a guest (also sent to the source, as its
/// `Abandon` message).
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("not a tandem migration stream ({0})")]
    NotMigration(#[source] ProtocolError),
    #[error("no Config")]
    NoConfig,
    #[error(transparent)]
    Incompatible(#[from] migration::manifest::CompatError),
    #[error(transparent)]
    State(#[from] crate::snapshot::SnapshotError),
    /// Its disks' locks or its state could not be taken here.
    #[error(transparent)]
    Vm(#[from] crate::vm::VmOpError),
    /// The VM to receive it could not be made here (its size or vCPU
    /// count, this host's limits, the build).
    #[error("{0}")]
    Here(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Why a migration failed (on either side).
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("cannot connect to {0}: {1}")]
    Connect(String, #[source] std::io::Error),
    #[error("cannot listen on {0}: {1}")]
    Listen(String, #[source] std::io::Error),
    #[error("migration stream: {0}")]
    Stream(#[source] std::io::Error),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error(transparent)]
    Memory(#[from] crate::vstate::memory::MemoryError),
    #[error("reading guest memory at {0:#x}: {1}")]
    Read(u64, #[source] vm_memory::GuestMemoryError),
    #[error("writing guest memory at {0:#x}: {1}")]
    Write(u64, #[source] vm_memory::GuestMemoryError),
    #[error(transparent)]
    Vm(#[from] crate::vm::VmOpError),
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    #[error("encoding the VM's state: {0}")]
    Encode(#[from] crate::snapshot::SaveError),
    #[error("the destination refuses this guest: {0}")]
    Refused(#[source] Refusal),
    #[error("cancelled")]
    Cancelled,
    /// Another stream of a multi-stream round failed (its error is the
    /// one reported).
    #[error("another stream failed")]
    OtherStream,
    /// One stream of a multi-stream migration failed.
    #[error("stream {index} of {of}: {source}")]
    Lane {
        index: usize,
        of: usize,
        #[source]
        source: Box<MigrateError>,
    },
    /// The other streams of a multi-stream migration did not all arrive
    /// (or another rule of the streams was broken).
    #[error("{0}")]
    Join(String),
    /// Post-copy broke after the switch, at the destination: the guest
    /// ran here, and `missing` of its pages never came.
    #[error("post-copy: {source}; {missing} of the guest's pages never came: the guest is lost")]
    Lost {
        missing: u64,
        #[source]
        source: Box<MigrateError>,
    },
    #[error("not done after {0} s (--timeout-s)")]
    Timeout(u64),
}

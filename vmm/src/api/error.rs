//! What a control verb answers when it fails: the VM's own errors
//! ([`VmOpError`]) and what the control layer itself refuses (a migration
//! or COLO request it cannot start).
//!
//! Data only, built on the VMM thread; the client gets its one-line
//! message. Never carries a `String` for an error that has a type.

use crate::vm::VmOpError;

/// Why a control verb failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Vm(#[from] VmOpError),
    #[error("migration: {0}")]
    Migration(#[source] Refused),
    #[error("COLO: {0}")]
    Colo(#[source] Refused),
}

impl ControlError {
    /// A refused migration request.
    pub fn migration(r: impl Into<Refused>) -> ControlError {
        ControlError::Migration(r.into())
    }

    /// A refused COLO request.
    pub fn colo(r: impl Into<Refused>) -> ControlError {
        ControlError::Colo(r.into())
    }
}

/// Why a migration or COLO request is refused.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// A parameter out of its range (the check's own message).
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Plain(#[from] crate::streams::transport::PlainOffHost),
    #[error(transparent)]
    Address(#[from] crate::streams::endpoint::BadEndpoint),
    #[error("cannot start {0}: {1}")]
    Thread(&'static str, #[source] std::io::Error),
    #[error("the dirty log is on (dirty-log stop first)")]
    DirtyLogOn,
    #[error("none under way")]
    NoneUnderWay,
    #[error("none started")]
    NoneStarted,
    #[error("this VM is already in a pair")]
    InPair,
    #[error("this VM is in no pair (colo-start)")]
    NoPair,
    #[error("the VM is in a pair (colo-failover ends it)")]
    Paired,
    /// Re-protect of a side that does not serve alone (its state's name).
    #[error(
        "re-protect is for a side that serves alone (primary_alone or \
         failed_over); this one is {0}"
    )]
    NotAlone(serde_json::Value),
    #[error("max_queue must be 1 to 65536 and compare_timeout_ms at least 1")]
    Queue,
    #[error("{0} page channels: 1 to {1}")]
    Channels(u16, u16),
}

/// The VM's errors that `?` meets in the control adapter, each through
/// [`VmOpError`] (which keeps it as its source).
macro_rules! through_vm {
    ($($t:ty),*) => {$(
        impl From<$t> for ControlError {
            fn from(e: $t) -> ControlError {
                ControlError::Vm(e.into())
            }
        }
    )*};
}

through_vm!(
    crate::profile::ProfileError,
    crate::vstate::memory::MemoryError
);

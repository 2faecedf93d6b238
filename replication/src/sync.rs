//! The crate's lock helper (crate-private): [`lock`], which takes over a
//! mutex poisoned by a thread that panicked while holding it.
//!
//! Only the etcd lease ([`crate::etcd`], [`crate::etcd_keepalive`]) shares
//! state between threads here: the held lease's id and its client, each
//! written whole under its lock, so a panicking holder cannot leave them
//! half-changed. Taking the lock over keeps the lease (and so the gate of
//! this side's output) working instead of panicking the caller, a VMM
//! thread, in turn. `devices::sync::lock` is the same rule for the VMM's
//! locks; this crate does not depend on `devices`, so it keeps its own.
//! Runs on whichever thread calls it; never blocks beyond the lock itself.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, taking it over if a thread panicked while holding it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

//! The device loop's turns: who runs, the device loop or an inline
//! migration (`--mode inline`, see `migrate::inline`). The device loop
//! lends the turn after each pass ([`Turns::lend`]); the migration takes
//! it ([`Turns::take`]) and gives it back ([`Turns::give_back`]).
//!
//! Shared by the device thread and the migration thread. Never does: hold
//! the turn for the device loop while no migration wants it, or wait for a
//! device loop that has ended ([`Turns::close`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// How long the migration waits for a turn before it looks again whether
/// the device loop still turns (it ended, or the VM is paused).
const TAKE_WAIT: Duration = Duration::from_millis(100);

#[derive(Default)]
struct TurnState {
    /// The migration holds the turn.
    migration: bool,
    /// The device loop has ended: it hands out no more turns.
    closed: bool,
}

/// Who runs: the device loop, or an inline migration.
#[derive(Default)]
pub struct Turns {
    /// Set while an inline migration wants turns (the loop then polls
    /// without waiting, so that it hands them out at once).
    wanted: AtomicBool,
    state: Mutex<TurnState>,
    changed: Condvar,
}

impl Turns {
    /// Whether an inline migration waits for turns (read by the loop).
    pub fn wanted(&self) -> bool {
        self.wanted.load(Ordering::SeqCst)
    }

    /// The device loop's side, after each pass: if a migration wants the
    /// turn, hands it over and waits until it comes back.
    pub fn lend(&self) {
        if !self.wanted() {
            return;
        }
        let mut s = devices::sync::lock(&self.state);
        s.migration = true;
        self.changed.notify_all();
        while s.migration && self.wanted() {
            s = self
                .changed
                .wait(s)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        s.migration = false;
    }

    /// The device loop has ended: no more turns (an inline migration runs
    /// on alone).
    pub fn close(&self) {
        let mut s = devices::sync::lock(&self.state);
        s.closed = true;
        self.changed.notify_all();
    }

    /// The migration's side: waits for the turn; `free` says whether the
    /// loop has stopped turning (a paused VM), in which case the
    /// migration runs without it.
    pub fn take(&self, free: &dyn Fn() -> bool) {
        self.wanted.store(true, Ordering::SeqCst);
        let mut s = devices::sync::lock(&self.state);
        while !s.migration && !s.closed && !free() {
            s = self
                .changed
                .wait_timeout(s, TAKE_WAIT)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// The migration hands the turn back; `more` says whether it wants
    /// another one.
    pub fn give_back(&self, more: bool) {
        self.wanted.store(more, Ordering::SeqCst);
        let mut s = devices::sync::lock(&self.state);
        s.migration = false;
        self.changed.notify_all();
    }
}

/// A shared [`Turns`] (one per device thread).
pub type SharedTurns = Arc<Turns>;

//! `--mode inline`: the migration run *from the device thread's event
//! loop*, between device events, the way QEMU's I/O thread ran it before
//! it got a thread of its own. It exists to measure what the dedicated
//! thread buys, on the same guest in the same run.
//!
//! The migration code stays the same; what changes is who may run. The
//! device loop and the migration take [`Turns`]: while the migration holds
//! the turn (a slice of up to [`SLICE`] of page copying, as QEMU's
//! `ram_save_iterate` allowed itself 50 ms), the device loop stands still,
//! no queue is served and no frame is read from a tap; then the loop runs
//! one pass over whatever events are ready and hands the turn back. That
//! is one thread of control, exactly as if the slices were called from the
//! loop. (tandem has no big lock: vCPU exits do not wait on the device
//! loop, so this reproduces the I/O-thread half of QEMU's old design.)
//!
//! [`Turns`] is shared by the device thread and the migration thread;
//! [`Slicer`] is the migration thread's side. Never does: keep the turn
//! while the migration sleeps for its bandwidth cap or pauses the VM (the
//! device loop must reach its gate), or wait for a device loop that has
//! ended.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The longest the migration holds the device loop at a time.
pub const SLICE: Duration = Duration::from_millis(50);
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
    fn take(&self, free: &dyn Fn() -> bool) {
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
    fn give_back(&self, more: bool) {
        self.wanted.store(more, Ordering::SeqCst);
        let mut s = devices::sync::lock(&self.state);
        s.migration = false;
        self.changed.notify_all();
    }
}

/// The migration thread's side of the turns: where a slice may end.
pub struct Slicer<'a> {
    inline: Option<(&'a Turns, &'a dyn Fn() -> bool)>,
    /// When the turn held now was taken.
    held: Cell<Option<Instant>>,
}

impl<'a> Slicer<'a> {
    /// The dedicated thread: it takes no turns.
    pub fn thread() -> Slicer<'static> {
        Slicer {
            inline: None,
            held: Cell::new(None),
        }
    }

    /// Inline: turns taken from `turns`; `free` as for [`Turns::take`].
    pub fn inline(turns: &'a Turns, free: &'a dyn Fn() -> bool) -> Slicer<'a> {
        Slicer {
            inline: Some((turns, free)),
            held: Cell::new(None),
        }
    }

    /// At a point between two pieces of work (a batch): ends the slice
    /// when it has run long enough, and holds a turn for the next piece.
    pub fn point(&self) {
        let Some((turns, free)) = self.inline else {
            return;
        };
        if self.held.get().is_some_and(|t| t.elapsed() >= SLICE) {
            // The loop gets one pass before the next slice.
            self.held.set(None);
            turns.give_back(true);
        }
        if self.held.get().is_none() {
            turns.take(free);
            self.held.set(Some(Instant::now()));
        }
    }

    /// Hands the turn back (before a sleep, a pause, or at the end).
    pub fn release(&self) {
        if let Some((turns, _)) = self.inline {
            self.held.set(None);
            turns.give_back(false);
        }
    }
}

impl Drop for Slicer<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// A shared [`Turns`] (one per device thread).
pub type SharedTurns = Arc<Turns>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// A stand-in for the device loop: one pass = one count, then a turn.
    fn fake_loop(turns: SharedTurns, stop: Arc<AtomicBool>, passes: Arc<AtomicU64>) {
        while !stop.load(Ordering::SeqCst) {
            passes.fetch_add(1, Ordering::SeqCst);
            if !turns.wanted() {
                std::thread::sleep(Duration::from_millis(1));
            }
            turns.lend();
        }
        turns.close();
    }

    #[test]
    fn the_loop_stands_still_while_the_migration_holds_the_turn() {
        let turns = SharedTurns::default();
        let stop = Arc::new(AtomicBool::new(false));
        let passes = Arc::new(AtomicU64::new(0));
        let (t, s, p) = (turns.clone(), stop.clone(), passes.clone());
        let lp = std::thread::spawn(move || fake_loop(t, s, p));
        let never = || false;
        let slicer = Slicer::inline(&turns, &never);
        slicer.point();
        let at = passes.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(passes.load(Ordering::SeqCst), at, "no pass during a slice");
        // Past the slice, the next point lets the loop run one pass.
        std::thread::sleep(SLICE);
        slicer.point();
        let after = passes.load(Ordering::SeqCst);
        assert!(after > at, "a pass between slices");
        slicer.release();
        std::thread::sleep(Duration::from_millis(20));
        assert!(passes.load(Ordering::SeqCst) > after + 2, "free again");
        stop.store(true, Ordering::SeqCst);
        lp.join().unwrap();
    }

    #[test]
    fn no_wait_for_a_loop_that_ended_or_a_paused_vm() {
        let turns = Turns::default();
        turns.close();
        let never = || false;
        Slicer::inline(&turns, &never).point();
        let open = Turns::default();
        let paused = || true;
        Slicer::inline(&open, &paused).point();
    }

    #[test]
    fn the_thread_mode_takes_no_turns() {
        let s = Slicer::thread();
        s.point();
        s.release();
    }
}

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
//! [`Turns`] (the device thread's, `device_thread::turns`) is shared by
//! the device thread and the migration thread; [`Slicer`] is the
//! migration thread's side. Never does: keep the turn
//! while the migration sleeps for its bandwidth cap or pauses the VM (the
//! device loop must reach its gate), or wait for a device loop that has
//! ended.

use std::cell::Cell;
use std::time::{Duration, Instant};

use crate::device_thread::turns::Turns;

/// The longest the migration holds the device loop at a time.
pub const SLICE: Duration = Duration::from_millis(50);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device_thread::turns::SharedTurns;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

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

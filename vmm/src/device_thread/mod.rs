//! The device thread: one `event-manager` loop for the virtio devices
//! (queue notifications, tap readiness, RSC drain timers, disk I/O).
//!
//! It parks at its own gate while the VM is paused (woken through an
//! eventfd so that it reaches the gate at once) and ends when told to
//! ([`DeviceThread::finish`] joins it). Between passes it lends its turn
//! to an inline migration ([`turns`]), if one waits. Driven from the VMM
//! thread, and from the migration and COLO threads through the `Vm`. The loop
//! never takes a lock a vCPU holds for long: each device has its own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use vmm_sys_util::eventfd::EventFd;

use crate::device_manager::Subscribers;
use crate::pause::{Gate, PauseError};
use turns::{SharedTurns, Turns};

pub mod turns;

/// How often the loop looks at its gate when idle.
const TICK_MS: i32 = 100;

/// The running device thread.
pub struct DeviceThread {
    gate: Arc<Gate>,
    /// Lent to an inline migration (`--mode inline`) between passes.
    turns: SharedTurns,
    kick: EventFd,
    ended: Arc<AtomicBool>,
    done: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Drains the thread's wake-up eventfd (used to reach the gate).
struct Kick(EventFd);

impl MutEventSubscriber for Kick {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.0, EventSet::IN)) {
            log::error!("cannot watch the device thread's kick: {e:?}");
        }
    }

    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.0.read();
    }
}

impl DeviceThread {
    /// Starts the loop of `em`; it runs until [`DeviceThread::pause`].
    pub fn spawn(mut em: Subscribers) -> std::io::Result<DeviceThread> {
        let kick = EventFd::new(libc::EFD_NONBLOCK)?;
        em.add_subscriber(Arc::new(Mutex::new(Kick(kick.try_clone()?))));
        let gate = Arc::new(Gate::default());
        let ended = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicBool::new(false));
        let turns = Arc::new(Turns::default());
        let (g, e, d, t) = (gate.clone(), ended.clone(), done.clone(), turns.clone());
        let thread = std::thread::Builder::new()
            .name("devices".into())
            .spawn(move || {
                crate::sandbox::confine(crate::sandbox::Kind::Devices);
                while !e.load(Ordering::SeqCst) {
                    g.park_if_paused();
                    if e.load(Ordering::SeqCst) {
                        break;
                    }
                    // An inline migration waiting: one pass over what is
                    // ready, then its turn.
                    let wait = if t.wanted() { 0 } else { TICK_MS };
                    if let Err(err) = em.run_with_timeout(wait) {
                        log::error!("device event loop: {err:?}");
                    }
                    t.lend();
                }
                t.close();
                d.store(true, Ordering::SeqCst);
            })?;
        Ok(DeviceThread {
            gate,
            turns,
            kick,
            ended,
            done,
            thread: Some(thread),
        })
    }

    /// Stops device processing: returns once the loop is parked.
    pub fn pause(&self) -> Result<(), PauseError> {
        let kick = &self.kick;
        self.gate.pause(1, || {
            let _ = kick.write(1);
        })
    }

    /// The turns the loop lends to an inline migration.
    pub fn turns(&self) -> SharedTurns {
        self.turns.clone()
    }

    /// Lets the loop go on.
    pub fn resume(&self) {
        self.gate.resume();
    }

    /// Ends the loop and joins the thread (waiting at most `timeout`).
    pub fn finish(&mut self, timeout: Duration) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.ended.store(true, Ordering::SeqCst);
        self.gate.resume();
        let _ = self.kick.write(1);
        let start = Instant::now();
        while !self.done.load(Ordering::SeqCst) && start.elapsed() < timeout {
            std::thread::sleep(Duration::from_millis(5));
        }
        if self.done.load(Ordering::SeqCst) {
            let _ = thread.join();
        } else {
            log::warn!("the device thread did not end in {timeout:?}");
        }
    }
}

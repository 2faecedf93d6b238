//! Pausing a running VM: every vCPU stops at a clean point (outside
//! `KVM_RUN`, with its last exit fully handled) and device processing
//! stops; resume undoes both.
//!
//! - vCPUs: [`Gate::pause`] raises a flag and kicks each vCPU thread with a
//!   signal, so `KVM_RUN` returns `EINTR`; the thread sees the flag, parks,
//!   and reports in. Kicks repeat until every vCPU has parked, which covers a
//!   signal that lands just before a thread enters `KVM_RUN`.
//! - Devices: the device thread runs one event loop; it checks the same kind
//!   of gate between loop turns and parks there (it is woken by an eventfd).
//!
//! Never blocks a vCPU on anything but the gate while paused.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

/// How long a pause may take before it is reported as failed.
pub const PAUSE_TIMEOUT: Duration = Duration::from_secs(10);
const KICK_PERIOD: Duration = Duration::from_millis(5);

/// Pause errors.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error("cannot install the vCPU kick signal handler: {0}")]
    Signal(vmm_sys_util::errno::Error),
    #[error("only {parked} of {total} threads stopped in time")]
    Timeout { parked: usize, total: usize },
}

/// The signal that kicks a vCPU out of `KVM_RUN`.
pub fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// Installs the (empty) handler of the kick signal; without one the signal
/// would end the process. Call once before starting vCPU threads.
pub fn install_kick_handler() -> Result<(), PauseError> {
    register_signal_handler(kick_signal(), on_kick).map_err(PauseError::Signal)
}

#[derive(Default)]
struct GateState {
    paused: bool,
    parked: usize,
}

/// Where a group of threads parks while the VM is paused.
#[derive(Default)]
pub struct Gate {
    /// Mirrors `state.paused`, so that the common case takes no lock.
    requested: AtomicBool,
    state: Mutex<GateState>,
    changed: Condvar,
}

impl Gate {
    /// Whether a pause is asked for (cheap; checked by the threads).
    pub fn pause_requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    /// Called by a gated thread at a clean point: parks while paused.
    pub fn park_if_paused(&self) {
        self.park_serving(|| {});
    }

    /// [`Gate::park_if_paused`], calling `serve` once parked and on every
    /// [`Gate::wake`] while parked: the parked thread does work only it can
    /// do (a vCPU reads its own state). `serve` runs with the gate's lock
    /// held, so a request sent before `wake` is never missed.
    pub fn park_serving(&self, mut serve: impl FnMut()) {
        if !self.pause_requested() {
            return;
        }
        let mut s = devices::bus::lock(&self.state);
        if !s.paused {
            return;
        }
        s.parked += 1;
        self.changed.notify_all();
        while s.paused {
            serve();
            s = self
                .changed
                .wait(s)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        s.parked -= 1;
        self.changed.notify_all();
    }

    /// Asks the `total` gated threads to park and waits until they have;
    /// `kick` is called every few milliseconds meanwhile to wake them.
    pub fn pause(&self, total: usize, kick: impl FnMut()) -> Result<(), PauseError> {
        self.pause_within(total, PAUSE_TIMEOUT, kick)
    }

    /// [`Gate::pause`] with a deadline of its own.
    pub fn pause_within(
        &self,
        total: usize,
        timeout: Duration,
        mut kick: impl FnMut(),
    ) -> Result<(), PauseError> {
        let start = Instant::now();
        let mut s = devices::bus::lock(&self.state);
        s.paused = true;
        self.requested.store(true, Ordering::SeqCst);
        while s.parked < total {
            if start.elapsed() > timeout {
                let parked = s.parked;
                s.paused = false;
                self.requested.store(false, Ordering::SeqCst);
                self.changed.notify_all();
                return Err(PauseError::Timeout { parked, total });
            }
            drop(s);
            kick();
            s = devices::bus::lock(&self.state);
            s = self
                .changed
                .wait_timeout(s, KICK_PERIOD)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        Ok(())
    }

    /// Lets the parked threads go.
    pub fn resume(&self) {
        let mut s = devices::bus::lock(&self.state);
        s.paused = false;
        self.requested.store(false, Ordering::SeqCst);
        self.changed.notify_all();
    }

    /// Wakes the parked threads so that they look for work (see
    /// [`Gate::park_serving`]); they stay parked.
    pub fn wake(&self) {
        let _s = devices::bus::lock(&self.state);
        self.changed.notify_all();
    }

    /// Whether the VM is paused (asked for and not resumed).
    pub fn is_paused(&self) -> bool {
        devices::bus::lock(&self.state).paused
    }
}

/// Kicks each vCPU thread out of `KVM_RUN`.
pub fn kick_all<T>(threads: &[JoinHandle<T>]) {
    for t in threads {
        if let Err(e) = t.kill(kick_signal()) {
            log::debug!("kick: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    #[test]
    fn threads_park_and_resume() {
        let gate = Arc::new(Gate::default());
        let stop = Arc::new(AtomicBool::new(false));
        let work = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let (gate, stop, work) = (gate.clone(), stop.clone(), work.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        gate.park_if_paused();
                        work.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(1));
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        gate.pause(3, || {}).unwrap();
        let at_pause = work.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(work.load(Ordering::SeqCst), at_pause, "work while paused");
        gate.resume();
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            work.load(Ordering::SeqCst) > at_pause,
            "no work after resume"
        );
        stop.store(true, Ordering::SeqCst);
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn a_parked_thread_serves_requests_and_stays_parked() {
        let gate = Arc::new(Gate::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel::<std::sync::mpsc::Sender<u32>>();
        let runs = Arc::new(AtomicU64::new(0));
        let t = {
            let (gate, stop, runs) = (gate.clone(), stop.clone(), runs.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    gate.park_serving(|| {
                        while let Ok(reply) = rx.try_recv() {
                            reply.send(7).unwrap();
                        }
                    });
                    runs.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        gate.pause(1, || {}).unwrap();
        let at_pause = runs.load(Ordering::SeqCst);
        for _ in 0..3 {
            let (reply, answer) = std::sync::mpsc::channel();
            tx.send(reply).unwrap();
            gate.wake();
            assert_eq!(answer.recv_timeout(Duration::from_secs(5)), Ok(7));
        }
        assert_eq!(runs.load(Ordering::SeqCst), at_pause, "left the gate");
        stop.store(true, Ordering::SeqCst);
        gate.resume();
        t.join().unwrap();
    }

    #[test]
    fn pause_times_out_when_a_thread_never_parks() {
        let gate = Gate::default();
        // Nobody parks: the pause must fail, not hang, and undo itself.
        let start = Instant::now();
        let timeout = Duration::from_millis(100);
        let err = gate.pause_within(1, timeout, || {}).unwrap_err();
        assert!(matches!(
            err,
            PauseError::Timeout {
                parked: 0,
                total: 1
            }
        ));
        assert!(start.elapsed() >= timeout);
        assert!(!gate.pause_requested());
    }
}

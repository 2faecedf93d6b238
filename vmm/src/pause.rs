//! The two ways a running VM's threads are stopped:
//!
//! - vCPUs are kicked out of `KVM_RUN` by a signal ([`ThreadKick`]) whose
//!   handler sets `immediate_exit` in the `kvm_run` of the thread it lands
//!   on (registered by the vCPU thread with [`set_thread_kvm_run`]), so a
//!   kick that arrives just before `KVM_RUN` makes it return at once
//!   instead of being lost until the next exit. The vCPU thread clears it
//!   at each clean point and reads its events there (`vcpu.rs`).
//! - The device thread runs one event loop; it checks a [`Gate`] between
//!   loop turns and parks there while the VM is paused (it is woken by an
//!   eventfd).
//!
//! Nothing here blocks a vCPU.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

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

thread_local! {
    /// This thread's `kvm_run` (vCPU threads only), for the kick handler.
    static KVM_RUN: Cell<*mut kvm_bindings::kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

/// Registers `run` as the calling vCPU thread's `kvm_run`, so that a kick
/// sets its `immediate_exit`; null unregisters (before the vCPU fd goes).
pub fn set_thread_kvm_run(run: *mut kvm_bindings::kvm_run) {
    KVM_RUN.with(|c| c.set(run));
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Only a const-initialized thread-local Cell and a volatile store: both
    // are async-signal-safe.
    let run = KVM_RUN.with(Cell::get);
    if !run.is_null() {
        // SAFETY: a non-null pointer is this thread's own live `kvm_run`
        // mapping, registered by the vCPU thread while it owns its vCPU fd
        // and cleared before the fd is dropped; the signal runs on this
        // thread, so the mapping cannot go away meanwhile.
        unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(1) };
    }
}

/// Installs the handler of the kick signal (without one the signal would
/// end the process). Call once before starting vCPU threads.
pub fn install_kick_handler() -> Result<(), PauseError> {
    register_signal_handler(kick_signal(), on_kick).map_err(PauseError::Signal)
}

/// Lets other threads kick one vCPU thread, safely whether it still runs or
/// not: the thread registers itself when it starts and unregisters before it
/// ends, and a kick is sent only to a registered thread.
#[derive(Default)]
pub struct ThreadKick {
    thread: Mutex<Option<libc::pthread_t>>,
}

impl ThreadKick {
    /// Registers the calling thread as the one to kick.
    pub fn register_current(&self) {
        // SAFETY: pthread_self has no preconditions.
        *devices::sync::lock(&self.thread) = Some(unsafe { libc::pthread_self() });
    }

    /// Unregisters the thread (called by it before it ends).
    pub fn unregister(&self) {
        *devices::sync::lock(&self.thread) = None;
    }

    /// Sends the kick signal to the registered thread, if any.
    pub fn kick(&self) {
        let t = devices::sync::lock(&self.thread);
        if let Some(thread) = *t {
            // SAFETY: the thread is registered, so it has not ended (it
            // unregisters under this lock before it does) and its pthread_t
            // is valid; the kick signal has a handler.
            let rc = unsafe { libc::pthread_kill(thread, kick_signal()) };
            if rc != 0 {
                log::debug!("kick: pthread_kill: {rc}");
            }
        }
    }
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
        if !self.pause_requested() {
            return;
        }
        let mut s = devices::sync::lock(&self.state);
        if !s.paused {
            return;
        }
        s.parked += 1;
        self.changed.notify_all();
        while s.paused {
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
        kick: impl FnMut(),
    ) -> Result<(), PauseError> {
        self.pause_kicking(total, timeout, KICK_PERIOD, kick)
    }

    /// [`Gate::pause_within`], kicking every `period`.
    fn pause_kicking(
        &self,
        total: usize,
        timeout: Duration,
        period: Duration,
        mut kick: impl FnMut(),
    ) -> Result<(), PauseError> {
        let start = Instant::now();
        let mut s = devices::sync::lock(&self.state);
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
            s = devices::sync::lock(&self.state);
            // A thread woken by the kick may have parked (and notified) in
            // the moment the lock was free: waiting then would lose a whole
            // kick period.
            if s.parked < total {
                s = self
                    .changed
                    .wait_timeout(s, period)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
            }
        }
        Ok(())
    }

    /// Lets the parked threads go.
    pub fn resume(&self) {
        let mut s = devices::sync::lock(&self.state);
        s.paused = false;
        self.requested.store(false, Ordering::SeqCst);
        self.changed.notify_all();
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
    fn a_thread_that_parks_at_the_kick_ends_the_pause_at_once() {
        let gate = Arc::new(Gate::default());
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let g = gate.clone();
        let thread = std::thread::spawn(move || {
            while rx.recv().is_ok() {
                g.park_if_paused();
            }
        });
        // The kick returns only once the thread has parked (and notified,
        // with nobody waiting yet): the pause must see it without waiting
        // for a notification that already went.
        let period = Duration::from_secs(30);
        let kick = || {
            tx.send(()).unwrap();
            while devices::sync::lock(&gate.state).parked == 0 {
                std::thread::yield_now();
            }
        };
        let start = Instant::now();
        gate.pause_kicking(1, Duration::from_secs(60), period, kick)
            .unwrap();
        assert!(start.elapsed() < period / 2, "waited a kick period");
        gate.resume();
        drop(tx);
        thread.join().unwrap();
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

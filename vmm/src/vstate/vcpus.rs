//! The VM's vCPU threads as a group: pause, resume, capture and apply
//! state, throttle, finish. Each operation sends its event to every vCPU
//! first (each send kicks that thread out of `KVM_RUN`) and then collects
//! the answers, so the vCPUs do the work in parallel, each on its own
//! thread, and the whole takes as long as the slowest one.
//!
//! A throttled vCPU sleeps at its clean points, which a guest that computes
//! without exits never reaches: while a throttle is set, the kicker thread
//! (owned here, ended by [`Vcpus::finish`]) kicks every vCPU every
//! [`KICK_PERIOD`], so each runs at most its slice plus one period.
//!
//! Used from the VMM thread (the control API) and from the migration and
//! COLO threads, through the same lock. Never blocks a vCPU: a vCPU only ever
//! waits on its own channel; a vCPU that does not answer in time is an
//! error here, never a hang.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use migration::kvm::KvmVcpuState;

use crate::pause::ThreadKick;
use crate::vstate::vcpu::{VcpuError, VcpuEvent, VcpuHandle, VcpuReply};

/// How long a vCPU may take to stop, resume or hand over its state.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a throttled vCPU is kicked to its clean point.
pub const KICK_PERIOD: Duration = Duration::from_millis(5);

/// Every vCPU of a VM, in id order.
pub struct Vcpus {
    handles: Vec<VcpuHandle>,
    kicker: Option<Kicker>,
}

/// The thread that kicks throttled vCPUs.
struct Kicker {
    percent: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Kicker {
    fn spawn(kicks: Vec<Arc<ThreadKick>>) -> Result<Kicker, VcpuError> {
        let percent = Arc::new(AtomicU8::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (percent.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("vcpu-kicker".into())
            .spawn(move || {
                crate::sandbox::confine(crate::sandbox::Kind::Helper);
                while !s.load(Ordering::SeqCst) {
                    if p.load(Ordering::SeqCst) == 0 {
                        // Unparked when a throttle is set, or to end.
                        std::thread::park();
                        continue;
                    }
                    for k in &kicks {
                        k.kick();
                    }
                    std::thread::sleep(KICK_PERIOD);
                }
            })
            .map_err(VcpuError::Spawn)?;
        Ok(Kicker {
            percent,
            stop,
            thread,
        })
    }

    fn end(self) {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.thread().unpark();
        let _ = self.thread.join();
    }
}

impl Vcpus {
    /// The vCPUs of `handles` (threads started paused).
    pub fn new(handles: Vec<VcpuHandle>) -> Self {
        Vcpus {
            handles,
            kicker: None,
        }
    }

    /// How many vCPUs there are.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Sends `ev(id)` to every vCPU, then waits for each one's answer and
    /// hands it to `take`.
    fn round<T>(
        &self,
        what: &'static str,
        mut ev: impl FnMut(usize) -> VcpuEvent,
        mut take: impl FnMut(&VcpuHandle, VcpuReply) -> Result<T, VcpuError>,
    ) -> Result<Vec<T>, VcpuError> {
        for h in &self.handles {
            h.drain_answers();
        }
        for (i, h) in self.handles.iter().enumerate() {
            h.send(ev(i))?;
        }
        let mut out = Vec::with_capacity(self.handles.len());
        let mut first_err = None;
        for h in &self.handles {
            // Every answer is awaited, even after an error, so that none is
            // left to confuse the next round.
            match h.answer(what, ANSWER_TIMEOUT).and_then(|r| take(h, r)) {
                Ok(v) => out.push(v),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Stops every vCPU outside `KVM_RUN`. If one does not stop, the others
    /// are resumed and the error says which.
    pub fn pause(&self) -> Result<(), VcpuError> {
        let r = self.round(
            "stop",
            |_| VcpuEvent::Pause,
            |h, r| want_reply(h, r, |r| matches!(r, VcpuReply::Paused)),
        );
        if r.is_err() {
            let _ = self.resume();
        }
        r.map(|_| ())
    }

    /// Lets every vCPU run again.
    pub fn resume(&self) -> Result<(), VcpuError> {
        self.round(
            "resume",
            |_| VcpuEvent::Resume,
            |h, r| want_reply(h, r, |r| matches!(r, VcpuReply::Resumed)),
        )
        .map(|_| ())
    }

    /// The state of every vCPU (paused), read in parallel.
    pub fn capture(&self, msr_indices: &Arc<Vec<u32>>) -> Result<Vec<KvmVcpuState>, VcpuError> {
        self.round(
            "hand over its state",
            |_| VcpuEvent::SaveState(msr_indices.clone()),
            |h, r| match r {
                VcpuReply::State(s) => (*s).map_err(|source| VcpuError::State { id: h.id, source }),
                other => Err(unexpected(h, other)),
            },
        )
    }

    /// Writes `states` (one per vCPU, in id order) to the paused vCPUs.
    pub fn apply(&self, states: Vec<KvmVcpuState>) -> Result<(), VcpuError> {
        if states.len() != self.handles.len() {
            return Err(VcpuError::Count {
                have: self.handles.len(),
                states: states.len(),
            });
        }
        let mut states = states.into_iter();
        self.round(
            "take its state",
            |_| VcpuEvent::RestoreState(Box::new(states.next().unwrap_or_default())),
            |h, r| match r {
                VcpuReply::Restored(res) => {
                    res.map_err(|source| VcpuError::State { id: h.id, source })
                }
                other => Err(unexpected(h, other)),
            },
        )
        .map(|_| ())
    }

    /// Makes every vCPU run only (100 - `percent`)% of the time (0: off;
    /// see [`crate::vstate::vcpu::THROTTLE_SLICE`]).
    pub fn throttle(&mut self, percent: u8) -> Result<(), VcpuError> {
        for h in &self.handles {
            h.send(VcpuEvent::Throttle(percent))?;
        }
        if self.kicker.is_none() && percent > 0 {
            let kicks = self.handles.iter().map(VcpuHandle::kick).collect();
            self.kicker = Some(Kicker::spawn(kicks)?);
        }
        if let Some(k) = &self.kicker {
            k.percent.store(percent, Ordering::SeqCst);
            k.thread.thread().unpark();
        }
        Ok(())
    }

    /// Ends the kicker and every vCPU thread, and joins them, each vCPU
    /// waiting at most `timeout`.
    pub fn finish(&mut self, timeout: Duration) {
        if let Some(k) = self.kicker.take() {
            k.end();
        }
        for h in self.handles.drain(..) {
            h.finish(timeout);
        }
    }
}

fn want_reply(
    h: &VcpuHandle,
    r: VcpuReply,
    want: impl Fn(&VcpuReply) -> bool,
) -> Result<(), VcpuError> {
    if want(&r) {
        Ok(())
    } else {
        Err(unexpected(h, r))
    }
}

fn unexpected(h: &VcpuHandle, r: VcpuReply) -> VcpuError {
    VcpuError::Answer {
        id: h.id,
        answer: format!("{r:?}"),
    }
}

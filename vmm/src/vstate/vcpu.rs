//! vCPU threads and the handles that drive them.
//!
//! Each vCPU runs on its own thread: a `KVM_RUN` loop that sends port and
//! MMIO exits to the buses, completes what the emulator gives up on, counts
//! its exits and reports how the VM ended. The thread alone owns its
//! `VcpuFd`; every other thread drives it through its [`VcpuHandle`]: a
//! channel of [`VcpuEvent`]s and a kick (the pause signal, which sets
//! `immediate_exit`, so `KVM_RUN` returns at once wherever the thread is),
//! answered on a reply channel.
//!
//! The thread looks at its events at each clean point (the last exit fully
//! handled, outside `KVM_RUN`). Paused, it blocks on its channel and serves
//! `SaveState` / `RestoreState` there, so the state of several vCPUs is read
//! or written in parallel, each on its own thread. A throttled vCPU sleeps
//! after each running slice on the same channel (an event wakes it).
//! A vCPU thread never blocks on anything but `KVM_RUN`, its channel and
//! the lock of the device it is accessing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devices::{Bus, GuestMemoryMmap};
use kvm_ioctls::{VcpuExit, VcpuFd};
use migration::kvm::KvmVcpuState;

use crate::host_emu::{self, HostKind};
use crate::pause::{self, ThreadKick};
use crate::profile::Profiler;
use crate::vstate::exit::{ExitSignal, VmExit};
use crate::vstate::exit_counts::{ExitCounts, Kind};
use crate::vstate::vcpu_state::{self, VcpuStateError};

const KVM_SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const KVM_SYSTEM_EVENT_RESET: u32 = 2;
/// The throttle's running slice: a vCPU throttled by P% runs this long,
/// then sleeps P/(100-P) of it, so that it runs (100-P)% of the time
/// (QEMU's shape and slice). The guest's pauses grow with P: 2.5 ms at
/// 20%, 10 ms at 50%, 90 ms at 90%, 990 ms at 99%; its slices never
/// shrink below 10 ms (a fixed 50 ms window left it 0.5 ms at 99%).
pub const THROTTLE_SLICE: Duration = Duration::from_millis(10);
/// The highest throttle (a vCPU always runs a little).
pub const MAX_THROTTLE: u8 = 99;

/// What another thread asks of a vCPU thread.
pub enum VcpuEvent {
    /// Stop at the next clean point and wait for more events.
    Pause,
    /// Go on running.
    Resume,
    /// Read the whole state (MSRs from this index list); paused only.
    SaveState(Arc<Vec<u32>>),
    /// Write a whole state; paused only.
    RestoreState(Box<KvmVcpuState>),
    /// Run only (100 - this)% of the time, in [`THROTTLE_SLICE`]s (0: off).
    Throttle(u8),
    /// End the thread (the VM is ending).
    Finish,
}

/// What a vCPU thread answers.
#[derive(Debug)]
pub enum VcpuReply {
    Paused,
    Resumed,
    State(Box<Result<KvmVcpuState, VcpuStateError>>),
    Restored(Result<(), VcpuStateError>),
}

/// Errors of driving a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("vCPU {0} has stopped")]
    Gone(u8),
    #[error("vCPU {id} did not {what} within {secs} s")]
    Timeout {
        id: u8,
        what: &'static str,
        secs: u64,
    },
    #[error("vCPU {id}: unexpected answer {answer}")]
    Answer { id: u8, answer: String },
    #[error("vCPU {id}: {source}")]
    State { id: u8, source: VcpuStateError },
    #[error("cannot start a vCPU thread: {0}")]
    Spawn(std::io::Error),
    #[error("{states} vCPU states for {have} vCPUs")]
    Count { have: usize, states: usize },
}

/// A configured vCPU, ready to run on its own thread.
pub struct Vcpu {
    pub fd: VcpuFd,
    pub id: u8,
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub mem: GuestMemoryMmap,
    /// The firmware image (`--firmware`), read-only guest memory outside
    /// `mem`, where instructions may have to be read too.
    pub rom: Option<Arc<crate::boot::firmware::Firmware>>,
    /// The host's own kind ([`HostKind::probe`]): the instruction emulator
    /// is entered only on an emulated host (`host_emu::internal_error`).
    pub host: HostKind,
    pub exit: Arc<ExitSignal>,
    pub profiler: Arc<Profiler>,
    pub exits: Arc<ExitCounts>,
    /// How other threads kick this one out of `KVM_RUN` (made before the
    /// vCPU, so that the profiler can hold it too).
    pub kick: Arc<ThreadKick>,
}

/// The thread's side of its handle.
struct Inbox {
    events: Receiver<VcpuEvent>,
    replies: Sender<VcpuReply>,
}

impl Vcpu {
    /// Starts the vCPU's thread, paused: it runs guest code only after a
    /// [`VcpuEvent::Resume`].
    pub fn spawn(self) -> Result<VcpuHandle, VcpuError> {
        let (ev_tx, ev_rx) = mpsc::channel();
        let (rep_tx, rep_rx) = mpsc::channel();
        let kick = self.kick.clone();
        let done = Arc::new(AtomicBool::new(false));
        let id = self.id;
        let (k, d) = (kick.clone(), done.clone());
        let inbox = Inbox {
            events: ev_rx,
            replies: rep_tx,
        };
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || {
                crate::sandbox::confine(crate::sandbox::Kind::Vcpu);
                let mut me = self;
                k.register_current();
                pause::set_thread_kvm_run(me.fd.get_kvm_run());
                let why = VcpuThread::new(&inbox).run(&mut me);
                k.unregister();
                pause::set_thread_kvm_run(std::ptr::null_mut());
                d.store(true, Ordering::SeqCst);
                if let Some(why) = why {
                    me.exit.signal(why);
                }
            })
            .map_err(VcpuError::Spawn)?;
        Ok(VcpuHandle {
            id,
            events: ev_tx,
            replies: rep_rx,
            kick,
            thread: Some(thread),
            done,
        })
    }
}

/// The loop state of a vCPU thread.
struct VcpuThread<'a> {
    inbox: &'a Inbox,
    paused: bool,
    throttle: u8,
    /// When the current throttle slice began to run.
    window: Instant,
    /// Whether `KVM_RUN` was entered: a userspace exit may then be waiting
    /// for its completion (see `RestoreState`).
    ran: bool,
}

/// What the event loop says to the run loop.
enum Next {
    Run,
    End,
}

impl<'a> VcpuThread<'a> {
    fn new(inbox: &'a Inbox) -> Self {
        VcpuThread {
            inbox,
            paused: true,
            throttle: 0,
            window: Instant::now(),
            ran: false,
        }
    }

    fn reply(&self, r: VcpuReply) {
        // The VMM thread may have stopped waiting: nothing to do then.
        let _ = self.inbox.replies.send(r);
    }

    /// Serves one event; `Next::End` ends the thread.
    fn serve(&mut self, v: &mut Vcpu, ev: VcpuEvent) -> Next {
        match ev {
            VcpuEvent::Pause => {
                self.paused = true;
                self.reply(VcpuReply::Paused);
            }
            VcpuEvent::Resume => {
                self.paused = false;
                self.window = Instant::now();
                self.reply(VcpuReply::Resumed);
            }
            VcpuEvent::SaveState(msrs) => {
                vcpu_state::complete_pending_exit(&mut v.fd);
                let s = vcpu_state::capture(&v.fd, &msrs);
                self.reply(VcpuReply::State(Box::new(s)));
            }
            VcpuEvent::RestoreState(s) => {
                let r = if self.ran {
                    vcpu_state::overwrite(&mut v.fd, &s)
                } else {
                    vcpu_state::apply(&v.fd, &s)
                };
                self.reply(VcpuReply::Restored(r));
            }
            VcpuEvent::Throttle(p) => self.throttle = p.min(MAX_THROTTLE),
            VcpuEvent::Finish => return Next::End,
        }
        Next::Run
    }

    /// At a clean point: serves every event waiting, blocks while paused,
    /// and sleeps when the throttle's running slice is used up.
    fn clean_point(&mut self, v: &mut Vcpu) -> Next {
        loop {
            let ev = if self.paused {
                match self.inbox.events.recv() {
                    Ok(ev) => ev,
                    Err(_) => return Next::End,
                }
            } else if let Some(sleep) = self.throttle_sleep() {
                match self.inbox.events.recv_timeout(sleep) {
                    Ok(ev) => ev,
                    Err(RecvTimeoutError::Timeout) => {
                        self.window = Instant::now();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return Next::End,
                }
            } else {
                match self.inbox.events.try_recv() {
                    Ok(ev) => ev,
                    Err(TryRecvError::Empty) => return Next::Run,
                    Err(TryRecvError::Disconnected) => return Next::End,
                }
            };
            if let Next::End = self.serve(v, ev) {
                return Next::End;
            }
        }
    }

    /// How long to sleep now, if the throttle's running slice is used up.
    fn throttle_sleep(&self) -> Option<Duration> {
        if self.throttle == 0 {
            return None;
        }
        let p = u32::from(self.throttle.min(MAX_THROTTLE));
        (self.window.elapsed() >= THROTTLE_SLICE).then(|| THROTTLE_SLICE * p / (100 - p))
    }

    /// The thread's body: `None` when it was told to finish.
    fn run(&mut self, v: &mut Vcpu) -> Option<VmExit> {
        let id = usize::from(v.id);
        loop {
            // A kick sets immediate_exit; it is cleared before the events
            // it was sent for are read, so no kick is ever lost.
            v.fd.set_kvm_immediate_exit(0);
            if let Next::End = self.clean_point(v) {
                return None;
            }
            v.profiler.on_vcpu_exit(id, &v.fd, &v.mem);
            self.ran = true;
            if let Some(why) = v.run_once() {
                return Some(why);
            }
        }
    }
}

impl Vcpu {
    /// One `KVM_RUN` and the handling of its exit; `Some` when the VM ends.
    fn run_once(&mut self) -> Option<VmExit> {
        let exits = &self.exits;
        match self.fd.run() {
            Ok(VcpuExit::IoIn(port, data)) => {
                exits.count_port(Kind::IoIn, port);
                if !self.pio.read(u64::from(port), data) {
                    data.fill(0xff);
                }
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                exits.count_port(Kind::IoOut, port);
                self.pio.write(u64::from(port), data);
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                exits.count(Kind::MmioRead);
                if !self.mmio.read(addr, data) {
                    log::debug!("vcpu{}: read of unclaimed MMIO {addr:#x}", self.id);
                    data.fill(0xff);
                }
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                exits.count(Kind::MmioWrite);
                if !self.mmio.write(addr, data) {
                    log::debug!("vcpu{}: write to unclaimed MMIO {addr:#x}", self.id);
                }
            }
            Ok(VcpuExit::Hlt) | Ok(VcpuExit::Intr) | Ok(VcpuExit::IrqWindowOpen) => {
                exits.count(Kind::Other);
            }
            Ok(VcpuExit::Shutdown) => {
                log::info!("vcpu{}: guest triple fault or shutdown: reset", self.id);
                return Some(VmExit::Reboot);
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                return Some(match kind {
                    KVM_SYSTEM_EVENT_SHUTDOWN => VmExit::PowerOff,
                    KVM_SYSTEM_EVENT_RESET => VmExit::Reboot,
                    other => VmExit::Fatal(format!(
                        "vCPU {}: unexpected system event {other}",
                        self.id
                    )),
                })
            }
            Ok(VcpuExit::InternalError) => {
                exits.count(Kind::InternalError);
                let rom = self.rom.as_deref();
                if let Err(e) = host_emu::internal_error(self.host, &mut self.fd, &self.mem, rom) {
                    return Some(VmExit::Fatal(format!("vCPU {}: {e}", self.id)));
                }
            }
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                return Some(VmExit::Fatal(format!(
                    "vCPU {}: KVM could not enter the guest (hardware reason {reason:#x} on host CPU {cpu})",
                    self.id
                )))
            }
            Ok(other) => {
                return Some(VmExit::Fatal(format!(
                    "vCPU {}: unexpected exit from KVM: {other:?}",
                    self.id
                )))
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                exits.count(Kind::Interrupted);
            }
            Err(e) => return Some(VmExit::Fatal(format!("vCPU {}: KVM_RUN failed: {e}", self.id))),
        }
        None
    }
}

/// How other threads drive one vCPU thread.
pub struct VcpuHandle {
    pub id: u8,
    events: Sender<VcpuEvent>,
    replies: Receiver<VcpuReply>,
    kick: Arc<ThreadKick>,
    thread: Option<JoinHandle<()>>,
    /// Set by the thread just before it ends.
    done: Arc<AtomicBool>,
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        // A handle dropped without finish(): the thread goes on until the
        // process ends (its channel closes, so it ends at its next clean
        // point), never joined here, so a drop never blocks.
        let _ = self.thread.take();
    }
}

impl VcpuHandle {
    /// Sends `ev` and kicks the thread out of `KVM_RUN`.
    pub fn send(&self, ev: VcpuEvent) -> Result<(), VcpuError> {
        self.events.send(ev).map_err(|_| VcpuError::Gone(self.id))?;
        self.kick.kick();
        Ok(())
    }

    /// Drops answers nobody waited for (a request that timed out before).
    pub fn drain_answers(&self) {
        while self.replies.try_recv().is_ok() {}
    }

    /// The next answer, waiting at most `timeout`.
    pub fn answer(&self, what: &'static str, timeout: Duration) -> Result<VcpuReply, VcpuError> {
        self.replies.recv_timeout(timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => VcpuError::Timeout {
                id: self.id,
                what,
                secs: timeout.as_secs(),
            },
            RecvTimeoutError::Disconnected => VcpuError::Gone(self.id),
        })
    }

    /// Whether the thread has ended.
    pub fn ended(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }

    /// The thread's kick, for the profiler's sampler.
    pub fn kick(&self) -> Arc<ThreadKick> {
        self.kick.clone()
    }

    /// Tells the thread to end and joins it, waiting at most `timeout` (a
    /// thread stuck in a device is left behind; the process exit ends it).
    pub fn finish(mut self, timeout: Duration) {
        let _ = self.send(VcpuEvent::Finish);
        let start = Instant::now();
        while !self.ended() && start.elapsed() < timeout {
            std::thread::sleep(Duration::from_millis(5));
            if !self.ended() {
                self.kick.kick();
            }
        }
        match self.thread.take() {
            Some(t) if self.ended() => {
                let _ = t.join();
            }
            _ => log::warn!("vCPU {} did not end in {timeout:?}", self.id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_shares_are_bounded() {
        let inbox = Inbox {
            events: mpsc::channel().1,
            replies: mpsc::channel().0,
        };
        let mut t = VcpuThread::new(&inbox);
        t.paused = false;
        assert_eq!(t.throttle_sleep(), None, "not throttled");
        t.throttle = 50;
        t.window = Instant::now() - THROTTLE_SLICE;
        assert_eq!(t.throttle_sleep(), Some(THROTTLE_SLICE));
        t.window = Instant::now();
        assert_eq!(t.throttle_sleep(), None, "still in the running slice");
        t.throttle = 75;
        t.window = Instant::now() - THROTTLE_SLICE;
        assert_eq!(t.throttle_sleep(), Some(THROTTLE_SLICE * 3));
        t.throttle = MAX_THROTTLE;
        assert_eq!(t.throttle_sleep(), Some(THROTTLE_SLICE * 99));
    }
}

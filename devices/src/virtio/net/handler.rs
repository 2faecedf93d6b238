//! virtio-net's event-loop glue (VMM thread): queue notifications, backend
//! readiness, the RSC drain timer, flow control, and the swap of the
//! backend of a running device.
//!
//! - TX: chains go to the backend until it would block; then the chain
//!   stays in the queue, the backend's TX descriptor is watched for
//!   EPOLLOUT, and TX resumes there.
//! - RX ([`RxPump`]): frames read from the backend (through the RSC engine
//!   when RSC is on) go to the guest until it has no buffers; then what is
//!   ready is held, the backend is no longer read (EPOLLIN interest
//!   dropped), and RX resumes when the guest posts buffers (RX queue
//!   notification). The backend is not read while the device is reset
//!   either; activation resumes it.
//! - RSC drain timer (RSC on only): a timerfd armed for the engine's next
//!   deadline after every RX run; when it fires, expired packets are
//!   flushed and delivered. It is re-armed only when the deadline moves
//!   (about once per coalesced packet, not per segment).
//! - Backend swap ([`NetHandler::replace_backend`], from any thread; COLO's
//!   failover): done on this thread at its next turn, between two runs, so
//!   no frame is half sent: the old backend's descriptors are dropped from
//!   the loop, the new one gets the running driver's offloads and the same
//!   interest, and the old one is handed back. Frames already read and
//!   held for the guest are still delivered.
//!
//! Runtime events are registered only once the driver activates the device.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use virtio_queue::QueueT;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use super::backend::{fd_watches, FdWatch, NetBackend, Watch, VNET_HDR_LEN};
use super::device::{tap_offloads, NetState};
use super::metrics::NetMetrics;
use super::rsc::{RscConfig, RscCounters};
use super::rx_pump::{Guest, RxPump};
use super::tx::{self, MAX_TX_FRAME};
use crate::virtio::drain::{drain, Served};
use crate::virtio::mmio::Interrupt;

const ACTIVATE: u32 = 0;
/// The virtqueue indices of receive and transmit.
const RX_VQ: usize = 0;
const TX_VQ: usize = 1;
const RX_QUEUE: u32 = 1;
const TX_QUEUE: u32 = 2;
const BACKEND: u32 = 3;
const RSC_TIMER: u32 = 4;
const SWAP: u32 = 5;

/// Handler errors.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    #[error("cannot create the RSC drain timer: {0}")]
    Timer(#[source] io::Error),
    #[error("cannot create the backend swap eventfd: {0}")]
    SwapEvent(#[source] io::Error),
}

/// A backend that was not put in, handed back with the reason.
#[derive(thiserror::Error)]
#[error("network backend {} not put in: {source}", .backend.name())]
pub struct SwapError {
    pub backend: Box<dyn NetBackend>,
    pub source: io::Error,
}

impl fmt::Debug for SwapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SwapError")
            .field("backend", &self.backend.name())
            .field("source", &self.source)
            .finish()
    }
}

/// The end of a swap: the backend taken out, or the new one refused.
pub type Swapped = Result<Box<dyn NetBackend>, SwapError>;

/// A swap asked for and not yet done.
struct Pending {
    backend: Box<dyn NetBackend>,
    reply: mpsc::Sender<Swapped>,
}

/// The handler of one device.
pub struct NetHandler {
    state: Arc<Mutex<NetState>>,
    /// The backend's name and descriptors (only this handler replaces it).
    name: String,
    fds: (RawFd, RawFd),
    activate_evt: EventFd,
    rx_evt: EventFd,
    tx_evt: EventFd,
    swap_evt: EventFd,
    pending: Vec<Pending>,
    interrupt: Arc<Interrupt>,
    metrics: Arc<NetMetrics>,
    registered: bool,
    pump: RxPump,
    /// The RSC drain timer (non-blocking), with RSC on.
    timer: Option<TimerFd>,
    /// The deadline the timer is armed for.
    armed: Option<Instant>,
    tx_buf: Vec<u8>,
    /// What the event loop watches on the backend.
    watch: Watch,
}

impl NetHandler {
    /// A handler for the device whose shared parts these are (its backend
    /// is in `state`); with `rsc`, received frames go through an RSC engine
    /// (reconfigured at each activation for the features the driver acked).
    pub fn new(
        state: Arc<Mutex<NetState>>,
        activate_evt: EventFd,
        queue_evts: [EventFd; 2],
        interrupt: Arc<Interrupt>,
        metrics: Arc<NetMetrics>,
        rsc: Option<RscConfig>,
    ) -> Result<Self, HandlerError> {
        let [rx_evt, tx_evt] = queue_evts;
        let timer = match rsc {
            Some(_) => Some(nonblocking_timer().map_err(HandlerError::Timer)?),
            None => None,
        };
        let swap_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(HandlerError::SwapEvent)?;
        let (name, fds) = {
            let st = crate::sync::lock(&state);
            (
                st.backend.name().to_string(),
                (st.backend.rx_fd(), st.backend.tx_fd()),
            )
        };
        Ok(NetHandler {
            state,
            name,
            fds,
            activate_evt,
            rx_evt,
            tx_evt,
            swap_evt,
            pending: Vec::new(),
            interrupt,
            metrics,
            registered: false,
            pump: RxPump::new(rsc),
            timer,
            armed: None,
            tx_buf: Vec::with_capacity(MAX_TX_FRAME),
            watch: Watch::NONE,
        })
    }

    /// Sends a self-announce (a RARP request from `mac`) out of the
    /// backend, from any thread: what a migrated guest's NIC does from its
    /// new place. A backend that cannot take it now is not waited for.
    pub fn announce(&self, mac: [u8; 6]) -> io::Result<usize> {
        let frame = super::announce::rarp_frame(mac);
        crate::sync::lock(&self.state).backend.write_frame(&frame)
    }

    /// Puts `backend` in place of the device's backend, at the handler's
    /// next turn on the event loop (the device may be running: COLO's
    /// failover). The receiver gets the backend taken out once it is done,
    /// or `backend` back if it refused the running driver's offloads (the
    /// old one then stays). Swaps asked for in a row are done in order.
    /// The handler's lock must not be held while waiting for the answer:
    /// the event loop takes it to do the swap.
    pub fn replace_backend(
        &mut self,
        backend: Box<dyn NetBackend>,
    ) -> Result<mpsc::Receiver<Swapped>, SwapError> {
        if let Err(source) = self.swap_evt.write(1) {
            return Err(SwapError { backend, source });
        }
        let (reply, done) = mpsc::channel();
        self.pending.push(Pending { backend, reply });
        Ok(done)
    }

    /// Does the swaps asked for (on the event loop), then runs both
    /// directions on the backend now in place, which watches it as they
    /// need (RX readable unless the guest has no buffers, TX writable if a
    /// frame waits).
    fn swap(&mut self, ops: &mut EventOps) {
        for Pending { backend, reply } in std::mem::take(&mut self.pending) {
            // Nobody waiting for the answer is no reason not to swap.
            let _ = reply.send(self.swap_one(ops, backend));
        }
        if self.registered {
            self.run_tx(ops);
            self.run_rx(ops);
        }
    }

    fn swap_one(&mut self, ops: &mut EventOps, mut backend: Box<dyn NetBackend>) -> Swapped {
        let shared = self.state.clone();
        let mut state = crate::sync::lock(&shared);
        if let Some(active) = state.active.as_ref() {
            if let Err(source) = backend.set_offload(tap_offloads(active.acked)) {
                return Err(SwapError { backend, source });
            }
        }
        let watched = self.watch;
        self.set_watch(ops, Watch::NONE);
        if self.watch != Watch::NONE {
            // The old descriptors could not all be dropped from the loop:
            // keep the old backend, watched as before.
            self.set_watch(ops, watched);
            return Err(SwapError {
                backend,
                source: io::Error::other("the event loop kept the old backend's descriptors"),
            });
        }
        let old = std::mem::replace(&mut state.backend, backend);
        log::info!(
            "virtio-net {}: backend {} put in",
            self.name,
            state.backend.name()
        );
        self.name = state.backend.name().to_string();
        self.fds = (state.backend.rx_fd(), state.backend.tx_fd());
        // The new backend is watched from the runs that follow.
        Ok(old)
    }

    /// Asks the event loop for `want` on the backend's descriptors.
    fn set_watch(&mut self, ops: &mut EventOps, want: Watch) {
        let (rx_fd, tx_fd) = self.fds;
        let before = fd_watches(rx_fd, tx_fd, self.watch);
        let after = fd_watches(rx_fd, tx_fd, want);
        for (old, new) in before.iter().zip(&after) {
            let (was, set) = (event_set(old), event_set(new));
            if was == set {
                continue;
            }
            let r = if was.is_empty() {
                ops.add(Events::with_data_raw(new.fd, BACKEND, set))
            } else if set.is_empty() {
                ops.remove(Events::with_data_raw(old.fd, BACKEND, was))
            } else {
                ops.modify(Events::with_data_raw(new.fd, BACKEND, set))
            };
            if let Err(e) = r {
                log::error!("virtio-net {}: cannot watch the backend: {e:?}", self.name);
                continue;
            }
            if new.fd == rx_fd {
                self.watch.rx = want.rx;
            }
            if new.fd == tx_fd {
                self.watch.tx = want.tx;
            }
        }
    }

    fn register_runtime(&mut self, ops: &mut EventOps) {
        if self.registered {
            return;
        }
        let regs = [
            ops.add(Events::with_data(&self.rx_evt, RX_QUEUE, EventSet::IN)),
            ops.add(Events::with_data(&self.tx_evt, TX_QUEUE, EventSet::IN)),
        ];
        let timer = self.timer.as_ref().map(|t| {
            ops.add(Events::with_data_raw(
                t.as_raw_fd(),
                RSC_TIMER,
                EventSet::IN,
            ))
        });
        for r in regs.into_iter().chain(timer) {
            if let Err(e) = r {
                log::error!("virtio-net {}: cannot register events: {e:?}", self.name);
            }
        }
        self.set_watch(
            ops,
            Watch {
                rx: true,
                tx: false,
            },
        );
        self.registered = true;
    }

    /// Sends what the guest queued. Returns whether the backend filled up.
    fn process_tx(&mut self) -> bool {
        let mut state = crate::sync::lock(&self.state);
        let NetState { active, backend } = &mut *state;
        let Some(active) = active.as_mut() else {
            return false;
        };
        let (buf, metrics, name) = (&mut self.tx_buf, &*self.metrics, &self.name);
        let mem = &active.mem;
        let r = drain(&mut active.tx, mem, |chain| {
            match tx::gather(chain, mem, buf) {
                Ok(()) => match backend.write_frame(buf) {
                    Ok(_) => {
                        NetMetrics::add(&metrics.tx_packets, 1);
                        NetMetrics::add(&metrics.tx_bytes, (buf.len() - VNET_HDR_LEN) as u64);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        // Leave the chain in the queue; resume on EPOLLOUT.
                        NetMetrics::add(&metrics.tap_full_waits, 1);
                        return Served::PutBack;
                    }
                    Err(e) => {
                        log::debug!("virtio-net {name}: backend write: {e}");
                        NetMetrics::add(&metrics.drops, 1);
                    }
                },
                Err(e) => {
                    log::debug!("virtio-net {name}: bad TX chain: {e}");
                    NetMetrics::add(&metrics.malformed_chains, 1);
                }
            }
            Served::Used(0)
        });
        NetMetrics::add(&metrics.malformed_chains, r.faults);
        if r.notify {
            self.interrupt.trigger_queue(TX_VQ);
        }
        r.put_back
    }

    /// Moves frames from the backend to the guest. Returns whether to stop
    /// reading the backend: the guest has no buffers, or the device is reset.
    fn process_rx(&mut self) -> bool {
        let mut state = crate::sync::lock(&self.state);
        let NetState { active, backend } = &mut *state;
        let Some(active) = active.as_mut() else {
            // Reset: read again when the driver activates the device.
            return true;
        };
        if backend.drop_held() {
            let n = self.pump.drop_held();
            log::debug!("virtio-net {}: {n} held frames taken back", self.name);
        }
        let mut guest = Guest {
            queue: &mut active.rx,
            mem: &active.mem,
            mergeable: active.mergeable,
        };
        let res = self.pump.pump(
            &mut guest,
            |buf| backend.read_frame(buf),
            Instant::now,
            &self.metrics,
        );
        backend.held_by_device(self.pump.undelivered());
        if res.used && active.rx.needs_notification(&active.mem).unwrap_or(true) {
            self.interrupt.trigger_queue(RX_VQ);
        }
        res.starved
    }

    /// Arms the drain timer for the engine's next deadline, if it moved.
    fn arm_timer(&mut self) {
        let Some(timer) = self.timer.as_mut() else {
            return;
        };
        let Some(deadline) = self.pump.next_deadline() else {
            // A timer still armed for a flushed packet fires for nothing.
            return;
        };
        if self.armed == Some(deadline) {
            return;
        }
        // A zero duration would disarm the timer: a deadline already past
        // fires in 1 ns.
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_nanos(1));
        match timer.reset(wait, None) {
            Ok(()) => self.armed = Some(deadline),
            Err(e) => log::error!("virtio-net {}: RSC timer: {e}", self.name),
        }
    }

    /// The drain timer fired: expired packets go to the guest.
    fn run_timer(&mut self, ops: &mut EventOps) {
        if let Some(timer) = self.timer.as_mut() {
            // Non-blocking: re-arming may have cleared the expiration.
            let _ = timer.wait();
        }
        self.armed = None;
        self.pump.expire(Instant::now());
        self.run_rx(ops);
    }

    /// The driver (re)started the device: rebuild the receive path for its
    /// features.
    fn activate(&mut self) {
        let (acked, rsc) = match crate::sync::lock(&self.state).active.as_ref() {
            Some(a) => (a.acked, a.rsc.clone()),
            None => return,
        };
        let discarded = self.pump.activate(acked, rsc);
        if discarded > 0 {
            log::info!(
                "virtio-net {}: {discarded} received frames held for the previous driver \
                 discarded (features changed)",
                self.name
            );
            NetMetrics::add(&self.metrics.drops, discarded as u64);
        }
    }

    /// The RSC engine's counters, when RSC is on.
    pub fn rsc_counters(&self) -> Option<RscCounters> {
        self.pump.rsc_counters().cloned()
    }

    fn run_rx(&mut self, ops: &mut EventOps) {
        let starved = self.process_rx();
        self.arm_timer();
        let want = Watch {
            rx: !starved,
            tx: self.watch.tx,
        };
        self.set_watch(ops, want);
    }

    fn run_tx(&mut self, ops: &mut EventOps) {
        let blocked = self.process_tx();
        let want = Watch {
            rx: self.watch.rx,
            tx: blocked,
        };
        self.set_watch(ops, want);
    }
}

impl MutEventSubscriber for NetHandler {
    fn init(&mut self, ops: &mut EventOps) {
        let regs = [
            ops.add(Events::with_data(
                &self.activate_evt,
                ACTIVATE,
                EventSet::IN,
            )),
            ops.add(Events::with_data(&self.swap_evt, SWAP, EventSet::IN)),
        ];
        for r in regs {
            if let Err(e) = r {
                log::error!("virtio-net {}: cannot register: {e:?}", self.name);
            }
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            ACTIVATE => {
                let _ = self.activate_evt.read();
                self.register_runtime(ops);
                self.activate();
                self.run_tx(ops);
                self.run_rx(ops);
            }
            RX_QUEUE => {
                let _ = self.rx_evt.read();
                self.run_rx(ops);
            }
            TX_QUEUE => {
                let _ = self.tx_evt.read();
                self.run_tx(ops);
            }
            RSC_TIMER => self.run_timer(ops),
            SWAP => {
                let _ = self.swap_evt.read();
                self.swap(ops);
            }
            BACKEND => {
                if events.event_set().contains(EventSet::OUT) {
                    self.run_tx(ops);
                }
                if events
                    .event_set()
                    .intersects(EventSet::IN | EventSet::HANG_UP | EventSet::ERROR)
                {
                    self.run_rx(ops);
                }
            }
            _ => {}
        }
    }
}

/// The readiness `epoll` is asked for on one descriptor.
fn event_set(w: &FdWatch) -> EventSet {
    let mut set = EventSet::empty();
    if w.readable {
        set |= EventSet::IN;
    }
    if w.writable {
        set |= EventSet::OUT;
    }
    set
}

/// A timerfd that never blocks on read: the timer may be re-armed (which
/// clears its expiration count) between epoll reporting it and the read.
fn nonblocking_timer() -> io::Result<TimerFd> {
    let timer = TimerFd::new()?;
    let fd = timer.as_raw_fd();
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(timer)
}

#[cfg(test)]
#[path = "handler_tests.rs"]
mod tests;

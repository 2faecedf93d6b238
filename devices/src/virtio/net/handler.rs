//! virtio-net's event-loop glue (VMM thread): queue notifications, tap
//! readiness, the RSC drain timer, flow control.
//!
//! - TX: chains go to the tap until it would block; then the chain stays in
//!   the queue, the tap is watched for EPOLLOUT, and TX resumes there.
//! - RX ([`RxPump`]): frames read from the tap (through the RSC engine when
//!   RSC is on) go to the guest until it has no buffers; then what is ready
//!   is held, the tap is no longer read (EPOLLIN interest dropped), and RX
//!   resumes when the guest posts buffers (RX queue notification). The tap
//!   is not read while the device is reset either; activation resumes it.
//! - RSC drain timer (RSC on only): a timerfd armed for the engine's next
//!   deadline after every RX run; when it fires, expired packets are
//!   flushed and delivered. It is re-armed only when the deadline moves
//!   (about once per coalesced packet, not per segment).
//!
//! Runtime events are registered only once the driver activates the device.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use virtio_queue::QueueT;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use super::device::NetState;
use super::metrics::NetMetrics;
use super::rsc::{RscConfig, RscCounters};
use super::rx_pump::{Guest, RxPump};
use super::tap::{Tap, VNET_HDR_LEN};
use super::tx::{self, MAX_TX_FRAME};
use crate::virtio::drain::{drain, Served};
use crate::virtio::mmio::Interrupt;
use crate::virtio::INT_USED_RING;

const ACTIVATE: u32 = 0;
const RX_QUEUE: u32 = 1;
const TX_QUEUE: u32 = 2;
const TAP: u32 = 3;
const RSC_TIMER: u32 = 4;

/// Handler errors.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    #[error("cannot create the RSC drain timer: {0}")]
    Timer(io::Error),
}

/// The handler of one device.
pub struct NetHandler {
    state: Arc<Mutex<NetState>>,
    tap: Arc<Tap>,
    activate_evt: EventFd,
    rx_evt: EventFd,
    tx_evt: EventFd,
    interrupt: Arc<Interrupt>,
    metrics: Arc<NetMetrics>,
    registered: bool,
    pump: RxPump,
    /// The RSC drain timer (non-blocking), with RSC on.
    timer: Option<TimerFd>,
    /// The deadline the timer is armed for.
    armed: Option<Instant>,
    tx_buf: Vec<u8>,
    tap_interest: EventSet,
}

impl NetHandler {
    /// A handler for the device whose shared parts these are; with `rsc`,
    /// received frames go through an RSC engine (reconfigured at each
    /// activation for the features the driver acked).
    pub fn new(
        state: Arc<Mutex<NetState>>,
        tap: Arc<Tap>,
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
        Ok(NetHandler {
            state,
            tap,
            activate_evt,
            rx_evt,
            tx_evt,
            interrupt,
            metrics,
            registered: false,
            pump: RxPump::new(rsc),
            timer,
            armed: None,
            tx_buf: Vec::with_capacity(MAX_TX_FRAME),
            tap_interest: EventSet::IN,
        })
    }

    fn set_tap_interest(&mut self, ops: &mut EventOps, set: EventSet) {
        if set == self.tap_interest {
            return;
        }
        let ev = Events::with_data_raw(self.tap.fd(), TAP, set);
        let r = if self.tap_interest.is_empty() {
            ops.add(ev)
        } else if set.is_empty() {
            ops.remove(Events::with_data_raw(self.tap.fd(), TAP, self.tap_interest))
        } else {
            ops.modify(ev)
        };
        if let Err(e) = r {
            log::error!(
                "virtio-net {}: cannot watch the tap: {e:?}",
                self.tap.name()
            );
            return;
        }
        self.tap_interest = set;
    }

    fn register_runtime(&mut self, ops: &mut EventOps) {
        if self.registered {
            return;
        }
        let regs = [
            ops.add(Events::with_data(&self.rx_evt, RX_QUEUE, EventSet::IN)),
            ops.add(Events::with_data(&self.tx_evt, TX_QUEUE, EventSet::IN)),
            ops.add(Events::with_data_raw(self.tap.fd(), TAP, EventSet::IN)),
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
                log::error!(
                    "virtio-net {}: cannot register events: {e:?}",
                    self.tap.name()
                );
            }
        }
        self.tap_interest = EventSet::IN;
        self.registered = true;
    }

    /// Sends what the guest queued. Returns whether the tap filled up.
    fn process_tx(&mut self) -> bool {
        let mut state = crate::bus::lock(&self.state);
        let Some(active) = state.active.as_mut() else {
            return false;
        };
        let (buf, metrics, tap) = (&mut self.tx_buf, &*self.metrics, &self.tap);
        let mem = &active.mem;
        let r = drain(&mut active.tx, mem, |chain| {
            match tx::gather(chain, mem, buf) {
                Ok(()) => match tap.write_frame(buf) {
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
                        log::debug!("virtio-net {}: tap write: {e}", tap.name());
                        NetMetrics::add(&metrics.drops, 1);
                    }
                },
                Err(e) => {
                    log::debug!("virtio-net {}: bad TX chain: {e}", tap.name());
                    NetMetrics::add(&metrics.malformed_chains, 1);
                }
            }
            Served::Used(0)
        });
        NetMetrics::add(&metrics.malformed_chains, r.faults);
        if r.notify {
            self.interrupt.trigger(INT_USED_RING);
        }
        r.put_back
    }

    /// Moves frames from the tap to the guest. Returns whether to stop
    /// reading the tap: the guest has no buffers, or the device is reset.
    fn process_rx(&mut self) -> bool {
        let mut state = crate::bus::lock(&self.state);
        let Some(active) = state.active.as_mut() else {
            // Reset: read again when the driver activates the device.
            return true;
        };
        let mut guest = Guest {
            queue: &mut active.rx,
            mem: &active.mem,
            mergeable: active.mergeable,
        };
        let tap = &self.tap;
        let res = self.pump.pump(
            &mut guest,
            |buf| tap.read_frame(buf),
            Instant::now,
            &self.metrics,
        );
        if res.used && active.rx.needs_notification(&active.mem).unwrap_or(true) {
            self.interrupt.trigger(INT_USED_RING);
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
            Err(e) => log::error!("virtio-net {}: RSC timer: {e}", self.tap.name()),
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
        let (acked, rsc) = match crate::bus::lock(&self.state).active.as_ref() {
            Some(a) => (a.acked, a.rsc.clone()),
            None => return,
        };
        let discarded = self.pump.activate(acked, rsc);
        if discarded > 0 {
            log::info!(
                "virtio-net {}: {discarded} received frames held for the previous driver \
                 discarded (features changed)",
                self.tap.name()
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
        let want_out = self.tap_interest.contains(EventSet::OUT);
        let mut set = if starved {
            EventSet::empty()
        } else {
            EventSet::IN
        };
        if want_out {
            set |= EventSet::OUT;
        }
        self.set_tap_interest(ops, set);
    }

    fn run_tx(&mut self, ops: &mut EventOps) {
        let blocked = self.process_tx();
        let mut set = self.tap_interest & EventSet::IN;
        if blocked {
            set |= EventSet::OUT;
        }
        self.set_tap_interest(ops, set);
    }
}

impl MutEventSubscriber for NetHandler {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::with_data(
            &self.activate_evt,
            ACTIVATE,
            EventSet::IN,
        )) {
            log::error!("virtio-net {}: cannot register: {e:?}", self.tap.name());
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
            TAP => {
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

//! virtio-net's event-loop glue (VMM thread): queue notifications, tap
//! readiness, flow control.
//!
//! - TX: chains go to the tap until it would block; then the chain stays in
//!   the queue, the tap is watched for EPOLLOUT, and TX resumes there.
//! - RX: frames go to the guest until it has no buffers; then the frame is
//!   held, the tap is no longer read, and RX resumes when the guest posts
//!   buffers (RX queue notification).
//!
//! Runtime events are registered only once the driver activates the device.

use std::io;
use std::sync::{Arc, Mutex};

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use virtio_queue::{QueueOwnedT, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::device::NetState;
use super::metrics::NetMetrics;
use super::rx::{self, RxOutcome};
use super::tap::{Tap, VNET_HDR_LEN};
use super::tx::{self, MAX_TX_FRAME};
use crate::virtio::mmio::Interrupt;
use crate::virtio::INT_USED_RING;

const ACTIVATE: u32 = 0;
const RX_QUEUE: u32 = 1;
const TX_QUEUE: u32 = 2;
const TAP: u32 = 3;
const MAX_RX_FRAME: usize = VNET_HDR_LEN + 65535 + 18;

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
    /// A frame read from the tap that the guest had no room for yet.
    pending_rx: Option<Vec<u8>>,
    rx_buf: Vec<u8>,
    tx_buf: Vec<u8>,
    tap_interest: EventSet,
}

impl NetHandler {
    /// A handler for the device whose shared parts these are.
    pub fn new(
        state: Arc<Mutex<NetState>>,
        tap: Arc<Tap>,
        activate_evt: EventFd,
        queue_evts: [EventFd; 2],
        interrupt: Arc<Interrupt>,
        metrics: Arc<NetMetrics>,
    ) -> Self {
        let [rx_evt, tx_evt] = queue_evts;
        NetHandler {
            state,
            tap,
            activate_evt,
            rx_evt,
            tx_evt,
            interrupt,
            metrics,
            registered: false,
            pending_rx: None,
            rx_buf: vec![0; MAX_RX_FRAME],
            tx_buf: Vec::with_capacity(MAX_TX_FRAME),
            tap_interest: EventSet::IN,
        }
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
        for r in regs {
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
        let mut blocked = false;
        let mut completed = false;
        let mut popped = true;
        loop {
            let Some(chain) = active.tx.pop_descriptor_chain(&active.mem) else {
                if !popped {
                    // More is "available", yet nothing can be taken: a
                    // hostile available index. Stop until the next notify
                    // instead of spinning on the VMM thread.
                    NetMetrics::add(&self.metrics.malformed_chains, 1);
                    break;
                }
                popped = false;
                // With EVENT_IDX, re-enable notifications and look once more.
                match active.tx.enable_notification(&active.mem) {
                    Ok(true) => continue,
                    _ => break,
                }
            };
            popped = true;
            let head = chain.head_index();
            match tx::gather(chain, &active.mem, &mut self.tx_buf) {
                Ok(()) => match self.tap.write_frame(&self.tx_buf) {
                    Ok(_) => {
                        NetMetrics::add(&self.metrics.tx_packets, 1);
                        NetMetrics::add(
                            &self.metrics.tx_bytes,
                            (self.tx_buf.len() - VNET_HDR_LEN) as u64,
                        );
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        // Leave the chain in the queue; resume on EPOLLOUT.
                        active.tx.go_to_previous_position();
                        NetMetrics::add(&self.metrics.tap_full_waits, 1);
                        blocked = true;
                        break;
                    }
                    Err(e) => {
                        log::debug!("virtio-net {}: tap write: {e}", self.tap.name());
                        NetMetrics::add(&self.metrics.drops, 1);
                    }
                },
                Err(e) => {
                    log::debug!("virtio-net {}: bad TX chain: {e}", self.tap.name());
                    NetMetrics::add(&self.metrics.malformed_chains, 1);
                }
            }
            if active.tx.add_used(&active.mem, head, 0).is_err() {
                NetMetrics::add(&self.metrics.malformed_chains, 1);
            }
            completed = true;
        }
        if completed && active.tx.needs_notification(&active.mem).unwrap_or(true) {
            self.interrupt.trigger(INT_USED_RING);
        }
        blocked
    }

    /// Moves frames from the tap to the guest. Returns whether it stopped
    /// for lack of guest buffers.
    fn process_rx(&mut self) -> bool {
        let mut state = crate::bus::lock(&self.state);
        let Some(active) = state.active.as_mut() else {
            return false;
        };
        let mut starved = false;
        let mut delivered = false;
        loop {
            let mut frame = match self.pending_rx.take() {
                Some(f) => f,
                None => match self.tap.read_frame(&mut self.rx_buf) {
                    Ok(n) if n >= VNET_HDR_LEN => self.rx_buf[..n].to_vec(),
                    Ok(_) => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        log::warn!("virtio-net {}: tap read: {e}", self.tap.name());
                        break;
                    }
                },
            };
            match rx::deliver(&mut active.rx, &active.mem, &mut frame, active.mergeable) {
                Ok(RxOutcome::Delivered(_)) => {
                    NetMetrics::add(&self.metrics.rx_packets, 1);
                    NetMetrics::add(&self.metrics.rx_bytes, (frame.len() - VNET_HDR_LEN) as u64);
                    delivered = true;
                }
                Ok(RxOutcome::NoBuffers) => {
                    // Ask to be told when buffers come, then check once more.
                    if matches!(active.rx.enable_notification(&active.mem), Ok(true)) {
                        self.pending_rx = Some(frame);
                        continue;
                    }
                    NetMetrics::add(&self.metrics.no_rx_buffer_waits, 1);
                    self.pending_rx = Some(frame);
                    starved = true;
                    break;
                }
                Err(e) => {
                    log::debug!("virtio-net {}: bad RX chain: {e}", self.tap.name());
                    NetMetrics::add(&self.metrics.malformed_chains, 1);
                    if e == super::ChainError::BufferTooSmall {
                        NetMetrics::add(&self.metrics.drops, 1);
                    }
                    delivered = true;
                }
            }
        }
        if delivered && active.rx.needs_notification(&active.mem).unwrap_or(true) {
            self.interrupt.trigger(INT_USED_RING);
        }
        starved
    }

    fn run_rx(&mut self, ops: &mut EventOps) {
        let starved = self.process_rx();
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

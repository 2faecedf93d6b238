//! The receive path of one device, from backend reads to the guest's RX queue,
//! through the RSC engine when it is on. Pure logic over a frame source and
//! guest memory (the handler passes the backend's read and the clock), so flow
//! control is unit-tested here without a backend or an event loop.
//!
//! Flow control, with no drop inside the VMM: frames that are ready for the
//! guest (out of the engine, or read from the backend without RSC) wait in a
//! small queue, `held`, until the guest has buffers for them, oldest first.
//! The source is read only when `held` is empty, so `held` never holds more
//! than what one read produced ([`Rsc::input`]: expired packets, the flow's
//! pending packet and the frame itself) plus the engine's pending packets,
//! flushed when the guest runs out of buffers ("flush when the guest buffer
//! is full", design §4) so that nothing waits on the drain timer while the
//! guest cannot take it anyway: at most `2 * MAX_FLOWS + 2` frames. Without
//! RSC, `held` has at most one frame: the path is the one the device had
//! before RSC (read one frame, deliver it, keep it while the guest has no
//! buffers).
//!
//! Never does: read the source while a frame waits for the guest, drop a
//! frame because the guest is slow, panic on a hostile chain.

use std::collections::VecDeque;
use std::io;
use std::time::Instant;

use crate::GuestMemoryMmap;
use virtio_queue::Queue;

use super::backend::VNET_HDR_LEN;
use super::metrics::NetMetrics;
use super::rsc::{Rsc, RscConfig, RscCounters, MAX_FLOWS};
use super::rx::{self, RxOutcome};
use super::ChainError;

/// Looks at the ring again at most this many times in a row when the
/// driver posted buffers while the device asked for them.
const RECHECKS: u32 = 16;

/// Largest frame read from the backend: header, 64 KiB IP packet, Ethernet
/// header and a VLAN tag.
pub const MAX_RX_FRAME: usize = VNET_HDR_LEN + 65535 + 18;
/// Most frames `held` can hold (see the module doc).
pub const MAX_HELD: usize = 2 * MAX_FLOWS + 2;

/// The guest side of one pump run: its RX queue and memory.
pub struct Guest<'a> {
    pub queue: &'a mut Queue,
    pub mem: &'a GuestMemoryMmap,
    pub mergeable: bool,
}

/// How a pump run ended.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pumped {
    /// The guest ran out of buffers: stop reading the source until it posts
    /// more.
    pub starved: bool,
    /// Something was put in the used ring (the guest may need an interrupt).
    pub used: bool,
}

/// The receive path's state.
pub struct RxPump {
    rsc: Option<Rsc>,
    /// Frames ready for the guest, oldest first, each with the number of
    /// frames read from the source that it carries (1 without RSC).
    held: VecDeque<(Vec<u8>, u32)>,
    /// The engine's output of one call.
    out: Vec<Vec<u8>>,
    buf: Vec<u8>,
    /// The features of the last activation.
    acked: Option<u64>,
}

impl RxPump {
    /// A receive path; with `rsc`, frames go through an RSC engine (until
    /// the first activation, with nothing negotiated: every frame passes).
    pub fn new(rsc: Option<RscConfig>) -> Self {
        RxPump {
            rsc: rsc.map(Rsc::new),
            held: VecDeque::new(),
            out: Vec::new(),
            buf: vec![0; MAX_RX_FRAME],
            acked: None,
        }
    }

    /// The driver started the device with features `acked` and, with RSC
    /// on, engine configuration `rsc`. Packets the engine still holds are
    /// flushed first. Frames held for a previous driver are kept when it
    /// negotiated the same features, and discarded otherwise (they may be
    /// GSO frames the new driver cannot take, as a NIC's FIFO is cleared by
    /// a reset): returns how many were discarded.
    pub fn activate(&mut self, acked: u64, rsc: Option<RscConfig>) -> usize {
        match (self.rsc.as_mut(), rsc) {
            (Some(engine), Some(cfg)) => engine.reconfigure(cfg, &mut self.out),
            (None, Some(cfg)) => self.rsc = Some(Rsc::new(cfg)),
            (Some(engine), None) => {
                engine.flush_all(&mut self.out);
                // Taken with the engine's counts before it goes.
                self.take_out();
                self.rsc = None;
            }
            (None, None) => {}
        }
        self.take_out();
        let changed = self.acked.is_some_and(|a| a != acked);
        self.acked = Some(acked);
        if changed {
            let n = self.held.len();
            self.held.clear();
            n
        } else {
            0
        }
    }

    /// Moves frames to the guest: first those held, then frames read with
    /// `read` (one frame per call, `WouldBlock` when there is none) until
    /// the source is empty or the guest has no buffers. `now` is the clock
    /// for the engine.
    pub fn pump(
        &mut self,
        guest: &mut Guest,
        mut read: impl FnMut(&mut [u8]) -> io::Result<usize>,
        now: impl Fn() -> Instant,
        metrics: &NetMetrics,
    ) -> Pumped {
        let mut res = Pumped::default();
        loop {
            if self.deliver_held(guest, metrics, &mut res) {
                res.starved = true;
                return res;
            }
            let n = match read(&mut self.buf) {
                Ok(n) if n >= VNET_HDR_LEN => n.min(self.buf.len()),
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return res,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    log::warn!("virtio-net: backend read: {e}");
                    return res;
                }
            };
            let frame = &self.buf[..n];
            match self.rsc.as_mut() {
                Some(engine) => {
                    engine.input(frame, now(), &mut self.out);
                    self.take_out();
                }
                None => self.held.push_back((frame.to_vec(), 1)),
            }
            NetMetrics::max(&metrics.rx_held_max, self.held.len() as u64);
        }
    }

    /// Delivers held frames, oldest first. Returns whether the guest ran out
    /// of buffers (then the engine is flushed into `held`).
    fn deliver_held(&mut self, guest: &mut Guest, metrics: &NetMetrics, res: &mut Pumped) -> bool {
        // Misses in a row after which buffers had come: past RECHECKS the
        // run ends, so a hostile available index cannot make it spin.
        let mut rechecked = 0;
        while let Some((frame, _)) = self.held.front_mut() {
            match rx::deliver(guest.queue, guest.mem, frame, guest.mergeable) {
                Ok(RxOutcome::Delivered(_)) => {
                    rechecked = 0;
                    NetMetrics::add(&metrics.rx_packets, 1);
                    NetMetrics::add(
                        &metrics.rx_bytes,
                        frame.len().saturating_sub(VNET_HDR_LEN) as u64,
                    );
                }
                Ok(RxOutcome::NoBuffers { seen }) => {
                    // Ask to be told when buffers come; look again if some
                    // came meanwhile.
                    if rx::ask_for_buffers(guest.queue, guest.mem, seen) && rechecked < RECHECKS {
                        rechecked += 1;
                        continue;
                    }
                    NetMetrics::add(&metrics.no_rx_buffer_waits, 1);
                    if let Some(engine) = self.rsc.as_mut() {
                        engine.flush_all(&mut self.out);
                        self.take_out();
                        NetMetrics::max(&metrics.rx_held_max, self.held.len() as u64);
                    }
                    return true;
                }
                Err(e) => {
                    log::debug!("virtio-net: bad RX chain: {e}");
                    NetMetrics::add(&metrics.malformed_chains, 1);
                    if e == ChainError::BufferTooSmall {
                        NetMetrics::add(&metrics.drops, 1);
                    }
                }
            }
            self.held.pop_front();
            res.used = true;
        }
        false
    }

    /// Moves the engine's packets whose deadline passed to the held queue
    /// (the drain timer fired); [`RxPump::pump`] delivers them.
    pub fn expire(&mut self, now: Instant) {
        if let Some(engine) = self.rsc.as_mut() {
            engine.drain_expired(now, &mut self.out);
            self.take_out();
        }
    }

    /// Moves the engine's output to `held`, each frame with the inputs it
    /// carries.
    fn take_out(&mut self) {
        match self.rsc.as_mut() {
            Some(engine) => {
                let inputs = engine.take_inputs().chain(std::iter::repeat(1));
                self.held.extend(self.out.drain(..).zip(inputs));
            }
            None => self.held.extend(self.out.drain(..).map(|f| (f, 1))),
        }
    }

    /// Drops every frame held for the guest and the engine's pending
    /// packets (their sender took them back); returns how many frames read
    /// from the source that was.
    pub fn drop_held(&mut self) -> u64 {
        let n = self.undelivered();
        self.held.clear();
        if let Some(engine) = self.rsc.as_mut() {
            engine.discard();
        }
        n
    }

    /// Frames read from the source that the guest does not have yet: those
    /// held and those in the engine's pending packets. A frame dropped
    /// (a bad chain, a driver change) is not counted: the guest will not
    /// get it.
    pub fn undelivered(&self) -> u64 {
        let held: u64 = self.held.iter().map(|(_, n)| u64::from(*n)).sum();
        held + self.rsc.as_ref().map_or(0, Rsc::pending_inputs)
    }

    /// When [`RxPump::expire`] next has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.rsc.as_ref().and_then(Rsc::next_deadline)
    }

    /// The engine's counters, with RSC on.
    pub fn rsc_counters(&self) -> Option<&RscCounters> {
        self.rsc.as_ref().map(Rsc::counters)
    }

    /// Frames waiting for the guest.
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
#[path = "rx_pump_tests.rs"]
mod tests;

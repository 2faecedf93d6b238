//! Save and restore of what every virtio transport keeps ([`Transport`]):
//! its registers, the interrupt status and its queues.
//!
//! While the device runs, the transport's own queues only hold what the
//! driver programmed (sizes, addresses); where the device has got to in each
//! ring lives in the device's copies, so a save asks the device for them
//! ([`VirtioDevice::queue_states`]).
//!
//! A restore is applied to a transport freshly built for the same device
//! (before any vCPU runs). The state came from a file, so
//! [`Transport::check_state`] checks all of it first, and a restore
//! applies nothing unless it passes. It accepts exactly the states register
//! writes can produce (the rules in [`super::lifecycle`]): DEVICE_NEEDS_RESET
//! and FAILED ones too, and queues a driver programmed for a device that
//! never started, wherever they point. Only a running device's ready queues
//! must lie inside guest memory. A running state restarts the device with
//! its queues where they were, as the driver's DRIVER_OK did; any other
//! leaves it stopped. An interrupt the driver had not acknowledged is
//! raised again.
//!
//! [`VirtioDevice::queue_states`]: crate::virtio::VirtioDevice::queue_states

use migration::devices::{MmioTransportState, QueueState};
use migration::Snapshottable;
use virtio_queue::Queue;

use super::lifecycle;
use super::Transport;
use crate::virtio::{status, ActivateError, INT_CONFIG, INT_USED_RING, VIRTIO_RING_F_EVENT_IDX};

/// Why a saved transport state cannot be applied.
#[derive(Debug, thiserror::Error)]
pub enum TransportStateError {
    #[error("{saved} queues saved, the device has {device}")]
    QueueCount { saved: usize, device: usize },
    #[error("queue {index}: saved for {saved} entries at most, the device offers {device}")]
    QueueMax {
        index: usize,
        saved: u16,
        device: u16,
    },
    #[error("queue {index}: {source}")]
    Queue {
        index: usize,
        source: virtio_queue::Error,
    },
    #[error("queue {index} is not inside guest memory")]
    QueueOutside { index: usize },
    #[error("queue {index} is set up, but the driver never set FEATURES_OK")]
    QueueBeforeFeatures { index: usize },
    #[error("queue {index} has ring positions or event index, but the device is not running")]
    QueueRingStopped { index: usize },
    #[error("queue {index}: event index {saved}, but the features say {negotiated}")]
    QueueEventIdx {
        index: usize,
        saved: bool,
        negotiated: bool,
    },
    #[error("status {status:#x} is not one a driver can reach: {why}")]
    Status { status: u32, why: &'static str },
    #[error("the driver accepted features {extra:#x} that this device does not offer")]
    Features { extra: u64 },
    #[error("FEATURES_OK without VERSION_1 in the accepted features")]
    NoVersion1,
    #[error("interrupt status {0:#x} has bits no device raises")]
    Interrupt(u32),
    #[error("its virtio-pci state: {0}")]
    Pci(String),
    #[error("the device cannot restart: {0}")]
    Activate(#[source] ActivateError),
}

/// A state that passed the checks, ready to apply.
struct Checked {
    /// The transport's queues: as the driver programmed them.
    regs: Vec<Queue>,
    /// The device's queues, with their ring positions, if it runs.
    live: Option<Vec<Queue>>,
}

/// A queue of at most `max_size` entries as a fresh or reset transport
/// holds it (what the driver finds before it programs the queue).
fn reset_queue(max_size: u16) -> virtio_queue::QueueState {
    virtio_queue::QueueState {
        max_size,
        size: max_size,
        ..Default::default()
    }
}

impl Transport {
    /// Checks `s` completely against this device and its guest memory (the
    /// memory's layout; its contents do not matter), applying nothing: the
    /// check [`Snapshottable::restore`] makes first, for a VMM that checks
    /// every device before it fills guest memory from a snapshot. It does
    /// not look at this transport's own registers.
    pub fn check_state(&self, s: &MmioTransportState) -> Result<(), TransportStateError> {
        self.checked(s).map(drop)
    }

    fn checked(&self, s: &MmioTransportState) -> Result<Checked, TransportStateError> {
        if let Some(why) = lifecycle::unreachable(s.status) {
            return Err(TransportStateError::Status {
                status: s.status,
                why,
            });
        }
        let raised = s.interrupt_status & !(INT_USED_RING | INT_CONFIG);
        if raised != 0 {
            return Err(TransportStateError::Interrupt(raised));
        }
        if s.status & status::FEATURES_OK != 0 && !self.features_acceptable(s.acked_features) {
            let extra = s.acked_features & !self.offered();
            return Err(match extra {
                0 => TransportStateError::NoVersion1,
                _ => TransportStateError::Features { extra },
            });
        }
        let device = self.device.queue_max_sizes();
        if s.queues.len() != device.len() {
            return Err(TransportStateError::QueueCount {
                saved: s.queues.len(),
                device: device.len(),
            });
        }
        let live = lifecycle::is_live(s.status);
        let mut regs = Vec::with_capacity(device.len());
        let mut running = Vec::with_capacity(device.len());
        for (index, (q, &max)) in s.queues.iter().zip(device).enumerate() {
            let (reg, dev) = self.check_queue(s, index, q, max)?;
            regs.push(reg);
            running.push(dev);
        }
        if live {
            if let Some(index) = self.invalid_queue(&running) {
                return Err(TransportStateError::QueueOutside { index });
            }
        }
        Ok(Checked {
            regs,
            live: live.then_some(running),
        })
    }

    /// Checks saved queue `index` (of at most `max` entries) in state `s`;
    /// returns it for the transport's registers and for the device.
    fn check_queue(
        &self,
        s: &MmioTransportState,
        index: usize,
        q: &QueueState,
        max: u16,
    ) -> Result<(Queue, Queue), TransportStateError> {
        if q.max_size != max {
            return Err(TransportStateError::QueueMax {
                index,
                saved: q.max_size,
                device: max,
            });
        }
        let state = virtio_queue::QueueState::from(q);
        if s.status & status::FEATURES_OK == 0 && state != reset_queue(max) {
            return Err(TransportStateError::QueueBeforeFeatures { index });
        }
        let moved = state.next_avail != 0 || state.next_used != 0;
        if lifecycle::is_live(s.status) {
            let negotiated = s.acked_features & VIRTIO_RING_F_EVENT_IDX != 0;
            if state.event_idx_enabled != negotiated {
                return Err(TransportStateError::QueueEventIdx {
                    index,
                    saved: state.event_idx_enabled,
                    negotiated,
                });
            }
        } else if moved || state.event_idx_enabled {
            return Err(TransportStateError::QueueRingStopped { index });
        }
        let build = |state| {
            Queue::try_from(state).map_err(|source| TransportStateError::Queue { index, source })
        };
        let reg = build(virtio_queue::QueueState {
            next_avail: 0,
            next_used: 0,
            event_idx_enabled: false,
            ..state
        })?;
        Ok((reg, build(state)?))
    }
}

impl Snapshottable for Transport {
    type State = MmioTransportState;
    type Error = TransportStateError;

    fn save(&self) -> Result<MmioTransportState, TransportStateError> {
        let live = if lifecycle::is_live(self.status) {
            self.device.queue_states()
        } else {
            None
        };
        let queues = self
            .queues
            .iter()
            .enumerate()
            .map(|(i, q)| {
                let s = live
                    .as_ref()
                    .and_then(|l| l.get(i).copied())
                    .unwrap_or_else(|| q.state());
                QueueState::from(&s)
            })
            .collect();
        Ok(MmioTransportState {
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            acked_features: self.acked_features,
            queue_sel: self.queue_sel,
            interrupt_status: self.interrupt.status(),
            config_generation: self.config_generation,
            queues,
        })
    }

    /// Checks `s` ([`Transport::check_state`]); then resets a transport
    /// the guest had brought up (as a driver's status write of 0 would: the
    /// device stops), restarts the device if it ran in `s`, and applies the
    /// registers. On a refused state nothing changes; if the device cannot
    /// restart, the transport stays reset.
    fn restore(&mut self, s: &MmioTransportState) -> Result<(), TransportStateError> {
        let Checked { regs, live } = self.checked(s)?;
        if self.status != 0 {
            self.reset();
        }
        if let Some(queues) = live {
            self.start(s.acked_features, queues)
                .map_err(TransportStateError::Activate)?;
        }
        self.queues = regs;
        self.device_features_sel = s.device_features_sel;
        self.driver_features_sel = s.driver_features_sel;
        self.acked_features = s.acked_features;
        self.queue_sel = s.queue_sel;
        self.config_generation = s.config_generation;
        self.status = s.status;
        self.interrupt.restore(s.interrupt_status);
        Ok(())
    }
}

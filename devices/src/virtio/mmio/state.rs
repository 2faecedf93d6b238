//! Save and restore of a virtio-mmio transport: its registers, the
//! interrupt status and its queues.
//!
//! While the device runs, the transport's own queues only hold what the
//! driver programmed (sizes, addresses); where the device has got to in each
//! ring lives in the device's copies, so a save asks the device for them
//! ([`VirtioDevice::queue_states`]).
//!
//! A restore is applied to a transport freshly built for the same device
//! (before any vCPU runs). The state came from a file: every field is checked
//! against the device (queue count and sizes, offered features, status bits
//! in a possible order, queues inside guest memory) and a bad one is an error,
//! with nothing applied. A state with DRIVER_OK restarts the device with its
//! queues where they were, exactly as the driver's DRIVER_OK did; an
//! interrupt the driver had not acknowledged is raised again.

use migration::devices::{MmioTransportState, QueueState};
use migration::Snapshottable;
use virtio_queue::{Queue, QueueT};

use super::{status, MmioTransport, VIRTIO_F_VERSION_1};

/// Status bits a driver can have set.
const KNOWN_STATUS: u32 = status::ACKNOWLEDGE
    | status::DRIVER
    | status::DRIVER_OK
    | status::FEATURES_OK
    | status::DEVICE_NEEDS_RESET
    | status::FAILED;

/// Why a saved transport state cannot be applied.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TransportStateError {
    #[error("{saved} queues saved, the device has {device}")]
    QueueCount { saved: usize, device: usize },
    #[error("queue {index}: saved for {saved} entries at most, the device offers {device}")]
    QueueMax {
        index: usize,
        saved: u16,
        device: u16,
    },
    #[error("queue {index}: {err}")]
    Queue { index: usize, err: String },
    #[error("queue {index} is not inside guest memory")]
    QueueOutside { index: usize },
    #[error("status {0:#x} is not one a driver can reach")]
    Status(u32),
    #[error("the driver accepted features {extra:#x} that this device does not offer")]
    Features { extra: u64 },
    #[error("a transport can only be restored before the guest touches it")]
    NotFresh,
    #[error("the device cannot restart: {0}")]
    Activate(String),
}

impl MmioTransport {
    /// Checks `s` against this device; returns the queues for the registers
    /// (as the driver programmed them) and for the device (with their ring
    /// positions).
    fn check(
        &self,
        s: &MmioTransportState,
    ) -> Result<(Vec<Queue>, Vec<Queue>), TransportStateError> {
        if self.status != 0 {
            return Err(TransportStateError::NotFresh);
        }
        let device = self.device.queue_max_sizes();
        if s.queues.len() != device.len() {
            return Err(TransportStateError::QueueCount {
                saved: s.queues.len(),
                device: device.len(),
            });
        }
        let st = s.status;
        let driver_ok = st & status::DRIVER_OK != 0;
        if st & !KNOWN_STATUS != 0 || (driver_ok && st & status::FEATURES_OK == 0) {
            return Err(TransportStateError::Status(st));
        }
        if st & status::FEATURES_OK != 0 {
            let extra = s.acked_features & !self.offered();
            if extra != 0 || s.acked_features & VIRTIO_F_VERSION_1 == 0 {
                return Err(TransportStateError::Features { extra });
            }
        }
        let mut regs = Vec::with_capacity(device.len());
        let mut live = Vec::with_capacity(device.len());
        for (index, (q, &max)) in s.queues.iter().zip(device).enumerate() {
            if q.max_size != max {
                return Err(TransportStateError::QueueMax {
                    index,
                    saved: q.max_size,
                    device: max,
                });
            }
            let state = virtio_queue::QueueState::from(q);
            let build = |state| {
                Queue::try_from(state).map_err(|e| TransportStateError::Queue {
                    index,
                    err: format!("{e:?}"),
                })
            };
            let queue = build(state)?;
            if driver_ok && queue.ready() && !queue.is_valid(&self.mem) {
                return Err(TransportStateError::QueueOutside { index });
            }
            live.push(queue);
            regs.push(build(virtio_queue::QueueState {
                next_avail: 0,
                next_used: 0,
                ..state
            })?);
        }
        Ok((regs, live))
    }
}

impl Snapshottable for MmioTransport {
    type State = MmioTransportState;
    type Error = TransportStateError;

    fn save(&self) -> Result<MmioTransportState, TransportStateError> {
        let live = if self.status & status::DRIVER_OK != 0 {
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

    fn restore(&mut self, s: &MmioTransportState) -> Result<(), TransportStateError> {
        let (regs, live) = self.check(s)?;
        self.queues = regs;
        self.device_features_sel = s.device_features_sel;
        self.driver_features_sel = s.driver_features_sel;
        self.acked_features = s.acked_features;
        self.queue_sel = s.queue_sel;
        self.config_generation = s.config_generation;
        self.status = s.status;
        let running =
            s.status & status::DRIVER_OK != 0 && s.status & status::DEVICE_NEEDS_RESET == 0;
        if running {
            if let Err(e) = self
                .device
                .activate(s.acked_features, live, self.mem.clone())
            {
                self.status = 0;
                return Err(TransportStateError::Activate(e.to_string()));
            }
        }
        self.interrupt.restore(s.interrupt_status);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{start_device, transport};
    use super::*;
    use crate::virtio::INT_USED_RING;

    fn running() -> (MmioTransport, MmioTransportState) {
        let (mut t, _, _) = transport();
        start_device(&mut t);
        let state = t.save().unwrap();
        (t, state)
    }

    #[test]
    fn a_running_transport_round_trips_with_its_ring_positions() {
        let (t, mut state) = running();
        assert_eq!(state.queues.len(), 2);
        assert_eq!(state.queues[1].desc_table, 0x20000);
        assert!(state.queues[0].ready);
        // As if the device had used 3 buffers of queue 0 before the save.
        state.queues[0].next_avail = 3;
        state.queues[0].next_used = 3;
        state.interrupt_status = INT_USED_RING;
        drop(t);

        let (mut fresh, seen, _) = transport();
        fresh.restore(&state).unwrap();
        assert_eq!(
            seen.lock().unwrap().activated,
            Some(((1 << 5) | VIRTIO_F_VERSION_1, 2)),
            "restarted with the saved features"
        );
        let live = seen.lock().unwrap().live.clone().unwrap();
        assert_eq!((live[0].next_avail, live[0].next_used), (3, 3));
        assert_eq!(fresh.interrupt.status(), INT_USED_RING);
        // What a second save sees is what was restored.
        let again = fresh.save().unwrap();
        assert_eq!(again, state);
    }

    #[test]
    fn a_reset_transport_restores_without_starting_the_device() {
        let (t, _, _) = transport();
        let state = t.save().unwrap();
        let (mut fresh, seen, _) = transport();
        fresh.restore(&state).unwrap();
        assert!(seen.lock().unwrap().activated.is_none());
        assert_eq!(fresh.save().unwrap(), state);
    }

    #[test]
    fn hostile_states_are_refused_and_nothing_is_applied() {
        let (_, good) = running();
        type Spoil = Box<dyn Fn(&mut MmioTransportState)>;
        let cases: Vec<(&str, Spoil)> = vec![
            ("queues saved", Box::new(|s| s.queues.truncate(1))),
            ("entries at most", Box::new(|s| s.queues[0].max_size = 1024)),
            ("queue 0", Box::new(|s| s.queues[0].size = 3)),
            ("queue 1", Box::new(|s| s.queues[1].desc_table = 0x20001)),
            (
                "not inside guest memory",
                Box::new(|s| s.queues[0].used_ring = 0x7fff_0000),
            ),
            ("status", Box::new(|s| s.status = status::DRIVER_OK)),
            ("status", Box::new(|s| s.status |= 0x10)),
            ("does not offer", Box::new(|s| s.acked_features |= 1 << 7)),
            (
                "does not offer",
                Box::new(|s| s.acked_features &= !VIRTIO_F_VERSION_1),
            ),
        ];
        for (want, spoil) in cases {
            let mut bad = good.clone();
            spoil(&mut bad);
            let (mut fresh, seen, _) = transport();
            let e = fresh.restore(&bad).unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
            assert!(seen.lock().unwrap().activated.is_none(), "{want}");
            assert_eq!(fresh.status(), 0, "{want}: nothing applied");
        }
    }

    #[test]
    fn only_a_fresh_transport_is_restored() {
        let (mut t, state) = running();
        assert_eq!(
            t.restore(&state).unwrap_err(),
            TransportStateError::NotFresh
        );
    }
}

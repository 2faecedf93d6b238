//! The virtio-net device: features, configuration space (MAC, link status)
//! and activation. Queue processing happens in `handler` on the VMM thread;
//! activation (on a vCPU thread) hands it the queues through `NetState`,
//! which also holds the device's [`NetBackend`] (the tap), so that the
//! activation sets the backend's offloads before the handler sees the
//! queues, and the handler can swap the backend of a running device.
//!
//! With RSC on, the device also offers VIRTIO_NET_F_RSC_EXT (the virtio
//! spec makes it require HOST_TSO4 or HOST_TSO6, which are always offered);
//! what the engine may do is decided at each activation from the features
//! the driver acked ([`RscConfig::from_features`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::GuestMemoryMmap;
use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

use super::backend::{NetBackend, TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6};
use super::features::*;
use super::metrics::NetMetrics;
use super::rsc::RscConfig;
use super::tap::{Tap, TapError};
use crate::virtio::{read_config_space, ActivateError, VirtioDevice, VIRTIO_RING_F_EVENT_IDX};

/// Virtio device id of a network card.
pub const TYPE_NET: u32 = 1;
/// Queue size offered for RX and TX.
pub const QUEUE_SIZE: u16 = 256;
const STATUS_LINK_UP: u16 = 1;

/// What the user asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    pub tap: String,
    pub mac: [u8; 6],
    /// Tap socket send buffer in bytes; `None` keeps the kernel default.
    pub sndbuf: Option<u32>,
    /// Receive segment coalescing with this drain interval; `None`: off.
    pub rsc: Option<Duration>,
}

/// State shared between the device (activation, reset) and its handler.
pub struct NetState {
    /// Set on activation, cleared on reset.
    pub active: Option<Active>,
    /// Where frames go and come from; replaced only by the handler
    /// ([`super::handler::NetHandler::replace_backend`]).
    pub(crate) backend: Box<dyn NetBackend>,
}

impl NetState {
    /// A stopped device on `backend`.
    pub fn new(backend: Box<dyn NetBackend>) -> Self {
        NetState {
            active: None,
            backend,
        }
    }
}

/// A running device's queues and negotiated features.
pub struct Active {
    pub rx: Queue,
    pub tx: Queue,
    pub mem: GuestMemoryMmap,
    pub mergeable: bool,
    /// The features the driver acked.
    pub acked: u64,
    /// The RSC engine's configuration, when RSC is on.
    pub rsc: Option<RscConfig>,
}

/// The virtio-net device.
pub struct Net {
    config: NetConfig,
    state: Arc<Mutex<NetState>>,
    activate_evt: EventFd,
    pub metrics: Arc<NetMetrics>,
}

const OFFERED: u64 = CSUM
    | GUEST_CSUM
    | MAC
    | GUEST_TSO4
    | GUEST_TSO6
    | HOST_TSO4
    | HOST_TSO6
    | MRG_RXBUF
    | STATUS
    | VIRTIO_RING_F_EVENT_IDX;

/// Opens the tap of `config` as the device uses it (its send buffer set).
pub fn open_tap(config: &NetConfig) -> Result<Tap, TapError> {
    let tap = Tap::open(&config.tap)?;
    if let Some(bytes) = config.sndbuf {
        // Bounded to 1 GiB by the caller; the ioctl takes an int.
        tap.set_sndbuf(i32::try_from(bytes).unwrap_or(i32::MAX))?;
    }
    Ok(tap)
}

impl Net {
    /// Opens the tap and builds the device on it. `activate_evt` is
    /// written when the driver starts the device.
    pub fn new(config: NetConfig, activate_evt: EventFd) -> Result<Net, TapError> {
        let tap = open_tap(&config)?;
        Ok(Net::with_backend(config, Box::new(tap), activate_evt))
    }

    /// The device on `backend` (`config.tap` and `config.sndbuf` are not
    /// looked at).
    pub fn with_backend(
        config: NetConfig,
        backend: Box<dyn NetBackend>,
        activate_evt: EventFd,
    ) -> Net {
        Net {
            config,
            state: Arc::new(Mutex::new(NetState::new(backend))),
            activate_evt,
            metrics: Arc::new(NetMetrics::default()),
        }
    }

    /// The RSC engine's configuration before any negotiation (everything
    /// passes until the driver acks offloads), with RSC on.
    pub fn rsc_config(&self) -> Option<RscConfig> {
        self.config.rsc.map(|interval| RscConfig {
            interval,
            ..RscConfig::default()
        })
    }

    /// The state, shared with the handler.
    pub fn state(&self) -> Arc<Mutex<NetState>> {
        self.state.clone()
    }

    fn config_bytes(&self) -> [u8; 10] {
        let mut c = [0u8; 10];
        c[..6].copy_from_slice(&self.config.mac);
        c[6..8].copy_from_slice(&STATUS_LINK_UP.to_le_bytes());
        c[8..10].copy_from_slice(&1u16.to_le_bytes()); // max_virtqueue_pairs
        c
    }
}

/// The features offered for `config`: RSC_EXT only with RSC on.
pub fn offered(config: &NetConfig) -> u64 {
    if config.rsc.is_some() {
        OFFERED | RSC_EXT
    } else {
        OFFERED
    }
}

/// The tap offloads matching what the guest can receive.
pub fn tap_offloads(acked: u64) -> u32 {
    let mut f = 0;
    if acked & GUEST_CSUM != 0 {
        f |= TUN_F_CSUM;
        if acked & GUEST_TSO4 != 0 {
            f |= TUN_F_TSO4;
        }
        if acked & GUEST_TSO6 != 0 {
            f |= TUN_F_TSO6;
        }
    }
    f
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        TYPE_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        offered(&self.config)
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_space(&self.config_bytes(), offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // The MAC is read-only in virtio 1.x without VIRTIO_NET_F_CTRL_MAC_ADDR.
        crate::virtio::net::metrics::NetMetrics::add(&self.metrics.bad_register_accesses, 1);
    }

    fn activate(
        &mut self,
        acked: u64,
        mut queues: Vec<Queue>,
        mem: GuestMemoryMmap,
    ) -> Result<(), ActivateError> {
        ActivateError::check_queue_count(&queues, 2)?;
        let mut state = crate::sync::lock(&self.state);
        state
            .backend
            .set_offload(tap_offloads(acked))
            .map_err(|source| ActivateError::Offloads {
                backend: state.backend.name().to_string(),
                source,
            })?;
        let tx = queues.pop().ok_or(ActivateError::BadQueue(1))?;
        let rx = queues.pop().ok_or(ActivateError::BadQueue(0))?;
        state.active = Some(Active {
            rx,
            tx,
            mem,
            mergeable: acked & MRG_RXBUF != 0,
            acked,
            rsc: self.config.rsc.map(|interval| RscConfig {
                interval,
                ..RscConfig::from_features(acked)
            }),
        });
        drop(state);
        self.activate_evt.write(1).map_err(ActivateError::Notify)
    }

    fn reset(&mut self) {
        crate::sync::lock(&self.state).active = None;
    }

    fn queue_states(&self) -> Option<Vec<virtio_queue::QueueState>> {
        let state = crate::sync::lock(&self.state);
        let active = state.active.as_ref()?;
        Some(vec![active.rx.state(), active.tx.state()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(rsc: Option<Duration>) -> NetConfig {
        NetConfig {
            tap: "t".into(),
            mac: [0; 6],
            sndbuf: None,
            rsc,
        }
    }

    #[test]
    fn rsc_ext_offered_only_with_rsc_on() {
        let off = offered(&config(None));
        assert_eq!(off & RSC_EXT, 0);
        let on = offered(&config(Some(Duration::from_micros(300))));
        assert_eq!(on, off | RSC_EXT, "everything else as before");
        // virtio 1.2 5.1.3.1: RSC_EXT requires HOST_TSO4 or HOST_TSO6; the
        // engine needs GUEST_TSO4/6 and GUEST_CSUM to coalesce at all.
        assert_ne!(on & (HOST_TSO4 | HOST_TSO6), 0);
        assert_eq!(
            on & (GUEST_CSUM | GUEST_TSO4 | GUEST_TSO6),
            GUEST_CSUM | GUEST_TSO4 | GUEST_TSO6
        );
    }

    #[test]
    fn offloads_follow_guest_features() {
        assert_eq!(tap_offloads(0), 0);
        assert_eq!(tap_offloads(GUEST_TSO4), 0, "TSO needs checksum offload");
        assert_eq!(
            tap_offloads(GUEST_CSUM | GUEST_TSO4 | GUEST_TSO6),
            TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6
        );
    }
}

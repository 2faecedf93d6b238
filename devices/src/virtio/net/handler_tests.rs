//! Unit tests of the handler on a real event loop (event-manager), with
//! socket-pair backends and a driver over mock guest memory: frames both
//! ways through the backend, flow control, and the swap of the backend of
//! a running device.

use std::os::fd::OwnedFd;
use std::time::Duration;

use event_manager::{EventManager, SubscriberOps};

use super::*;
use crate::virtio::net::backend::tests::{recv, send, PairBackend};
use crate::virtio::net::backend::{TUN_F_CSUM, TUN_F_TSO4};
use crate::virtio::net::features::*;
use crate::virtio::net::{Net, NetConfig};
use crate::virtio::test_util::{Driver, DATA};
use crate::virtio::VirtioDevice;

const ACKED: u64 = GUEST_CSUM | GUEST_TSO4 | MRG_RXBUF;
const TX_DATA: u64 = DATA + 0x10_0000;

/// A device on its handler and event loop, with its RX and TX rings.
struct Rig {
    net: Net,
    handler: Arc<Mutex<NetHandler>>,
    evm: EventManager<Arc<Mutex<NetHandler>>>,
    rx: Driver,
    tx: Driver,
    rx_evt: EventFd,
    tx_evt: EventFd,
    rx_posted: u64,
    tx_sent: u64,
}

impl Rig {
    /// A device on `backend`, not yet activated.
    fn new(backend: PairBackend) -> Rig {
        let evt = || EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let activate = evt();
        let config = NetConfig {
            tap: String::new(),
            mac: [2, 0, 0, 0, 0, 1],
            sndbuf: None,
            rsc: None,
        };
        let net = Net::with_backend(config, Box::new(backend), activate.try_clone().unwrap());
        let (rx_evt, tx_evt) = (evt(), evt());
        let handler = NetHandler::new(
            net.state(),
            activate,
            [rx_evt.try_clone().unwrap(), tx_evt.try_clone().unwrap()],
            Arc::new(Interrupt::new(evt())),
            net.metrics.clone(),
            None,
        )
        .unwrap();
        let handler = Arc::new(Mutex::new(handler));
        let mut evm = EventManager::new().unwrap();
        evm.add_subscriber(handler.clone());
        let rx = Driver::new(16);
        let tx = rx.second(16);
        Rig {
            net,
            handler,
            evm,
            rx,
            tx,
            rx_evt,
            tx_evt,
            rx_posted: 0,
            tx_sent: 0,
        }
    }

    /// The driver starts the device.
    fn activate(&mut self) {
        let queues = vec![self.rx.queue(), self.tx.queue()];
        self.net
            .activate(ACKED, queues, self.rx.mem.clone())
            .unwrap();
        self.spin();
    }

    /// Runs the event loop until nothing is ready.
    fn spin(&mut self) {
        for _ in 0..100 {
            if self.evm.run_with_timeout(20).unwrap() == 0 {
                return;
            }
        }
        panic!("the event loop does not settle");
    }

    /// The guest posts `n` 4 KiB receive buffers.
    fn post_rx(&mut self, n: u64) {
        for _ in 0..n {
            let at = DATA + self.rx_posted * 0x1000;
            self.rx.add_chain(&[(at, 0x1000, true)]);
            self.rx_posted += 1;
        }
        self.rx_evt.write(1).unwrap();
        self.spin();
    }

    /// The frames the guest received so far (header included).
    fn received(&self) -> Vec<Vec<u8>> {
        self.rx
            .used()
            .iter()
            .map(|&(head, len)| self.rx.read(DATA + u64::from(head) * 0x1000, len as usize))
            .collect()
    }

    /// The guest sends `frame` (header included).
    fn send_tx(&mut self, frame: &[u8]) {
        let at = TX_DATA + self.tx_sent * 0x1000;
        self.tx_sent += 1;
        self.tx.write(at, frame);
        self.tx.add_chain(&[(at, frame.len() as u32, false)]);
        self.tx_evt.write(1).unwrap();
        self.spin();
    }

    fn counters(&self) -> crate::virtio::net::metrics::NetCounters {
        self.net.metrics.snapshot()
    }

    /// Asks for a swap to `backend` and runs the loop until it is done.
    fn swap(&mut self, backend: PairBackend) -> Swapped {
        let done = crate::sync::lock(&self.handler)
            .replace_backend(Box::new(backend))
            .unwrap();
        self.spin();
        done.recv_timeout(Duration::from_secs(1)).unwrap()
    }
}

/// A frame: a zero virtio-net header, then `len` bytes of `fill`.
fn frame(len: usize, fill: u8) -> Vec<u8> {
    let mut f = vec![0u8; VNET_HDR_LEN];
    f.extend(vec![fill; len]);
    f
}

/// The frame as the guest reads it: `num_buffers` is 1.
fn as_received(mut f: Vec<u8>) -> Vec<u8> {
    f[10] = 1;
    f
}

/// Receives one frame at `peer`, if one is there.
fn take(peer: &OwnedFd) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 65536];
    let n = recv(peer, &mut buf).ok()?;
    buf.truncate(n);
    Some(buf)
}

#[test]
fn frames_flow_both_ways_through_the_backend() {
    let (a, peer) = PairBackend::pair("a");
    let offload = a.offload.clone();
    let mut rig = Rig::new(a);
    rig.activate();
    assert_eq!(*offload.lock().unwrap(), Some(TUN_F_CSUM | TUN_F_TSO4));
    rig.post_rx(2);
    send(&peer, &frame(60, 0xa1)).unwrap();
    rig.spin();
    assert_eq!(rig.received(), [as_received(frame(60, 0xa1))]);
    rig.send_tx(&frame(80, 0xb2));
    assert_eq!(take(&peer), Some(frame(80, 0xb2)));
    assert_eq!(rig.tx.used(), [(0, 0)]);
    let c = rig.counters();
    assert_eq!((c.rx_packets, c.tx_packets, c.drops), (1, 1, 0));
}

#[test]
fn a_running_device_swaps_its_backend() {
    let (a, peer_a) = PairBackend::pair("a");
    let mut rig = Rig::new(a);
    rig.activate();
    rig.post_rx(4);
    send(&peer_a, &frame(60, 1)).unwrap();
    rig.spin();
    assert_eq!(rig.received().len(), 1);

    // To a backend with a descriptor per direction.
    let (b, rx_peer_b, tx_peer_b) = PairBackend::split("b");
    let offload_b = b.offload.clone();
    let old = rig.swap(b).unwrap();
    assert_eq!(old.name(), "a", "the old backend is handed back");
    assert_eq!(
        *offload_b.lock().unwrap(),
        Some(TUN_F_CSUM | TUN_F_TSO4),
        "the new backend gets the running driver's offloads"
    );
    // What reaches the old backend now is not the guest's.
    send(&peer_a, &frame(60, 2)).unwrap();
    rig.spin();
    assert_eq!(rig.received().len(), 1);
    send(&rx_peer_b, &frame(70, 3)).unwrap();
    rig.spin();
    assert_eq!(rig.received()[1], as_received(frame(70, 3)));
    rig.send_tx(&frame(90, 4));
    assert_eq!(take(&tx_peer_b), Some(frame(90, 4)));
    assert_eq!(take(&rx_peer_b), None, "TX goes to B's TX descriptor");
    assert_eq!(take(&peer_a), None, "nothing to the old backend");

    // And back to a tap-like backend with one descriptor.
    let (c, peer_c) = PairBackend::pair("c");
    assert_eq!(rig.swap(c).unwrap().name(), "b");
    send(&peer_c, &frame(50, 5)).unwrap();
    rig.spin();
    assert_eq!(rig.received()[2], as_received(frame(50, 5)));
    assert_eq!(rig.counters().rx_packets, 3);
}

#[test]
fn a_tx_blocked_on_the_old_backend_goes_out_on_the_new_one() {
    let (a, peer_a) = PairBackend::pair("a");
    a.fill();
    let mut rig = Rig::new(a);
    rig.activate();
    rig.send_tx(&frame(100, 7));
    assert_eq!(rig.counters().tap_full_waits, 1);
    assert!(rig.tx.used().is_empty(), "the chain waits in the ring");
    let (b, peer_b) = PairBackend::pair("b");
    rig.swap(b).unwrap();
    assert_eq!(take(&peer_b), Some(frame(100, 7)));
    assert_eq!(rig.tx.used(), [(0, 0)]);
    drop(peer_a);
}

#[test]
fn a_backend_refusing_the_offloads_is_handed_back() {
    let (a, peer_a) = PairBackend::pair("a");
    let mut rig = Rig::new(a);
    rig.activate();
    let (mut b, _peer_b) = PairBackend::pair("b");
    b.refuse_offload = true;
    let Err(err) = rig.swap(b) else {
        panic!("a backend that refuses the offloads is put in");
    };
    assert_eq!(err.backend.name(), "b");
    assert!(err.to_string().contains("network backend b"), "{err}");
    // The old backend still serves.
    rig.post_rx(1);
    send(&peer_a, &frame(60, 9)).unwrap();
    rig.spin();
    assert_eq!(rig.received(), [as_received(frame(60, 9))]);
}

#[test]
fn a_swap_before_activation_is_watched_from_activation() {
    let (a, _peer_a) = PairBackend::pair("a");
    let mut rig = Rig::new(a);
    rig.spin();
    let (b, peer_b) = PairBackend::pair("b");
    let offload_b = b.offload.clone();
    assert_eq!(rig.swap(b).unwrap().name(), "a");
    assert_eq!(*offload_b.lock().unwrap(), None, "no driver yet");
    rig.activate();
    assert_eq!(*offload_b.lock().unwrap(), Some(TUN_F_CSUM | TUN_F_TSO4));
    rig.post_rx(1);
    send(&peer_b, &frame(60, 6)).unwrap();
    rig.spin();
    assert_eq!(rig.received(), [as_received(frame(60, 6))]);
}

//! virtio-net's receive and transmit paths over descriptor chains a hostile
//! guest wrote into 64 KiB of guest memory: the RX pump (`rx_pump`, with
//! the RSC engine or without, delivering through `rx::deliver`) and the TX
//! loop (`tx::gather`, in the handler's loop). Nothing may panic or touch
//! memory outside the guest's, every bad chain is counted, and no received
//! frame is lost without a count.
//!
//! Input: 2 bytes of set-up, then 8-byte operations (see `Op`).
//! Set-up byte 0: RX queue size `1 << (b & 7)`, TX `1 << ((b >> 3) & 7)`;
//! byte 1: features (see `features`).
#![no_main]

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use devices::virtio::net::features::{GUEST_CSUM, GUEST_TSO4, GUEST_TSO6, MRG_RXBUF, RSC_EXT};
use devices::virtio::net::metrics::NetMetrics;
use devices::virtio::net::rsc::RscConfig;
use devices::virtio::net::rx_pump::{Guest, RxPump, MAX_HELD, MAX_RX_FRAME};
use devices::virtio::net::tx::{self, MAX_TX_FRAME};
use devices::virtio::VIRTIO_RING_F_EVENT_IDX;
use devices::GuestMemoryMmap;
use libfuzzer_sys::fuzz_target;
use tandem_fuzz::frames::{Csum, Segment, VNET_HDR_LEN};
use tandem_fuzz::virtq::Ring;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress};

const MEM: u64 = 0x10000;
const MAX_QUEUE: u16 = 256;

fn memory() -> &'static GuestMemoryMmap {
    static MEM_: OnceLock<GuestMemoryMmap> = OnceLock::new();
    MEM_.get_or_init(|| {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM as usize)]).expect("guest memory")
    })
}

/// Set-up byte 1: bit 0 MRG_RXBUF, 1 EVENT_IDX, 2 RSC on, 3 GUEST_CSUM,
/// 4 GUEST_TSO4, 5 GUEST_TSO6, 6 RSC_EXT.
fn features(b: u8) -> u64 {
    [
        (0, MRG_RXBUF),
        (1, VIRTIO_RING_F_EVENT_IDX),
        (3, GUEST_CSUM),
        (4, GUEST_TSO4),
        (5, GUEST_TSO6),
        (6, RSC_EXT),
    ]
    .iter()
    .filter(|(bit, _)| b & (1 << bit) != 0)
    .fold(0, |acc, (_, f)| acc | f)
}

/// One device with its two queues, and what the test counts.
struct World {
    mem: &'static GuestMemoryMmap,
    rx: Ring,
    tx: Ring,
    rxq: Queue,
    txq: Queue,
    acked: u64,
    rsc: bool,
    pump: RxPump,
    metrics: NetMetrics,
    now: Instant,
    /// Frames the "tap" has for the guest, oldest first.
    tap_rx: VecDeque<Vec<u8>>,
    /// Frames the pump took from the tap (at least a header long).
    fed: u64,
    /// Frames dropped by a re-activation (features changed).
    discarded: u64,
    /// Next sequence number of each TCP flow.
    seqs: [u32; 16],
    tx_buf: Vec<u8>,
    /// Frames the "tap" took, chains refused.
    tx_sent: u64,
    tx_malformed: u64,
}

fn le16(a: u8, b: u8) -> u16 {
    u16::from_le_bytes([a, b])
}

impl World {
    fn new(setup: [u8; 2]) -> Self {
        let mem = memory();
        // Every input starts from zeroed memory.
        let _ = mem.write_slice(&vec![0u8; MEM as usize], GuestAddress(0));
        let rx = Ring::new(0x0000, 0x1000, 0x1400, 1 << (setup[0] & 7), MAX_QUEUE);
        let tx = Ring::new(
            0x2000,
            0x3000,
            0x3400,
            1 << ((setup[0] >> 3) & 7),
            MAX_QUEUE,
        );
        let acked = features(setup[1]);
        let rsc = setup[1] & 4 != 0;
        let mut w = World {
            mem,
            rxq: rx.queue(false),
            txq: tx.queue(false),
            rx,
            tx,
            acked,
            rsc,
            pump: RxPump::new(rsc.then(RscConfig::default)),
            metrics: NetMetrics::default(),
            now: Instant::now(),
            tap_rx: VecDeque::new(),
            fed: 0,
            discarded: 0,
            seqs: [0; 16],
            tx_buf: Vec::with_capacity(MAX_TX_FRAME),
            tx_sent: 0,
            tx_malformed: 0,
        };
        w.activate(acked);
        w
    }

    /// The driver (re)started the device with `acked`: fresh queues on the
    /// same rings, the pump reconfigured (RSC stays on or off).
    fn activate(&mut self, acked: u64) {
        let event_idx = acked & VIRTIO_RING_F_EVENT_IDX != 0;
        self.rx.set_avail_idx(self.mem, 0);
        self.tx.set_avail_idx(self.mem, 0);
        let _ = self.mem.write_obj(0u16, GuestAddress(self.rx.used + 2));
        let _ = self.mem.write_obj(0u16, GuestAddress(self.tx.used + 2));
        self.rxq = self.rx.queue(event_idx);
        self.txq = self.tx.queue(event_idx);
        self.acked = acked;
        let cfg = self.rsc.then(|| RscConfig {
            interval: Duration::from_micros(300),
            ..RscConfig::from_features(acked)
        });
        self.discarded += self.pump.activate(acked, cfg) as u64;
    }

    fn op(&mut self, op: &[u8]) {
        let [code, a, b, c, d, e, f, g] = op else {
            return;
        };
        match code % 10 {
            0 => {
                let ring = if a & 1 == 0 { &self.rx } else { &self.tx };
                let mut addr = u64::from(le16(*c, *d));
                if g & 0x80 != 0 {
                    addr |= 0xffff_ffff_ffff_0000;
                }
                let mut len = u32::from(le16(*e, *f));
                if g & 0x40 != 0 {
                    len |= 0xffff_0000;
                }
                let flags = u16::from(g & 7);
                ring.write_desc(self.mem, u16::from(*b), addr, len, flags, u16::from(a >> 1));
            }
            1 => {
                let ring = if a & 1 == 0 {
                    &mut self.rx
                } else {
                    &mut self.tx
                };
                let head = if a & 2 != 0 {
                    le16(*b, *c)
                } else {
                    u16::from(*b)
                };
                for i in 0..=(d & 7) {
                    ring.publish(self.mem, head.wrapping_add(u16::from(i)));
                }
            }
            2 => {
                let ring = if a & 1 == 0 {
                    &mut self.rx
                } else {
                    &mut self.tx
                };
                ring.set_avail_idx(self.mem, le16(*b, *c));
            }
            3 => {
                let at = u64::from(le16(*a, *b));
                let _ = self
                    .mem
                    .write_slice(&[*c, *d, *e, *f, *g], GuestAddress(at));
            }
            4 => {
                let len = usize::from(le16(*a, *b)) % (MAX_RX_FRAME + 64);
                let mut frame: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(*e)).collect();
                if let Some(h) = frame.get_mut(..2) {
                    h.copy_from_slice(&[*c, *d]);
                }
                self.tap_rx.push_back(frame);
                self.rx_run();
            }
            5 => {
                let frame = self.segment([*a, *b, *c, *d, *e]);
                self.tap_rx.push_back(frame);
                self.rx_run();
            }
            6 => self.tx_run(*a),
            7 => self.rx_run(),
            8 => {
                self.now += Duration::from_micros(u64::from(le16(*a, *b)));
                self.pump.expire(self.now);
                self.rx_run();
            }
            _ => self.activate(features(*a)),
        }
    }

    /// A TCP segment of one of 16 flows (the RSC engine's input).
    fn segment(&mut self, p: [u8; 5]) -> Vec<u8> {
        let flow = usize::from(p[0] & 15);
        let len = usize::from(le16(p[1], p[2])) % 9001;
        let seq = if p[4] & 4 != 0 {
            self.seqs[flow].wrapping_add(0x1000)
        } else {
            self.seqs[flow]
        };
        self.seqs[flow] = seq.wrapping_add(len as u32);
        Segment {
            v6: flow & 8 != 0,
            host: flow as u8,
            seq,
            ack: 1,
            window: 512,
            flags: p[3] | 0x10,
            ts: (p[4] & 1 != 0).then_some((seq >> 8, 7)),
            extra_option: false,
            payload_len: len,
            stream: flow as u8,
            tos: 0,
            ttl: 64,
            df: true,
            ip_options: false,
            bad_ip_csum: false,
            csum: if p[4] & 2 != 0 {
                Csum::Partial
            } else {
                Csum::DataValid
            },
            gso_type: 0,
        }
        .build()
    }

    /// One RX run, as the handler's: frames from the tap to the guest.
    fn rx_run(&mut self) {
        let mut guest = Guest {
            queue: &mut self.rxq,
            mem: self.mem,
            mergeable: self.acked & MRG_RXBUF != 0,
        };
        let (tap_rx, fed) = (&mut self.tap_rx, &mut self.fed);
        let now = self.now;
        self.pump.pump(
            &mut guest,
            |buf| {
                let Some(f) = tap_rx.pop_front() else {
                    return Err(io::ErrorKind::WouldBlock.into());
                };
                let n = f.len().min(buf.len());
                buf[..n].copy_from_slice(&f[..n]);
                if n >= VNET_HDR_LEN {
                    *fed += 1;
                }
                Ok(n)
            },
            || now,
            &self.metrics,
        );
        assert!(
            self.pump.held() <= MAX_HELD,
            "{} frames held",
            self.pump.held()
        );
        self.check_conservation();
    }

    /// Every frame taken from the tap is delivered, counted as refused by a
    /// bad chain, discarded by a re-activation, held, or (with RSC) inside
    /// the engine.
    fn check_conservation(&self) {
        let m = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        let out = m(&self.metrics.rx_packets)
            + m(&self.metrics.malformed_chains)
            + self.discarded
            + self.pump.held() as u64;
        match self.pump.rsc_counters() {
            Some(c) => {
                assert_eq!(c.received, self.fed, "frames into the engine");
                assert_eq!(c.delivered, out, "frames out of the engine");
            }
            None => assert_eq!(self.fed, out, "frames from the tap"),
        }
    }

    /// One TX run, the handler's loop with a tap that takes the frames
    /// whose bit is set in `accept` (the first eight; later ones all) and
    /// would block on the others.
    fn tx_run(&mut self, accept: u8) {
        let (mem, q) = (self.mem, &mut self.txq);
        let mut writes = 0u32;
        let mut popped = true;
        loop {
            let Some(chain) = q.pop_descriptor_chain(mem) else {
                if !popped {
                    self.tx_malformed += 1;
                    break;
                }
                popped = false;
                match q.enable_notification(mem) {
                    Ok(true) => continue,
                    _ => break,
                }
            };
            popped = true;
            let head = chain.head_index();
            match tx::gather(chain, mem, &mut self.tx_buf) {
                Ok(()) => {
                    let len = self.tx_buf.len();
                    assert!(
                        (VNET_HDR_LEN..=MAX_TX_FRAME).contains(&len),
                        "TX frame {len}"
                    );
                    let takes = writes >= 8 || accept & (1 << writes) != 0;
                    writes += 1;
                    if !takes {
                        q.go_to_previous_position();
                        break;
                    }
                    self.tx_sent += 1;
                }
                Err(_) => self.tx_malformed += 1,
            }
            if q.add_used(mem, head, 0).is_err() {
                self.tx_malformed += 1;
            }
        }
        let _ = q.needs_notification(mem);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((setup, ops)) = data.split_first_chunk::<2>() else {
        return;
    };
    let mut w = World::new(*setup);
    for op in ops.chunks_exact(8) {
        w.op(op);
    }
    // The drain timer fires: whatever the engine held goes to the guest.
    w.now += Duration::from_secs(1);
    w.pump.expire(w.now);
    w.rx_run();
});

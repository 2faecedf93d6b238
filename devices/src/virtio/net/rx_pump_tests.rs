//! Unit tests of the receive path: a fake tap (a list of frames, counting
//! reads) and a driver over mock guest memory with 4 KiB mergeable buffers.

use std::collections::VecDeque;
use std::time::Duration;

use super::*;
use crate::virtio::net::features::*;
use crate::virtio::net::rsc::testutil::{linux, parse, vnet, Tcp};
use crate::virtio::net::rsc::DEFAULT_INTERVAL;
use crate::virtio::test_util::{Driver, DATA};

const BUF: u32 = 4096;
const LINUX: u64 = GUEST_CSUM | GUEST_TSO4 | GUEST_TSO6 | MRG_RXBUF;

/// Frames the tap has, and how many were taken.
struct Source {
    frames: VecDeque<Vec<u8>>,
    taken: usize,
}

impl Source {
    fn new(frames: impl IntoIterator<Item = Vec<u8>>) -> Self {
        Source {
            frames: frames.into_iter().collect(),
            taken: 0,
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let f = self
            .frames
            .pop_front()
            .ok_or_else(|| io::Error::from(io::ErrorKind::WouldBlock))?;
        buf[..f.len()].copy_from_slice(&f);
        self.taken += 1;
        Ok(f.len())
    }
}

/// A guest: its ring, the buffers it posted, the packets it read back.
struct Vm {
    d: Driver,
    queue: Queue,
    addrs: Vec<u64>,
    seen: usize,
    metrics: NetMetrics,
}

impl Vm {
    fn new() -> Self {
        let d = Driver::new(256);
        let queue = d.queue();
        Vm {
            d,
            queue,
            addrs: Vec::new(),
            seen: 0,
            metrics: NetMetrics::default(),
        }
    }

    fn post(&mut self, n: usize) {
        for _ in 0..n {
            let addr = DATA + self.addrs.len() as u64 * u64::from(BUF);
            self.d.add_chain(&[(addr, BUF, true)]);
            self.addrs.push(addr);
        }
    }

    fn pump(&mut self, p: &mut RxPump, src: &mut Source, now: Instant) -> Pumped {
        let mut g = Guest {
            queue: &mut self.queue,
            mem: &self.d.mem,
            mergeable: true,
        };
        p.pump(&mut g, |b| src.read(b), || now, &self.metrics)
    }

    /// The packets received since the last call (header + frame each).
    fn received(&mut self) -> Vec<Vec<u8>> {
        let used = self.d.used();
        let mut pkts = Vec::new();
        while self.seen < used.len() {
            let (head, len) = used[self.seen];
            let mut pkt = self.d.read(self.addrs[head as usize], len as usize);
            let n = usize::from(vnet(&pkt).num_buffers);
            for &(head, len) in &used[self.seen + 1..self.seen + n] {
                pkt.extend(self.d.read(self.addrs[head as usize], len as usize));
            }
            self.seen += n;
            pkts.push(pkt);
        }
        pkts
    }
}

fn stream(n: usize, len: usize) -> Vec<Tcp> {
    let mut v = vec![Tcp::v4(1000, len)];
    while v.len() < n {
        let next = v[v.len() - 1].next(len);
        v.push(next);
    }
    v
}

fn payload(pkts: &[Vec<u8>]) -> Vec<u8> {
    pkts.iter().flat_map(|p| parse(p).payload).collect()
}

fn engine(p: &RxPump) -> &RscCounters {
    p.rsc_counters().expect("RSC on")
}

#[test]
fn without_rsc_a_frame_waits_for_buffers_and_the_tap_is_not_read() {
    let frames: Vec<Vec<u8>> = stream(5, 1000).iter().map(Tcp::build).collect();
    let mut src = Source::new(frames.clone());
    let mut vm = Vm::new();
    let mut p = RxPump::new(None);
    assert_eq!(p.activate(LINUX, None), 0);
    vm.post(2);
    let t = Instant::now();
    let r = vm.pump(&mut p, &mut src, t);
    assert_eq!(
        r,
        Pumped {
            starved: true,
            used: true
        }
    );
    assert_eq!(src.taken, 3, "the third frame waits; no fourth read");
    assert_eq!(p.held(), 1);
    assert_eq!(vm.received().len(), 2);
    // Still no buffers: nothing moves, nothing is read.
    assert!(vm.pump(&mut p, &mut src, t).starved);
    assert_eq!(src.taken, 3);
    vm.post(8);
    let r = vm.pump(&mut p, &mut src, t);
    assert_eq!(
        r,
        Pumped {
            starved: false,
            used: true
        }
    );
    let got = vm.received();
    assert_eq!(got.len(), 3);
    for (g, f) in got.iter().zip(&frames[2..]) {
        assert_eq!(g[..10], f[..10], "header untouched");
        assert_eq!(g[12..], f[12..], "frame untouched");
    }
    let m = vm.metrics.snapshot();
    assert_eq!((m.rx_packets, m.no_rx_buffer_waits), (5, 2));
    assert_eq!((m.rx_held_max, m.drops), (1, 0));
    assert!(p.rsc_counters().is_none());
    assert_eq!(p.next_deadline(), None, "no engine, no timer");
}

#[test]
fn rsc_coalesces_and_the_timer_delivers() {
    let segs = stream(10, 1448);
    let mut src = Source::new(segs.iter().map(Tcp::build));
    let mut vm = Vm::new();
    let mut p = RxPump::new(Some(RscConfig::default()));
    p.activate(LINUX, Some(linux()));
    vm.post(64);
    let t0 = Instant::now();
    let r = vm.pump(&mut p, &mut src, t0);
    assert_eq!(r, Pumped::default(), "all ten held by the engine");
    assert_eq!(src.taken, 10);
    assert_eq!(p.undelivered(), 10, "ten frames read, none in the guest");
    assert_eq!(p.next_deadline(), Some(t0 + DEFAULT_INTERVAL));
    p.expire(t0 + DEFAULT_INTERVAL - Duration::from_micros(1));
    assert_eq!(p.held(), 0, "not yet");
    p.expire(t0 + DEFAULT_INTERVAL);
    assert_eq!(p.held(), 1);
    assert_eq!(p.undelivered(), 10, "one packet carrying ten frames");
    assert_eq!(p.next_deadline(), None);
    let r = vm.pump(&mut p, &mut src, t0 + DEFAULT_INTERVAL);
    assert!(r.used && !r.starved);
    assert_eq!(p.undelivered(), 0);
    let got = vm.received();
    assert_eq!(got.len(), 1);
    let v = vnet(&got[0]);
    assert_eq!((v.gso_type, v.gso_size), (1, 1448), "TCPv4 GSO");
    let want: Vec<u8> = segs.iter().flat_map(|s| s.payload.clone()).collect();
    assert_eq!(payload(&got), want);
    let c = engine(&p);
    assert_eq!((c.received, c.coalesced, c.timer_drains), (10, 9, 1));
    assert_eq!(vm.metrics.snapshot().rx_packets, 1);
}

#[test]
fn rsc_flushes_when_the_guest_is_full_and_reads_no_more() {
    let segs = stream(100, 1448);
    let mut src = Source::new(segs.iter().map(Tcp::build));
    let mut vm = Vm::new();
    let mut p = RxPump::new(Some(RscConfig::default()));
    p.activate(LINUX, Some(linux()));
    let t = Instant::now();
    let r = vm.pump(&mut p, &mut src, t);
    assert!(r.starved && !r.used);
    // 45 segments fill a 64 KiB packet; the 46th flushes it and starts the
    // next, which the starved guest's flush then empties.
    assert_eq!(src.taken, 46, "no read while a frame waits");
    assert_eq!(p.held(), 2);
    assert_eq!(p.undelivered(), 46, "45 + 1 frames in two packets");
    assert_eq!(p.next_deadline(), None, "nothing waits on the timer");
    let c = engine(&p);
    assert_eq!((c.flush.size, c.flush.flush_all), (1, 1));

    vm.post(60);
    let r = vm.pump(&mut p, &mut src, t);
    assert!(r.used && !r.starved);
    assert_eq!(src.taken, 100);
    p.expire(t + DEFAULT_INTERVAL);
    let r = vm.pump(&mut p, &mut src, t + DEFAULT_INTERVAL);
    assert!(r.used && !r.starved);
    let got = vm.received();
    assert_eq!(got.len(), 4, "45 + 1 + 45 + 9 segments");
    let want: Vec<u8> = segs.iter().flat_map(|s| s.payload.clone()).collect();
    assert_eq!(payload(&got), want, "every byte, in order");
    let m = vm.metrics.snapshot();
    assert_eq!((m.drops, m.malformed_chains, m.rx_held_max), (0, 0, 2));
}

#[test]
fn held_frames_stay_bounded_with_many_flows() {
    let n = MAX_FLOWS + 8;
    let frames = (0..n).map(|i| Tcp::v4(0, 100).with(|s| s.sport = 100 + i as u16).build());
    let mut src = Source::new(frames);
    let mut vm = Vm::new();
    let mut p = RxPump::new(Some(linux()));
    p.activate(LINUX, Some(linux()));
    let r = vm.pump(&mut p, &mut src, Instant::now());
    assert!(r.starved);
    // The first new flow past MAX_FLOWS evicts the oldest; that frame finds
    // no buffer, and the other MAX_FLOWS pending packets are flushed.
    assert_eq!(src.taken, MAX_FLOWS + 1);
    assert_eq!(p.held(), MAX_FLOWS + 1);
    assert!(p.held() <= MAX_HELD);
    assert_eq!(vm.metrics.snapshot().rx_held_max, (MAX_FLOWS + 1) as u64);
    vm.post(n);
    assert!(!vm.pump(&mut p, &mut src, Instant::now()).starved);
    p.expire(Instant::now() + DEFAULT_INTERVAL);
    vm.pump(&mut p, &mut src, Instant::now());
    let ports: Vec<u16> = vm.received().iter().map(|f| parse(f).sport).collect();
    assert_eq!(ports, (0..n).map(|i| 100 + i as u16).collect::<Vec<_>>());
}

#[test]
fn reactivation_keeps_held_frames_only_for_the_same_features() {
    let mut vm = Vm::new();
    let mut p = RxPump::new(None);
    p.activate(LINUX, None);
    let mut src = Source::new([Tcp::v4(0, 100).build()]);
    assert!(vm.pump(&mut p, &mut src, Instant::now()).starved);
    assert_eq!(p.activate(LINUX, None), 0, "same driver features: kept");
    assert_eq!(p.held(), 1);
    assert_eq!(p.activate(GUEST_CSUM, None), 1, "other features: discarded");
    assert_eq!(p.held(), 0);

    // With RSC, the engine's pending packet comes out at re-activation.
    let mut p = RxPump::new(Some(linux()));
    p.activate(LINUX, Some(linux()));
    let mut src = Source::new(stream(3, 1000).iter().map(Tcp::build));
    assert_eq!(vm.pump(&mut p, &mut src, Instant::now()), Pumped::default());
    assert_eq!(p.activate(LINUX, Some(linux())), 0);
    assert_eq!((p.held(), p.next_deadline()), (1, None));
    let c = engine(&p);
    assert_eq!((c.coalesced, c.flush.flush_all), (2, 1));
    // A driver without offloads: no coalescing from then on, counters go on.
    let plain = RscConfig::from_features(MRG_RXBUF);
    assert_eq!(p.activate(MRG_RXBUF, Some(plain)), 1);
    vm.post(4);
    let mut src = Source::new(stream(2, 1000).iter().map(Tcp::build));
    vm.pump(&mut p, &mut src, Instant::now());
    assert_eq!(vm.received().len(), 2);
    assert_eq!(engine(&p).pass.no_offload, 2);
}

#[test]
fn held_frames_can_be_taken_back() {
    // Without RSC: one frame held while the guest has no buffers.
    let mut src = Source::new((0..3).map(|i| Tcp::v4(i * 100, 100).build()));
    let mut vm = Vm::new();
    let mut p = RxPump::new(None);
    p.activate(LINUX, None);
    let r = vm.pump(&mut p, &mut src, Instant::now());
    assert!(r.starved);
    assert_eq!((src.taken, p.undelivered()), (1, 1));
    assert_eq!(p.drop_held(), 1);
    assert_eq!((p.held(), p.undelivered()), (0, 0));
    vm.post(4);
    vm.pump(&mut p, &mut src, Instant::now());
    assert_eq!(vm.received().len(), 2, "the frame taken back never comes");

    // With RSC: the engine's pending packet goes too.
    let segs = stream(5, 1448);
    let mut src = Source::new(segs.iter().map(Tcp::build));
    let mut p = RxPump::new(Some(RscConfig::default()));
    p.activate(LINUX, Some(linux()));
    let mut vm = Vm::new();
    vm.post(8);
    let t = Instant::now();
    vm.pump(&mut p, &mut src, t);
    assert_eq!(p.undelivered(), 5);
    assert_eq!(p.drop_held(), 5);
    p.expire(t + DEFAULT_INTERVAL);
    assert_eq!((p.held(), p.undelivered(), p.next_deadline()), (0, 0, None));
}

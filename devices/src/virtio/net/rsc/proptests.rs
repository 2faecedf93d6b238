//! Property tests: random interleavings of flows must come out with every
//! payload byte exactly once and in order, within the size cap, with
//! checksums that verify; hostile frames must never panic.

use std::collections::HashMap;

use etherparse::PacketBuilder;
use proptest::prelude::*;

use super::testutil::*;
use super::*;

#[derive(Clone, Debug)]
struct FlowCfg {
    v6: bool,
    ts: bool,
    mss: usize,
    isn: u32,
    csum: Csum,
}

#[derive(Clone, Debug)]
enum Op {
    /// A data segment; `len` None: the flow's MSS.
    Data {
        flow: usize,
        len: Option<usize>,
        psh: bool,
    },
    /// A data segment lost on the way (the next ones arrive out of order).
    Lose {
        flow: usize,
    },
    /// An earlier segment sent again.
    Retransmit {
        flow: usize,
        back: usize,
    },
    /// A pure ACK, duplicate or advancing.
    Ack {
        flow: usize,
        dup: bool,
    },
    /// The flow's window changes.
    Win {
        flow: usize,
    },
    /// The flow's TSval moves on (and maybe TSecr).
    TsTick {
        flow: usize,
        ecr: bool,
    },
    Tick {
        us: u64,
    },
    Drain,
    /// A UDP frame.
    Other,
}

fn flow_cfg() -> impl Strategy<Value = FlowCfg> {
    (
        any::<bool>(),
        any::<bool>(),
        prop_oneof![Just(1448usize), Just(1460), 1..=1460usize],
        any::<u32>(),
        prop_oneof![Just(Csum::Full), Just(Csum::DataValid), Just(Csum::Partial)],
    )
        .prop_map(|(v6, ts, mss, isn, csum)| FlowCfg {
            v6,
            ts,
            mss,
            isn,
            csum,
        })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        24 => (0..4usize, prop_oneof![3 => Just(None), 1 => (1..=1460usize).prop_map(Some)],
              prop::bool::weighted(0.05))
            .prop_map(|(flow, len, psh)| Op::Data { flow, len, psh }),
        1 => (0..4usize).prop_map(|flow| Op::Lose { flow }),
        1 => (0..4usize, 0..8usize).prop_map(|(flow, back)| Op::Retransmit { flow, back }),
        2 => (0..4usize, any::<bool>()).prop_map(|(flow, dup)| Op::Ack { flow, dup }),
        2 => (0..4usize).prop_map(|flow| Op::Win { flow }),
        2 => (0..4usize, any::<bool>()).prop_map(|(flow, ecr)| Op::TsTick { flow, ecr }),
        4 => (0..400u64).prop_map(|us| Op::Tick { us }),
        2 => Just(Op::Drain),
        2 => Just(Op::Other),
    ]
}

/// A flow's sender.
struct Sender {
    cfg: FlowCfg,
    host: u8,
    /// Stream offset of the next new byte.
    off: u32,
    ack: u32,
    win: u16,
    ts: (u32, u32),
    /// Every segment made up, lost ones included: (stream offset, length).
    history: Vec<(u32, usize)>,
    /// The data segments fed, in order: (seq, payload).
    fed: Vec<(u32, Vec<u8>)>,
    acks: usize,
}

impl Sender {
    fn seg(&self, off: u32, len: usize) -> Tcp {
        let base = if self.cfg.v6 {
            Tcp::v6(0, 0)
        } else {
            Tcp::v4(0, 0)
        };
        base.with(|s| {
            s.host = self.host;
            s.seq = self.cfg.isn.wrapping_add(off);
            s.ack = self.ack;
            s.win = self.win;
            s.ts = self.cfg.ts.then_some(self.ts);
            s.csum = self.cfg.csum;
            s.payload = bytes(self.host, off, len);
        })
    }

    fn new_data(&mut self, len: usize) -> Tcp {
        let seg = self.seg(self.off, len);
        self.history.push((self.off, len));
        self.off = self.off.wrapping_add(len as u32);
        seg
    }

    fn feed(&mut self, h: &mut Harness, seg: Tcp) {
        if !seg.payload.is_empty() {
            self.fed.push((seg.seq, seg.payload.clone()));
        }
        h.feed(&seg);
    }
}

fn udp() -> Vec<u8> {
    let mut f = vec![0u8; 12];
    PacketBuilder::ethernet2([2, 0, 0, 0, 0, 9], [2, 0, 0, 0, 0, 0xfe])
        .ipv4([10, 0, 0, 9], [10, 0, 0, 254], 64)
        .udp(53, 53)
        .write(&mut f, &[7; 20])
        .unwrap();
    f
}

/// Per flow, what came out so far.
#[derive(Default)]
struct Got {
    /// Index into the sender's `fed` of the next segment expected out.
    next: usize,
    acks: usize,
    last_ack: Option<u32>,
}

fn run(cfg: RscConfig, flows: Vec<FlowCfg>, ops: Vec<Op>) -> Result<RscCounters, TestCaseError> {
    let mut h = Harness::new(cfg.clone());
    let mut senders: Vec<Sender> = flows
        .into_iter()
        .enumerate()
        .map(|(i, cfg)| Sender {
            cfg,
            host: i as u8 + 1,
            off: 0,
            ack: 1,
            win: 1000,
            ts: (1, 1),
            history: Vec::new(),
            fed: Vec::new(),
            acks: 0,
        })
        .collect();
    let n = senders.len();
    let mut others = 0;
    for op in ops {
        match op {
            Op::Data { flow, len, psh } => {
                let s = &mut senders[flow % n];
                let len = len.unwrap_or(s.cfg.mss);
                let seg = s.new_data(len).with(|t| t.psh = psh);
                s.feed(&mut h, seg);
            }
            Op::Lose { flow } => {
                let s = &mut senders[flow % n];
                let mss = s.cfg.mss;
                s.new_data(mss);
            }
            Op::Retransmit { flow, back } => {
                let s = &mut senders[flow % n];
                if let Some(&(off, len)) = s.history.iter().rev().nth(back) {
                    let seg = s.seg(off, len);
                    s.feed(&mut h, seg);
                }
            }
            Op::Ack { flow, dup } => {
                let s = &mut senders[flow % n];
                if !dup {
                    s.ack = s.ack.wrapping_add(1000);
                }
                s.acks += 1;
                let seg = s.seg(s.off, 0);
                s.feed(&mut h, seg);
            }
            Op::Win { flow } => senders[flow % n].win += 1,
            Op::TsTick { flow, ecr } => {
                let s = &mut senders[flow % n];
                s.ts.0 += 1;
                if ecr {
                    s.ts.1 += 1;
                }
            }
            Op::Tick { us } => h.advance(us),
            Op::Drain => h.drain(),
            Op::Other => {
                others += 1;
                h.feed_raw(&udp());
            }
        }
    }
    h.flush();
    let out = h.take();

    // Per flow, the data comes out exactly as it went in: same segments in
    // the same order, some glued together on segment boundaries.
    let mut got: HashMap<u8, Got> = HashMap::new();
    let mut udp_out = 0;
    for f in &out {
        if f == &udp() {
            udp_out += 1;
            continue;
        }
        let o = parse(f);
        prop_assert!(o.ip_len <= 65535);
        prop_assert_eq!(f.len(), 12 + 14 + o.ip_len, "no padding, no excess");
        check_checksums(f);
        prop_assert_eq!((o.sport, o.dport), (5001, 40000));
        let s = &senders[usize::from(o.host) - 1];
        let g = got.entry(o.host).or_default();
        if let Some(last) = g.last_ack {
            prop_assert!(
                o.tcp.acknowledgment_number.wrapping_sub(last) as i32 >= 0,
                "acks never go back"
            );
        }
        g.last_ack = Some(o.tcp.acknowledgment_number);
        if o.payload.is_empty() {
            g.acks += 1;
            continue;
        }
        prop_assert!(g.next < s.fed.len(), "more data out than in");
        prop_assert_eq!(o.tcp.sequence_number, s.fed[g.next].0, "in order");
        let mut glued = Vec::new();
        let mut segs = 0;
        while glued.len() < o.payload.len() && g.next < s.fed.len() {
            glued.extend_from_slice(&s.fed[g.next].1);
            g.next += 1;
            segs += 1;
        }
        prop_assert!(glued == o.payload, "flow {}: payload differs", s.host);
        if o.vnet.gso_type != 0 {
            let mss = usize::from(o.vnet.gso_size);
            prop_assert!(segs > 1);
            prop_assert!(o.payload.len() > mss);
            prop_assert_eq!(usize::from(o.vnet.hdr_len), o.tcp_off + o.tcp_hlen);
            if cfg.rsc_ext {
                prop_assert_eq!(usize::from(o.vnet.csum_start), segs);
                prop_assert_eq!(segs, o.payload.len().div_ceil(mss));
            }
        } else {
            prop_assert_eq!(segs, 1);
        }
    }
    prop_assert_eq!(udp_out, others);
    for s in &senders {
        let g = got.remove(&s.host).unwrap_or_default();
        prop_assert_eq!(g.next, s.fed.len(), "flow {}: data missing", s.host);
        prop_assert_eq!(g.acks, s.acks, "pure ACKs");
    }

    let c = h.rsc.counters();
    prop_assert_eq!(c.delivered, out.len() as u64);
    prop_assert_eq!(
        c.received,
        c.pass.total() + c.immediate + c.started + c.coalesced
    );
    prop_assert_eq!(c.delivered, c.pass.total() + c.immediate + c.flush.total());
    prop_assert_eq!(h.rsc.pending_flows(), 0);
    if std::env::var("RSC_DEBUG").is_ok() {
        eprintln!("{c:?}");
    }
    Ok(c.clone())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn interleaved_flows_come_out_whole_and_in_order(
        ext in any::<bool>(),
        flows in prop::collection::vec(flow_cfg(), 1..=4),
        ops in prop::collection::vec(op(), 1..250),
    ) {
        run(if ext { windows() } else { linux() }, flows, ops)?;
    }

    #[test]
    fn long_bulk_transfers_hit_the_size_cap(
        flow in flow_cfg().prop_map(|f| FlowCfg { mss: 1448 + f.mss % 13, ..f }),
        n in 40..300usize,
    ) {
        let ops = (0..n).map(|_| Op::Data { flow: 0, len: None, psh: false }).collect();
        let c = run(linux(), vec![flow.clone()], ops)?;
        let headers = if flow.v6 { 40 } else { 20 } + if flow.ts { 32 } else { 20 };
        let per_packet = (65535 - headers) / flow.mss;
        prop_assert_eq!(c.flush.size, ((n - 1) / per_packet) as u64);
        let lone_last = usize::from(n % per_packet == 1);
        prop_assert_eq!(c.coalesced_frames, (n.div_ceil(per_packet) - lone_last) as u64);
    }

    /// Mutated and truncated frames: never a panic, counters add up, and
    /// what comes out is either an input frame or a coalesced TCP packet.
    #[test]
    fn hostile_frames_never_panic(
        muts in prop::collection::vec(
            (0..6usize, any::<bool>(), 0..2000usize, any::<u8>(), 0..2000usize), 1..60),
    ) {
        let mut h = Harness::new(windows());
        let mut inputs = Vec::new();
        let mut base = Tcp::v4(0, 1000);
        for (kind, v6, at, byte, cut) in muts {
            base = base.next(1000).with(|s| s.v6 = v6);
            let mut f = base.build();
            match kind {
                0 => {}
                1 | 2 => {
                    let i = at % f.len();
                    f[i] = byte;
                }
                3 => f.truncate(cut % (f.len() + 1)),
                4 => {
                    let i = at % f.len();
                    f[i] ^= 1 << (byte % 8);
                    f[0] = byte & 3;
                }
                _ => f = vec![byte; cut % 100],
            }
            h.feed_raw(&f);
            inputs.push(f);
        }
        h.flush();
        let out = h.take();
        let c = h.rsc.counters();
        prop_assert_eq!(c.delivered, out.len() as u64);
        prop_assert_eq!(c.received, inputs.len() as u64);
        prop_assert_eq!(c.received, c.pass.total() + c.immediate + c.started + c.coalesced);
        for f in &out {
            if !inputs.contains(f) {
                let o = parse(f);
                prop_assert!(o.vnet.gso_type == 1 || o.vnet.gso_type == 4);
                prop_assert!(o.ip_len <= 65535);
            }
        }
    }

    /// Random bytes, including a vnet header saying DATA_VALID.
    #[test]
    fn random_bytes_never_panic(frames in prop::collection::vec(
        prop::collection::vec(any::<u8>(), 0..120), 1..20)) {
        let mut h = Harness::new(linux());
        for f in &frames {
            h.feed_raw(f);
        }
        h.flush();
        prop_assert_eq!(h.take().len() as u64, h.rsc.counters().delivered);
    }
}

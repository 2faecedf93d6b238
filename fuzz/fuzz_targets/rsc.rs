//! The receive-segment-coalescing engine fed with TCP segments of up to 64
//! flows built from fuzzer bytes (etherparse, right checksums unless the
//! input says otherwise), arbitrary frames, clock ticks, flushes and
//! reconfigurations. Invariants:
//! - no panic;
//! - every frame handed out is an input frame byte for byte, or a
//!   coalesced one no longer than the size cap (plus the vnet and Ethernet
//!   headers) with a TCP GSO type;
//! - the engine's counters add up (`RscCounters`), and count the frames
//!   really handed out;
//! - after a final flush, every input frame came out alone or merged, and
//!   the TCP payload bytes that went in came out (etherparse's view of
//!   each frame: their number and their sum).
//!
//! Input: byte 0: configuration (see `config`); then operations, each an
//! opcode byte and its arguments (see `Feed::op`).
#![no_main]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use devices::virtio::net::rsc::{Rsc, RscConfig, MAX_IP_LEN};
use libfuzzer_sys::fuzz_target;
use tandem_fuzz::frames::{tcp_payload, Csum, Segment, VNET_HDR_LEN};

const ETH_HLEN: usize = 14;
const FLOWS: usize = 64;

/// Byte 0: bit 0 GUEST_TSO4, 1 GUEST_TSO6, 2 GUEST_CSUM, 3 RSC_EXT, bits 4-7:
/// size cap (0: 65535, else 1024 × n).
fn config(b: u8) -> RscConfig {
    RscConfig {
        interval: Duration::from_micros(300),
        guest_tso4: b & 1 != 0,
        guest_tso6: b & 2 != 0,
        guest_csum: b & 4 != 0,
        rsc_ext: b & 8 != 0,
        max_size: match b >> 4 {
            0 => MAX_IP_LEN,
            n => 1024 * usize::from(n),
        },
    }
}

/// What one TCP flow has sent so far.
#[derive(Clone, Copy, Default)]
struct Flow {
    seq: u32,
    ack: u32,
    window: u16,
    tsval: u32,
    tsecr: u32,
}

struct Feed {
    rsc: Rsc,
    cap: usize,
    now: Instant,
    flows: [Flow; FLOWS],
    inputs: HashSet<Vec<u8>>,
    received: u64,
    out: Vec<Vec<u8>>,
    handed_out: u64,
    payload_in: (u64, u64),
    payload_out: (u64, u64),
}

fn add(a: &mut (u64, u64), b: (u64, u64)) {
    a.0 += b.0;
    a.1 += b.1;
}

impl Feed {
    fn new(cfg: RscConfig) -> Self {
        Feed {
            cap: cfg.max_size.min(MAX_IP_LEN),
            rsc: Rsc::new(cfg),
            now: Instant::now(),
            flows: [Flow {
                window: 512,
                ..Flow::default()
            }; FLOWS],
            inputs: HashSet::new(),
            received: 0,
            out: Vec::new(),
            handed_out: 0,
            payload_in: (0, 0),
            payload_out: (0, 0),
        }
    }

    /// Plays the operation at the start of `ops`; returns what is left.
    fn op<'a>(&mut self, ops: &'a [u8]) -> Option<&'a [u8]> {
        let (&code, rest) = ops.split_first()?;
        match code % 6 {
            0 | 1 => {
                let (args, rest) = rest.split_first_chunk::<11>()?;
                let frame = self.segment(args);
                self.input(frame);
                Some(rest)
            }
            2 => {
                let (&len, rest) = rest.split_first()?;
                let len = usize::from(len).min(rest.len());
                let (frame, rest) = rest.split_at(len);
                self.input(frame.to_vec());
                Some(rest)
            }
            3 => {
                let (us, rest) = rest.split_first_chunk::<2>()?;
                self.now += Duration::from_micros(u64::from(u16::from_le_bytes(*us)));
                self.rsc.drain_expired(self.now, &mut self.out);
                self.collect();
                Some(rest)
            }
            4 => {
                self.rsc.flush_all(&mut self.out);
                self.collect();
                Some(rest)
            }
            _ => {
                let (&b, rest) = rest.split_first()?;
                let cfg = config(b);
                let cap = cfg.max_size.min(MAX_IP_LEN);
                // What is flushed now was built under the old cap.
                self.rsc.reconfigure(cfg, &mut self.out);
                self.collect();
                self.cap = cap;
                Some(rest)
            }
        }
    }

    /// A segment of flow `a[0] & 63` (odd flows IPv6):
    /// a[1] TCP flags (ACK forced unless bit 0 of a[8]), a[2..4] payload
    /// length (up to 2048), a[4] sequence step (0: in order), a[5] ack
    /// step, a[6] window change, a[7] timestamp (bit 0 on, bits 1-3 TSval
    /// step - 2, bit 4 TSecr moves, bit 5 an MSS option too), a[8] header
    /// oddities (see below), a[9..11] a byte to XOR (offset, value).
    fn segment(&mut self, a: &[u8; 11]) -> Vec<u8> {
        let flow = usize::from(a[0]) % FLOWS;
        let len = usize::from(u16::from_le_bytes([a[2], a[3]])) % 2049;
        let f = &mut self.flows[flow];
        let seq = f.seq.wrapping_add((a[4] as i8 as i32 * 97) as u32);
        f.ack = f.ack.wrapping_add(a[5] as i8 as i32 as u32);
        f.window ^= u16::from(a[6]);
        let ts = a[7] & 1 != 0;
        if ts {
            f.tsval = f
                .tsval
                .wrapping_add(((a[7] >> 1) & 7) as u32)
                .wrapping_sub(2);
            if a[7] & 0x10 != 0 {
                f.tsecr = f.tsecr.wrapping_add(1);
            }
        }
        f.seq = seq.wrapping_add(len as u32);
        let odd = a[8];
        let mut frame = Segment {
            v6: flow & 1 != 0,
            host: flow as u8,
            seq,
            ack: f.ack,
            window: f.window,
            flags: if odd & 1 != 0 { a[1] } else { a[1] | 0x10 },
            ts: ts.then_some((f.tsval, f.tsecr)),
            extra_option: a[7] & 0x20 != 0,
            payload_len: len,
            stream: flow as u8,
            // bits 1-2: ECN; bit 3: another TOS.
            tos: ((odd >> 1) & 3) | ((odd & 8) << 2),
            ttl: 64,
            df: odd & 0x10 == 0,
            ip_options: odd & 0x20 != 0,
            bad_ip_csum: false,
            csum: match (odd >> 6) & 3 {
                0 => Csum::Full,
                1 => Csum::DataValid,
                2 => Csum::Partial,
                _ => Csum::Bad,
            },
            gso_type: 0,
        }
        .build();
        if a[10] != 0 {
            let at = usize::from(a[9]) % frame.len().max(1);
            if let Some(b) = frame.get_mut(at) {
                *b ^= a[10];
            }
        }
        frame
    }

    fn input(&mut self, frame: Vec<u8>) {
        add(&mut self.payload_in, tcp_payload(&frame));
        self.received += 1;
        self.rsc.input(&frame, self.now, &mut self.out);
        self.inputs.insert(frame);
        self.collect();
    }

    /// Checks and counts what the engine handed out.
    fn collect(&mut self) {
        for frame in self.out.drain(..) {
            self.handed_out += 1;
            add(&mut self.payload_out, tcp_payload(&frame));
            if self.inputs.contains(&frame) {
                continue;
            }
            // Coalesced: within the cap, a TCP GSO frame.
            let max = VNET_HDR_LEN + ETH_HLEN + self.cap;
            assert!(
                frame.len() <= max,
                "coalesced frame of {} > {max}",
                frame.len()
            );
            assert!(
                matches!(frame.get(1), Some(1 | 4)),
                "coalesced frame with gso_type {:?}",
                frame.get(1)
            );
        }
        let c = self.rsc.counters();
        assert_eq!(c.received, self.received, "received");
        assert_eq!(c.delivered, self.handed_out, "delivered");
        assert_eq!(
            c.received,
            c.pass.total() + c.immediate + c.started + c.coalesced,
            "received = pass + immediate + started + coalesced: {c:?}"
        );
        assert_eq!(
            c.delivered,
            c.pass.total() + c.immediate + c.flush.total(),
            "delivered = pass + immediate + flushes: {c:?}"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&cfg, mut ops)) = data.split_first() else {
        return;
    };
    let mut feed = Feed::new(config(cfg));
    while let Some(rest) = feed.op(ops) {
        ops = rest;
    }
    feed.rsc.flush_all(&mut feed.out);
    feed.collect();
    assert_eq!(feed.rsc.pending_flows(), 0, "flows after flush_all");
    let c = feed.rsc.counters().clone();
    assert_eq!(
        feed.handed_out,
        feed.received - c.coalesced,
        "every frame out, alone or merged"
    );
    assert_eq!(
        feed.payload_out, feed.payload_in,
        "TCP payload bytes out = in"
    );
});

//! The COLO compare engine (with its connection table and the TCP rewrite)
//! fed with frames from the primary guest, the secondary guest and the
//! client, clock ticks and checkpoints. Invariants:
//! - no panic;
//! - the counters add up (`Counters`' doc), and neither queue holds more
//!   than `max_queue` frames;
//! - every frame released is a primary input, byte for byte, released once;
//! - at most one checkpoint asked between two `checkpoint_done`s;
//! - a TCP segment's sequence moved by +d then -d (checksum updated) is
//!   the segment again, byte for byte (when its checksum is not 0xffff,
//!   which no sender computes);
//! - after a final `checkpoint_done`, nothing is held and every primary
//!   frame was released or dropped.
//!
//! Input: byte 0: configuration (see `config`); then events, each: a side
//! byte (`side % 5`: 0 primary, 1 secondary, 2 client, 3 tick, 4
//! checkpoint done; bit 3: the client frame's checksum is partial), a
//! length (u16, little endian, capped by what is left), that many frame
//! bytes (an Ethernet frame), and a time step (× 32 ms).
#![no_main]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use replication::compare::{Action, Compare, CompareConfig, QueueFull};
use replication::conntrack::ConnTrackConfig;
use replication::packet::{parse, Frame};
use replication::rewrite::{shift_seq, Csum};

/// Byte 0: bits 0-3 max_queue - 1, bit 4 the checkpoint policy, bits 5-7
/// the connection table's size - 1.
fn config(b: u8) -> CompareConfig {
    CompareConfig {
        compare_timeout: Duration::from_millis(3000),
        max_queue: 1 + usize::from(b & 15),
        queue_full: if b & 16 != 0 {
            QueueFull::Checkpoint
        } else {
            QueueFull::Drop
        },
        conntrack: ConnTrackConfig {
            max_entries: 1 + usize::from(b >> 5),
            ..ConnTrackConfig::default()
        },
    }
}

struct Feed {
    c: Compare,
    now: Instant,
    out: Vec<Action>,
    /// Primary inputs not released yet, by id.
    inputs: HashMap<u64, Vec<u8>>,
    next_id: u64,
    asked: bool,
}

impl Feed {
    fn event<'a>(&mut self, data: &'a [u8]) -> Option<&'a [u8]> {
        let (&side, rest) = data.split_first()?;
        let (len, rest) = rest.split_first_chunk::<2>()?;
        let len = usize::from(u16::from_le_bytes(*len)).min(rest.len());
        let (frame, rest) = rest.split_at(len);
        let (&dt, rest) = rest.split_first().unwrap_or((&0, &[]));
        self.now += Duration::from_millis(32 * u64::from(dt));
        there_and_back(frame, dt);
        match side % 5 {
            0 => {
                self.inputs.insert(self.next_id, frame.to_vec());
                self.next_id += 1;
                self.c.primary(frame.to_vec(), self.now, &mut self.out);
            }
            1 => self.c.secondary(frame, self.now, &mut self.out),
            2 => {
                let csum = if side & 8 != 0 {
                    Csum::Partial
                } else {
                    Csum::Full
                };
                let mut f = frame.to_vec();
                let tcp = self.c.client_to_secondary(&mut f, csum, self.now);
                assert!(tcp.is_ok(), "a parsed frame is long enough to rewrite");
            }
            3 => self.c.tick(self.now, &mut self.out),
            _ => self.done(),
        }
        self.check();
        Some(rest)
    }

    fn done(&mut self) {
        let why = self.c.pending();
        self.c.checkpoint_done(self.now, why, &mut self.out);
        self.check();
        self.asked = false;
    }

    fn check(&mut self) {
        for a in self.out.drain(..) {
            match a {
                Action::Release { id, frame } => {
                    let input = self.inputs.remove(&id.0);
                    assert_eq!(
                        input.as_ref(),
                        Some(&frame),
                        "frame {id:?} released as sent, once"
                    );
                }
                Action::Checkpoint(_) => {
                    assert!(!self.asked, "one checkpoint asked at a time");
                    self.asked = true;
                }
            }
        }
        let k = self.c.counters();
        let max = self.c.config().max_queue as u64;
        assert_eq!(k.primary_frames, self.next_id);
        assert_eq!(k.primary_frames, k.released + k.held + k.dropped_primary);
        assert_eq!(
            k.released,
            k.matched + k.passed_through + k.oversize + k.released_at_checkpoint
        );
        assert!(k.held <= max && k.held_secondary <= max);
        assert_eq!(self.inputs.len() as u64, k.held + k.dropped_primary);
    }
}

/// A TCP segment's sequence moved by +d then -d is the segment again.
fn there_and_back(frame: &[u8], dt: u8) {
    let Frame::Tcp(seg) = parse(frame) else {
        return;
    };
    let h = seg.header;
    if frame.get(h + 16..h + 18) == Some(&[0xff, 0xff]) {
        return;
    }
    let d = u32::from(dt).wrapping_mul(0x0101_0101).wrapping_add(1);
    let mut f = frame.to_vec();
    assert!(shift_seq(&mut f, &seg, d, Csum::Full).is_ok());
    assert!(shift_seq(&mut f, &seg, d.wrapping_neg(), Csum::Full).is_ok());
    assert_eq!(f, frame);
}

fuzz_target!(|data: &[u8]| {
    let Some((&cfg, mut ops)) = data.split_first() else {
        return;
    };
    let Ok(c) = Compare::new(config(cfg)) else {
        return;
    };
    let mut feed = Feed {
        c,
        now: Instant::now(),
        out: Vec::new(),
        inputs: HashMap::new(),
        next_id: 0,
        asked: false,
    };
    while let Some(rest) = feed.event(ops) {
        ops = rest;
    }
    feed.done();
    let k = feed.c.counters();
    assert_eq!((k.held, k.held_secondary), (0, 0));
    assert_eq!(feed.inputs.len() as u64, k.dropped_primary);
});

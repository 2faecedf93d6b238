//! One TCP connection in the compare: the primary's held segments and the
//! secondary's bytes, compared as two byte streams (see the rules in
//! [`super`]'s doc). Sequence numbers here are all in the primary's space
//! (the secondary's moved by the connection's offset).

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

use super::Held;
use crate::packet::{TcpFlags, TcpSeg};

/// `a ≤ b` in sequence space (RFC 1982 style, wrapping).
pub(super) fn seq_le(a: u32, b: u32) -> bool {
    b.wrapping_sub(a) < 0x8000_0000
}

fn seq_lt(a: u32, b: u32) -> bool {
    a != b && seq_le(a, b)
}

fn seq_max(a: Option<u32>, b: u32) -> Option<u32> {
    Some(a.map_or(b, |a| if seq_le(a, b) { b } else { a }))
}

/// A segment's positions, in the primary's space.
#[derive(Clone, Copy, Debug)]
pub(super) struct Span {
    /// The SYN's sequence number, if SYN.
    syn: Option<u32>,
    /// The first payload byte (after the SYN).
    data: u32,
    /// After the last payload byte: where a FIN is.
    end: u32,
    fin: bool,
    rst: bool,
    ack: Option<u32>,
}

impl Span {
    pub(super) fn of(seg: &TcpSeg, offset: u32) -> Span {
        let seq = seg.seq.wrapping_add(offset);
        let syn = seg.flags.has(TcpFlags::SYN);
        let data = seq.wrapping_add(u32::from(syn));
        Span {
            syn: syn.then_some(seq),
            data,
            end: data.wrapping_add(seg.payload_len()),
            fin: seg.flags.has(TcpFlags::FIN),
            rst: seg.flags.has(TcpFlags::RST),
            ack: seg.flags.has(TcpFlags::ACK).then_some(seg.ack),
        }
    }

    /// After the segment: its payload, and the FIN if any.
    fn reach(&self) -> u32 {
        self.end.wrapping_add(u32::from(self.fin))
    }
}

/// A held primary segment.
#[derive(Debug)]
struct Pending {
    id: u64,
    span: Span,
    /// The payload's offsets in the held frame.
    payload: Range<usize>,
}

/// What became of a secondary segment's payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Placed {
    /// Appended to the secondary's stream (at least in part).
    Added,
    /// Nothing new: no payload, or bytes already received.
    Nothing,
    /// Past a gap in the secondary's stream: ignored.
    Gap,
}

/// Per direction "as far as it went" marks; what is compared against.
#[derive(Clone, Copy, Debug, Default)]
struct Marks {
    reach: Option<u32>,
    ack: Option<u32>,
    syn: Option<u32>,
    fin: Option<u32>,
    rst: bool,
}

impl Marks {
    fn add(&mut self, s: &Span) {
        self.reach = seq_max(self.reach, s.reach());
        if let Some(a) = s.ack {
            self.ack = seq_max(self.ack, a);
        }
        if s.syn.is_some() {
            self.syn = s.syn;
        }
        if s.fin {
            self.fin = Some(s.end);
        }
        self.rst |= s.rst;
    }
}

/// One TCP connection's compare state.
#[derive(Debug, Default)]
pub(super) struct Stream {
    /// Held primary segments, in arrival order (released in that order).
    frames: VecDeque<Pending>,
    /// Every byte before this was compared (and matched) on both sides.
    base: Option<u32>,
    /// The secondary's bytes from `base` on, not compared yet.
    s_buf: VecDeque<u8>,
    /// The end of each secondary segment with bytes in `s_buf`.
    s_segs: VecDeque<u32>,
    primary: Marks,
    secondary: Marks,
    /// Secondary frames waiting for the connection's offset.
    pub(super) raw: VecDeque<Vec<u8>>,
    /// A mismatch was found: nothing more is compared until the
    /// checkpoint.
    diverged: bool,
}

impl Stream {
    /// Secondary frames this stream holds (segments with bytes not yet
    /// compared, and frames waiting for the offset).
    pub(super) fn secondary_held(&self) -> usize {
        self.s_segs.len() + self.raw.len()
    }

    /// Whether it holds nothing.
    pub(super) fn is_empty(&self) -> bool {
        self.frames.is_empty() && self.s_buf.is_empty() && self.raw.is_empty()
    }

    fn start(&mut self, span: &Span) {
        if self.base.is_none() {
            self.base = Some(span.data);
        }
    }

    /// A primary segment held as frame `id`.
    pub(super) fn primary(&mut self, id: u64, seg: &TcpSeg) {
        let span = Span::of(seg, 0);
        self.primary.add(&span);
        self.start(&span);
        self.frames.push_back(Pending {
            id,
            span,
            payload: seg.payload.clone(),
        });
    }

    /// A secondary segment (`payload` its bytes), moved by `offset`.
    pub(super) fn secondary(&mut self, seg: &TcpSeg, offset: u32, payload: &[u8]) -> Placed {
        let span = Span::of(seg, offset);
        self.secondary.add(&span);
        self.start(&span);
        let Some(base) = self.base else {
            return Placed::Nothing;
        };
        if payload.is_empty() || self.diverged {
            return Placed::Nothing;
        }
        let buffered = u32::try_from(self.s_buf.len()).unwrap_or(u32::MAX);
        let s_end = base.wrapping_add(buffered);
        if !seq_le(span.data, s_end) {
            return Placed::Gap;
        }
        let skip = usize::try_from(s_end.wrapping_sub(span.data)).unwrap_or(usize::MAX);
        match payload.get(skip..) {
            Some(new) if !new.is_empty() => {
                self.s_buf.extend(new);
                self.s_segs.push_back(span.end);
                Placed::Added
            }
            _ => Placed::Nothing,
        }
    }

    /// Compares the secondary's bytes with the held primary bytes at the
    /// same positions, as far as both go. `Err` on the first difference.
    pub(super) fn advance(&mut self, held: &BTreeMap<u64, Held>) -> Result<(), ()> {
        while !self.diverged && !self.s_buf.is_empty() {
            let Some(base) = self.base else { break };
            let Some(f) = self
                .frames
                .iter()
                .find(|f| seq_le(f.span.data, base) && seq_lt(base, f.span.end))
            else {
                break;
            };
            let skip = usize::try_from(base.wrapping_sub(f.span.data)).unwrap_or(usize::MAX);
            let bytes = held
                .get(&f.id)
                .and_then(|h| h.frame.get(f.payload.clone()))
                .and_then(|p| p.get(skip..))
                .unwrap_or(&[]);
            let n = bytes.len().min(self.s_buf.len());
            if n == 0 {
                break;
            }
            if !bytes.iter().take(n).eq(self.s_buf.iter().take(n)) {
                self.diverged = true;
                return Err(());
            }
            self.s_buf.drain(..n);
            let base = base.wrapping_add(u32::try_from(n).unwrap_or(u32::MAX));
            self.base = Some(base);
            while self.s_segs.front().is_some_and(|&end| seq_le(end, base)) {
                self.s_segs.pop_front();
            }
        }
        Ok(())
    }

    fn ready(&self, span: &Span) -> bool {
        let s = &self.secondary;
        if span.rst {
            return s.rst;
        }
        if span.data != span.end && !self.base.is_some_and(|b| seq_le(span.end, b)) {
            return false;
        }
        if span.syn.is_some() && s.syn != span.syn {
            return false;
        }
        if span.fin && s.fin != Some(span.end) {
            return false;
        }
        if span.data == span.end && span.syn.is_none() && !span.fin {
            // A pure ACK: the secondary went as far, and acked as much.
            let reached = s.reach.is_some_and(|r| seq_le(span.data, r));
            let acked = span
                .ack
                .is_none_or(|a| s.ack.is_some_and(|sa| seq_le(a, sa)));
            return reached && acked;
        }
        true
    }

    /// The ids of the held segments now matched, from the front, in order.
    pub(super) fn take_ready(&mut self, ids: &mut Vec<u64>) {
        if self.diverged {
            return;
        }
        while let Some(f) = self.frames.front() {
            if !self.ready(&f.span) {
                break;
            }
            ids.push(f.id);
            self.frames.pop_front();
        }
    }

    /// After a checkpoint: the held frames were released and the
    /// secondary is a copy of the primary, so it stands where the primary
    /// stands.
    pub(super) fn checkpoint_done(&mut self) {
        self.frames.clear();
        self.s_buf.clear();
        self.s_segs.clear();
        self.raw.clear();
        self.diverged = false;
        self.base = self.primary.reach;
        self.secondary = Marks {
            rst: false,
            ..self.primary
        };
    }
}

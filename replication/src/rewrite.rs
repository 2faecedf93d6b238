//! TCP sequence rewriting between the two guests' sequence spaces, in
//! place in a frame, with the TCP checksum updated incrementally
//! (RFC 1624, eqn. 3: `HC' = ~(~HC + ~m + m')`).
//!
//! The secondary guest picks its own initial sequence numbers, so each
//! TCP connection has an offset `primary_isn - secondary_isn`
//! ([`crate::conntrack`]). A segment the secondary guest sends is moved to
//! the primary's space (`seq += offset`: what the compare sees, and what
//! the client sees after a failover); a client segment mirrored to the
//! secondary is moved to the secondary's space (`ack -= offset`).
//!
//! Owns nothing: functions over a `&mut [u8]` frame and its
//! [`TcpSeg`] parse. Runs on the compare thread (and, after a failover,
//! on whichever thread forwards the survivor's frames). Never reads or
//! writes outside the TCP header's sequence, acknowledgment and checksum
//! fields, never panics on a frame that does not match its parse (an
//! error instead).

use thiserror::Error;

use crate::packet::{TcpFlags, TcpSeg};

/// What the TCP checksum field of a frame holds (virtio-net's
/// `VIRTIO_NET_HDR_F_NEEDS_CSUM` says which).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Csum {
    /// The full checksum: updated incrementally.
    Full,
    /// The pseudo-header sum only, to be completed by whoever sends the
    /// frame (checksum offload). Sequence and acknowledgment numbers are
    /// not in the pseudo-header: the field is left as is.
    Partial,
}

/// A rewrite that could not be done.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RewriteError {
    /// The frame is shorter than the TCP header its parse points at.
    #[error("frame of {len} bytes too short for a TCP header at offset {header}")]
    Truncated {
        /// The frame's length.
        len: usize,
        /// Where the parse said the TCP header starts.
        header: usize,
    },
}

const SEQ: usize = 4;
const ACK: usize = 8;
const CSUM: usize = 16;
const MIN_HEADER: usize = 20;

/// Moves a secondary guest's segment to the primary's sequence space:
/// `seq += offset`.
pub fn secondary_to_primary(
    frame: &mut [u8],
    seg: &TcpSeg,
    offset: u32,
    csum: Csum,
) -> Result<(), RewriteError> {
    shift_seq(frame, seg, offset, csum)
}

/// Moves a client segment, mirrored to the secondary, to the secondary's
/// sequence space: `ack -= offset` (only with the ACK flag: without it
/// the field means nothing and is left alone).
pub fn client_to_secondary(
    frame: &mut [u8],
    seg: &TcpSeg,
    offset: u32,
    csum: Csum,
) -> Result<(), RewriteError> {
    if !seg.flags.has(TcpFlags::ACK) {
        return Ok(());
    }
    shift_ack(frame, seg, offset.wrapping_neg(), csum)
}

/// Adds `delta` (wrapping) to the sequence number.
pub fn shift_seq(
    frame: &mut [u8],
    seg: &TcpSeg,
    delta: u32,
    csum: Csum,
) -> Result<(), RewriteError> {
    shift_field(frame, seg.header, SEQ, delta, csum)
}

/// Adds `delta` (wrapping) to the acknowledgment number.
pub fn shift_ack(
    frame: &mut [u8],
    seg: &TcpSeg,
    delta: u32,
    csum: Csum,
) -> Result<(), RewriteError> {
    shift_field(frame, seg.header, ACK, delta, csum)
}

fn shift_field(
    frame: &mut [u8],
    header: usize,
    field: usize,
    delta: u32,
    csum: Csum,
) -> Result<(), RewriteError> {
    let len = frame.len();
    let tcp = header
        .checked_add(MIN_HEADER)
        .and_then(|end| frame.get_mut(header..end))
        .ok_or(RewriteError::Truncated { len, header })?;
    let old = read_u32(tcp, field);
    let new = old.wrapping_add(delta);
    write_u32(tcp, field, new);
    if csum == Csum::Full {
        let hc = u16::from_be_bytes([tcp[CSUM], tcp[CSUM + 1]]);
        tcp[CSUM..CSUM + 2].copy_from_slice(&update_checksum(hc, old, new).to_be_bytes());
    }
    Ok(())
}

// `tcp` is 20 bytes long (checked by the caller) and `at` ≤ 16.
fn read_u32(tcp: &[u8], at: usize) -> u32 {
    let mut b = [0; 4];
    b.copy_from_slice(&tcp[at..at + 4]);
    u32::from_be_bytes(b)
}

fn write_u32(tcp: &mut [u8], at: usize, v: u32) {
    tcp[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

/// The checksum `hc` of data in which the 32-bit word `old` became `new`
/// (RFC 1624, eqn. 3, over its two 16-bit halves). Exact for any `hc`
/// a full computation can produce (never `0xffff` for a TCP segment).
pub fn update_checksum(hc: u16, old: u32, new: u32) -> u16 {
    let mut sum = u32::from(!hc);
    for (m, m2) in [(old >> 16, new >> 16), (old & 0xffff, new & 0xffff)] {
        sum += (!m & 0xffff) + m2;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    // The fold leaves at most 16 bits.
    !u16::try_from(sum).unwrap_or(u16::MAX)
}

#[cfg(test)]
#[path = "rewrite_tests.rs"]
mod tests;

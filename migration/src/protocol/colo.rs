//! The payloads of COLO's messages on the migration stream (see the
//! sequence in [`super`]): the pair's heartbeat timing, and the pages the
//! secondary's guest wrote, as spans of pages.
//!
//! Pure: encodes and decodes. Everything read is hostile: a span list is
//! decoded exactly (no trailing bytes, no empty span, no overflow), and is
//! checked against the receiver's layout with [`check_spans`] before it is
//! used.

use super::{ProtocolError, PAGE_SIZE};

/// The pair's heartbeat, set by the primary at `colo-start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How often the primary asks for a heartbeat, ms.
    pub heartbeat_ms: u32,
    /// The peer is lost when nothing came from it for this long, ms.
    pub timeout_ms: u32,
    /// Connections a checkpoint's pages are split over (1 to
    /// [`MAX_CHANNELS`]): 1, the stream itself; more, that many page
    /// channels opened after the network link.
    pub channels: u16,
}

/// The most page channels a pair may use.
pub const MAX_CHANNELS: u16 = 16;

impl Timing {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut p = self.heartbeat_ms.to_le_bytes().to_vec();
        p.extend_from_slice(&self.timeout_ms.to_le_bytes());
        p.extend_from_slice(&self.channels.to_le_bytes());
        p
    }

    pub(super) fn decode(p: &[u8]) -> Result<Timing, ProtocolError> {
        let malformed = |msg: String| ProtocolError::Malformed {
            command: "Protect",
            msg,
        };
        // 8 bytes: a pair without channels (as before they existed).
        let (b, channels): ([u8; 8], u16) = match p.len() {
            8 => (p.try_into().map_err(|_| malformed("8 bytes".into()))?, 1),
            10 => (
                p[..8]
                    .try_into()
                    .map_err(|_| malformed("10 bytes".into()))?,
                u16::from_le_bytes([p[8], p[9]]),
            ),
            n => return Err(malformed(format!("{n} bytes"))),
        };
        let t = Timing {
            heartbeat_ms: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            timeout_ms: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            channels,
        };
        if !(1..=MAX_CHANNELS).contains(&channels) {
            return Err(malformed(format!(
                "{channels} page channels (1 to {MAX_CHANNELS})"
            )));
        }
        if t.heartbeat_ms == 0 || t.timeout_ms <= t.heartbeat_ms {
            return Err(malformed(format!(
                "heartbeat {} ms with a timeout of {} ms",
                t.heartbeat_ms, t.timeout_ms
            )));
        }
        Ok(t)
    }
}

/// Pages `gpa..gpa + pages * PAGE_SIZE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub gpa: u64,
    pub pages: u32,
}

const SPAN_ENTRY: usize = 12;

pub(super) fn encode_spans(spans: &[Span]) -> Vec<u8> {
    let mut p = Vec::with_capacity(4 + SPAN_ENTRY * spans.len());
    p.extend_from_slice(&(spans.len() as u32).to_le_bytes());
    for s in spans {
        p.extend_from_slice(&s.gpa.to_le_bytes());
        p.extend_from_slice(&s.pages.to_le_bytes());
    }
    p
}

pub(super) fn decode_spans(command: &'static str, p: &[u8]) -> Result<Vec<Span>, ProtocolError> {
    let malformed = |msg: String| ProtocolError::Malformed { command, msg };
    let (count, rest) = p
        .split_first_chunk::<4>()
        .ok_or_else(|| malformed("no span count".into()))?;
    let count = u32::from_le_bytes(*count) as usize;
    if count.checked_mul(SPAN_ENTRY) != Some(rest.len()) {
        return Err(malformed(format!("{count} spans in {} bytes", rest.len())));
    }
    rest.chunks_exact(SPAN_ENTRY)
        .map(|e| {
            let mut gpa = [0u8; 8];
            gpa.copy_from_slice(&e[..8]);
            let mut pages = [0u8; 4];
            pages.copy_from_slice(&e[8..]);
            let s = Span {
                gpa: u64::from_le_bytes(gpa),
                pages: u32::from_le_bytes(pages),
            };
            if s.pages == 0 {
                return Err(malformed(format!("an empty span at {:#x}", s.gpa)));
            }
            Ok(s)
        })
        .collect()
}

/// Disk sums in one `Disks` message, at most.
pub const MAX_DISKS: usize = 64;

pub(super) fn encode_sums(sums: &[[u8; 32]]) -> Vec<u8> {
    let mut p = (sums.len() as u32).to_le_bytes().to_vec();
    for s in sums {
        p.extend_from_slice(s);
    }
    p
}

pub(super) fn decode_sums(p: &[u8]) -> Result<Vec<[u8; 32]>, ProtocolError> {
    let malformed = |msg: String| ProtocolError::Malformed {
        command: "Disks",
        msg,
    };
    let (count, rest) = p
        .split_first_chunk::<4>()
        .ok_or_else(|| malformed("no count".into()))?;
    let count = u32::from_le_bytes(*count) as usize;
    if count > MAX_DISKS || count * 32 != rest.len() {
        return Err(malformed(format!("{count} sums in {} bytes", rest.len())));
    }
    Ok(rest
        .chunks_exact(32)
        .map(|c| {
            let mut s = [0u8; 32];
            s.copy_from_slice(c);
            s
        })
        .collect())
}

/// The most bytes one `DiskWrite` carries.
pub const DISK_WRITE_MAX: usize = 1 << 20;

/// A write of the primary's guest to one of its disks, forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskWrite {
    /// The disk's index among the VM's disks (device order).
    pub disk: u32,
    /// Byte offset in the image.
    pub offset: u64,
    /// 1 to [`DISK_WRITE_MAX`] bytes.
    pub data: Vec<u8>,
}

impl DiskWrite {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(12 + self.data.len());
        p.extend_from_slice(&self.disk.to_le_bytes());
        p.extend_from_slice(&self.offset.to_le_bytes());
        p.extend_from_slice(&self.data);
        p
    }

    /// Decodes a payload (taken whole: the data is its tail). The range
    /// is checked against the disk by the receiver.
    pub(super) fn decode(mut p: Vec<u8>) -> Result<DiskWrite, ProtocolError> {
        let data_len = p.len().saturating_sub(12);
        if p.len() <= 12 || data_len > DISK_WRITE_MAX {
            return Err(ProtocolError::Malformed {
                command: "DiskWrite",
                msg: format!("{data_len} bytes of data (1 to {DISK_WRITE_MAX})"),
            });
        }
        let mut disk = [0u8; 4];
        disk.copy_from_slice(&p[..4]);
        let mut offset = [0u8; 8];
        offset.copy_from_slice(&p[4..12]);
        let data = p.split_off(12);
        Ok(DiskWrite {
            disk: u32::from_le_bytes(disk),
            offset: u64::from_le_bytes(offset),
            data,
        })
    }
}

/// Checks every span against `layout` (the receiver's regions as
/// `(gpa, length)`): page-aligned, each inside one region.
pub fn check_spans(spans: &[Span], layout: &[(u64, u64)]) -> Result<(), ProtocolError> {
    for s in spans {
        let bytes = u64::from(s.pages) * PAGE_SIZE;
        let inside = s.gpa.is_multiple_of(PAGE_SIZE)
            && s.gpa.checked_add(bytes).is_some_and(|end| {
                layout
                    .iter()
                    .any(|&(start, len)| s.gpa >= start && end <= start + len)
            });
        if !inside {
            return Err(ProtocolError::OutsideMemory {
                gpa: s.gpa,
                pages: s.pages,
            });
        }
    }
    Ok(())
}

/// The spans of consecutive pages among `pages` (sorted ascending).
pub fn spans_of(pages: impl IntoIterator<Item = u64>) -> Vec<Span> {
    let mut out: Vec<Span> = Vec::new();
    for gpa in pages {
        match out.last_mut() {
            Some(s) if s.gpa + u64::from(s.pages) * PAGE_SIZE == gpa && s.pages < u32::MAX => {
                s.pages += 1
            }
            _ => out.push(Span { gpa, pages: 1 }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::{read_message, write_message, Message};
    use super::*;

    fn round_trip(m: &Message) -> Result<Message, ProtocolError> {
        let mut buf = Vec::new();
        write_message(&mut buf, m)?;
        read_message(&mut buf.as_slice())
    }

    #[test]
    fn colo_messages_round_trip() {
        let spans = spans_of([0, 4096, 8192, 0x10_0000, 0x10_1000]);
        assert_eq!(
            spans,
            vec![
                Span { gpa: 0, pages: 3 },
                Span {
                    gpa: 0x10_0000,
                    pages: 2
                }
            ]
        );
        for m in [
            Message::Protect(Timing {
                heartbeat_ms: 100,
                timeout_ms: 1000,
                channels: 4,
            }),
            Message::Heartbeat,
            Message::Checkpoint { epoch: 7 },
            Message::Dirty(spans),
            Message::Dirty(Vec::new()),
            Message::Commit,
            Message::Committed,
            Message::Disks(vec![[7u8; 32], [0u8; 32]]),
            Message::Disks(Vec::new()),
            Message::DiskWrite(DiskWrite {
                disk: 1,
                offset: 4096,
                data: vec![9; 700],
            }),
        ] {
            assert_eq!(round_trip(&m).ok(), Some(m));
        }
    }

    #[test]
    fn bad_colo_payloads_are_refused() {
        assert!(Timing::decode(&[1, 0, 0, 0]).is_err());
        // A timeout not above the interval.
        assert!(Timing::decode(&[100, 0, 0, 0, 100, 0, 0, 0]).is_err());
        assert!(Timing::decode(&[0; 8]).is_err());
        // Without channels: one; none, or more than 16: refused.
        let old = [100, 0, 0, 0, 0xe8, 3, 0, 0];
        assert_eq!(Timing::decode(&old).map(|t| t.channels).ok(), Some(1));
        assert!(Timing::decode(&[100, 0, 0, 0, 0xe8, 3, 0, 0, 0, 0]).is_err());
        assert!(Timing::decode(&[100, 0, 0, 0, 0xe8, 3, 0, 0, 17, 0]).is_err());
        assert!(Timing::decode(&[100, 0, 0, 0, 0xe8, 3, 0, 0, 1]).is_err());
        // Count and bytes disagree; an empty span; a huge count.
        assert!(decode_spans("Dirty", &[2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]).is_err());
        assert!(decode_spans("Dirty", &[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(decode_spans("Dirty", &[0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(decode_spans("Dirty", &[]).is_err());
        assert!(decode_sums(&[1, 0, 0, 0]).is_err());
        assert!(decode_sums(&[65, 0, 0, 0]).is_err());
        // No data; too much data.
        assert!(DiskWrite::decode(vec![0; 12]).is_err());
        assert!(DiskWrite::decode(vec![0; 5]).is_err());
        assert!(DiskWrite::decode(vec![0; 12 + DISK_WRITE_MAX + 1]).is_err());
        assert!(DiskWrite::decode(vec![0; 12 + DISK_WRITE_MAX]).is_ok());
    }

    #[test]
    fn spans_outside_the_layout_are_refused() {
        let layout = [(0, 1 << 20)];
        let ok = [Span {
            gpa: 0xff000,
            pages: 1,
        }];
        assert!(check_spans(&ok, &layout).is_ok());
        for bad in [
            Span {
                gpa: 0xff000,
                pages: 2,
            },
            Span { gpa: 1, pages: 1 },
            Span {
                gpa: u64::MAX - 4095,
                pages: 1,
            },
        ] {
            assert!(check_spans(&[bad], &layout).is_err());
        }
    }
}

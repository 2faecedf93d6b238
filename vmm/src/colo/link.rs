//! The pair's network link: the frames the two proxies exchange on a
//! stream of their own (a second connection to the secondary's address),
//! framed and checked: the client's frames mirrored to the secondary, each
//! checkpoint's boundary in them, and the secondary guest's output sent
//! back to the primary's compare.
//!
//! ```text
//! 4   length L of what follows (at most MAX_LINK)
//! 1   kind: 1 client frame (primary -> secondary), 2 output (back),
//!     3 boundary (primary -> secondary)
//! 1   NIC index
//! 8   tag: a client frame's number on its NIC (the primary's guest got
//!     them in that order); an output's epoch (checkpoints committed when
//!     it was taken); a boundary's epoch
//! 4   offset: a client TCP segment's sequence offset (its ack was moved
//!     by it; the secondary keeps it for after a failover), else 0
//! L-14 the frame, virtio-net header first; a boundary's is 8 bytes: the
//!     number of the first client frame of that NIC the primary's guest
//!     had not taken when checkpoint `epoch` was taken
//! ```
//!
//! Pure: encodes into and decodes from byte buffers, for the proxies'
//! non-blocking streams. Everything read is the peer's: a length over
//! [`MAX_LINK`], an unknown kind or a frame shorter than its header is an
//! error, never an allocation past the bound.

use super::ColoError;

/// A client frame, mirrored to the secondary.
pub const CLIENT: u8 = 1;
/// A frame the secondary guest sent.
pub const OUTPUT: u8 = 2;
/// Where a checkpoint cut a NIC's client frames.
pub const BOUNDARY: u8 = 3;
/// The longest frame body taken: a 64 KiB GSO frame and its header.
pub const MAX_LINK: usize = HEAD + 12 + 65_550;
/// The bytes before the frame (after the length).
const HEAD: usize = 14;
/// Bytes kept for a slow peer before frames are dropped.
pub const MAX_PENDING: usize = 8 << 20;

/// One frame on the link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkFrame {
    pub kind: u8,
    pub nic: u8,
    /// See the module doc.
    pub tag: u64,
    pub offset: u32,
    pub frame: Vec<u8>,
}

/// Appends `f` to `out`.
pub fn encode(kind: u8, nic: u8, tag: u64, offset: u32, frame: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&((HEAD + frame.len()) as u32).to_le_bytes());
    out.push(kind);
    out.push(nic);
    out.extend_from_slice(&tag.to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(frame);
}

/// Bytes read from the link, cut into frames.
#[derive(Default)]
pub struct Decoder {
    buf: Vec<u8>,
}

impl Decoder {
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole frame, if one is there.
    pub fn next_frame(&mut self) -> Result<Option<LinkFrame>, ColoError> {
        let bad = ColoError::Link;
        let Some(head) = self.buf.first_chunk::<4>() else {
            return Ok(None);
        };
        let len = u32::from_le_bytes(*head) as usize;
        if !(HEAD..=MAX_LINK).contains(&len) {
            return Err(bad(format!("a frame of {len} bytes")));
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let body: Vec<u8> = self.buf.drain(..4 + len).skip(4).collect();
        let kind = body[0];
        if !(CLIENT..=BOUNDARY).contains(&kind) {
            return Err(bad(format!("kind {kind}")));
        }
        if kind == BOUNDARY && body.len() != HEAD + 8 {
            return Err(bad(format!("a boundary of {} bytes", body.len() - HEAD)));
        }
        let mut tag = [0u8; 8];
        tag.copy_from_slice(&body[2..10]);
        let mut offset = [0u8; 4];
        offset.copy_from_slice(&body[10..HEAD]);
        Ok(Some(LinkFrame {
            kind,
            nic: body[1],
            tag: u64::from_le_bytes(tag),
            offset: u32::from_le_bytes(offset),
            frame: body[HEAD..].to_vec(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_cut_anywhere_come_out_whole() {
        let mut bytes = Vec::new();
        encode(CLIENT, 0, 7, 5, &[1, 2, 3], &mut bytes);
        encode(OUTPUT, 1, 8, 0, &[9; 100], &mut bytes);
        for cut in 0..bytes.len() {
            let mut d = Decoder::default();
            d.push(&bytes[..cut]);
            let mut got = Vec::new();
            while let Some(f) = d.next_frame().unwrap() {
                got.push(f);
            }
            d.push(&bytes[cut..]);
            while let Some(f) = d.next_frame().unwrap() {
                got.push(f);
            }
            assert_eq!(got.len(), 2);
            assert_eq!(
                (got[0].frame.as_slice(), got[0].offset),
                (&[1u8, 2, 3][..], 5)
            );
            assert_eq!((got[1].kind, got[1].nic, got[1].tag), (OUTPUT, 1, 8));
        }
    }

    #[test]
    fn bad_frames_are_refused() {
        for bytes in [
            vec![0xff, 0xff, 0xff, 0x7f],
            vec![3, 0, 0, 0],
            vec![14, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            vec![10, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            vec![15, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7],
        ] {
            let mut d = Decoder::default();
            d.push(&bytes);
            assert!(d.next_frame().is_err(), "{bytes:?}");
        }
    }
}

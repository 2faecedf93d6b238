//! The payloads of post-copy's messages (`--postcopy`, see the sequence in
//! [`super`]): the page the destination's guest faulted on, and what the
//! destination tells the source once it holds every page: how many faults
//! waited on the link, and for how long.
//!
//! Pure: encodes and decodes. Everything read is hostile: each payload is
//! decoded exactly (its size); a requested page is checked against the
//! source's layout by the source ([`check_request`]) before it reads it.

use super::{ProtocolError, PAGE_SIZE};

/// Bytes of a `PageRequest` payload.
const REQUEST_BYTES: usize = 8;
/// Bytes of a `Done` payload: six counters.
const DONE_BYTES: usize = 48;

pub(super) fn encode_request(gpa: u64) -> Vec<u8> {
    gpa.to_le_bytes().to_vec()
}

pub(super) fn decode_request(p: &[u8]) -> Result<u64, ProtocolError> {
    <[u8; REQUEST_BYTES]>::try_from(p)
        .map(u64::from_le_bytes)
        .map_err(|_| ProtocolError::Malformed {
            command: "PageRequest",
            msg: format!("{} bytes", p.len()),
        })
}

/// Whether `gpa` is a page inside one of `layout`'s regions (`(gpa,
/// length)` each).
pub fn check_request(gpa: u64, layout: &[(u64, u64)]) -> Result<(), ProtocolError> {
    let inside = gpa.is_multiple_of(PAGE_SIZE)
        && layout
            .iter()
            .any(|&(start, len)| gpa >= start && gpa - start < len);
    if inside {
        Ok(())
    } else {
        Err(ProtocolError::OutsideMemory { gpa, pages: 1 })
    }
}

/// What the destination's guest waited for in post-copy, sent with `Done`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stalls {
    /// Faults on a page that had not arrived (each waited for the link).
    pub faults: u64,
    /// Pages asked for (a fault's page, once each).
    pub requested: u64,
    /// Pages that arrived without being asked for (the background copy).
    pub background: u64,
    /// A fault's wait, from the fault read to its page placed, µs: the
    /// median, the 99th percentile and the largest.
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

impl Stalls {
    pub(super) fn encode(&self) -> Vec<u8> {
        [
            self.faults,
            self.requested,
            self.background,
            self.p50_us,
            self.p99_us,
            self.max_us,
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
    }

    pub(super) fn decode(p: &[u8]) -> Result<Stalls, ProtocolError> {
        if p.len() != DONE_BYTES {
            return Err(ProtocolError::Malformed {
                command: "Done",
                msg: format!("{} bytes", p.len()),
            });
        }
        let v: Vec<u64> = p
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                u64::from_le_bytes(b)
            })
            .collect();
        Ok(Stalls {
            faults: v[0],
            requested: v[1],
            background: v[2],
            p50_us: v[3],
            p99_us: v[4],
            max_us: v[5],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_one_page_inside_the_layout() {
        let layout = [(0, 0x10_0000), (0x1_0000_0000, 0x1000)];
        assert!(check_request(0, &layout).is_ok());
        assert!(check_request(0xf_f000, &layout).is_ok());
        assert!(check_request(0x10_0000, &layout).is_err());
        assert!(check_request(0x1_0000_0000, &layout).is_ok());
        assert!(check_request(0x1_0000_1000, &layout).is_err());
        assert!(check_request(0x800, &layout).is_err());
        assert!(check_request(u64::MAX - 0xfff, &layout).is_err());
        assert!(decode_request(&[0; 7]).is_err());
        assert_eq!(decode_request(&encode_request(0x5000)).unwrap(), 0x5000);
    }

    #[test]
    fn stalls_round_trip_and_a_wrong_size_is_refused() {
        let s = Stalls {
            faults: 1,
            requested: 2,
            background: 3,
            p50_us: 4,
            p99_us: 5,
            max_us: 6,
        };
        assert_eq!(Stalls::decode(&s.encode()).unwrap(), s);
        assert!(Stalls::decode(&s.encode()[..40]).is_err());
    }
}

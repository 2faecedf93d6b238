//! The payloads of a multi-stream migration's messages (`--connections N`,
//! see the sequence in [`super`]): the main stream's `Streams`, which says
//! how many streams the migration uses and the token the others prove they
//! belong to it with, and each other stream's `Join`.
//!
//! Pure: encodes and decodes. Everything read is hostile: each payload is
//! decoded exactly (its size, no trailing bytes), a count outside 2 to
//! [`MAX_STREAMS`] and an index outside 1 to 15 are refused here; the
//! destination checks a `Join`'s token and index against its `Streams`
//! with [`Join::belongs`].

use super::ProtocolError;

/// The most streams one migration may use (the main one included).
pub const MAX_STREAMS: u16 = 16;
/// Bytes of the token that binds a migration's streams together.
pub const TOKEN_BYTES: usize = 16;

/// On the main stream, right after `Accept`: `count` streams in all (the
/// main one is stream 0); the others each start with `Join` and `token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Streams {
    pub count: u16,
    pub token: [u8; TOKEN_BYTES],
}

/// The first message after `Hello` on stream `index` (1 to count - 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Join {
    pub index: u16,
    pub token: [u8; TOKEN_BYTES],
}

/// 2 bytes (a count or an index), then the token.
fn encode(n: u16, token: &[u8; TOKEN_BYTES]) -> Vec<u8> {
    let mut p = n.to_le_bytes().to_vec();
    p.extend_from_slice(token);
    p
}

fn decode(
    command: &'static str,
    p: &[u8],
    valid: std::ops::RangeInclusive<u16>,
) -> Result<(u16, [u8; TOKEN_BYTES]), ProtocolError> {
    let malformed = |msg: String| ProtocolError::Malformed { command, msg };
    if p.len() != 2 + TOKEN_BYTES {
        return Err(malformed(format!("{} bytes", p.len())));
    }
    let n = u16::from_le_bytes([p[0], p[1]]);
    if !valid.contains(&n) {
        return Err(malformed(format!(
            "{n} is outside {} to {}",
            valid.start(),
            valid.end()
        )));
    }
    let mut token = [0u8; TOKEN_BYTES];
    token.copy_from_slice(&p[2..]);
    Ok((n, token))
}

impl Streams {
    pub(super) fn encode(&self) -> Vec<u8> {
        encode(self.count, &self.token)
    }

    pub(super) fn decode(p: &[u8]) -> Result<Streams, ProtocolError> {
        let (count, token) = decode("Streams", p, 2..=MAX_STREAMS)?;
        Ok(Streams { count, token })
    }
}

impl Join {
    pub(super) fn encode(&self) -> Vec<u8> {
        encode(self.index, &self.token)
    }

    pub(super) fn decode(p: &[u8]) -> Result<Join, ProtocolError> {
        let (index, token) = decode("Join", p, 1..=MAX_STREAMS - 1)?;
        Ok(Join { index, token })
    }

    /// Whether this stream is one of `streams`' (its token, an index below
    /// the count).
    pub fn belongs(&self, streams: &Streams) -> bool {
        self.index < streams.count && self.token == streams.token
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_indices_outside_their_ranges_are_refused() {
        let token = [7u8; TOKEN_BYTES];
        for count in [0, 1, MAX_STREAMS + 1, u16::MAX] {
            assert!(Streams::decode(&encode(count, &token)).is_err(), "{count}");
        }
        for count in [2, MAX_STREAMS] {
            let s = Streams::decode(&encode(count, &token)).unwrap();
            assert_eq!((s.count, s.token), (count, token));
        }
        assert!(Join::decode(&encode(0, &token)).is_err());
        assert!(Join::decode(&encode(MAX_STREAMS, &token)).is_err());
        assert!(Join::decode(&encode(3, &token)[..17]).is_err());
        let mut long = encode(3, &token);
        long.push(0);
        assert!(Join::decode(&long).is_err());
    }

    #[test]
    fn a_join_belongs_only_with_its_token_and_an_index_below_the_count() {
        let streams = Streams {
            count: 3,
            token: [1; TOKEN_BYTES],
        };
        let join = |index, token| Join { index, token };
        assert!(join(1, [1; TOKEN_BYTES]).belongs(&streams));
        assert!(join(2, [1; TOKEN_BYTES]).belongs(&streams));
        assert!(!join(3, [1; TOKEN_BYTES]).belongs(&streams));
        assert!(!join(1, [2; TOKEN_BYTES]).belongs(&streams));
    }
}

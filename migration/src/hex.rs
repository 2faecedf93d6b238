//! Serde helpers that write byte strings as lowercase hex and MAC addresses as `aa:bb:..`.
//!
//! Owns only the text form of tandem's own binary fields inside JSON state sections (FPU
//! registers, the UART's buffer, MAC addresses): hex is half the size of a JSON number
//! array and readable with `jq`. (The KVM structures are written as kvm-bindings writes
//! them, see [`crate::kvm_serde`].) Decoding refuses odd lengths and non-hex characters.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serializer};

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Encodes bytes as lowercase hex.
pub fn encode(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    s
}

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Decodes hex (either case); `None` on an odd length or a non-hex character.
pub fn decode(s: &str) -> Option<Vec<u8>> {
    let (pairs, rest) = s.as_bytes().as_chunks::<2>();
    if !rest.is_empty() {
        return None;
    }
    pairs
        .iter()
        .map(|[hi, lo]| Some(nibble(*hi)? << 4 | nibble(*lo)?))
        .collect()
}

/// `#[serde(with = "crate::hex")]` for `Vec<u8>`.
pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&encode(bytes))
}

/// `#[serde(with = "crate::hex")]` for `Vec<u8>`.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let s = String::deserialize(d)?;
    decode(&s).ok_or_else(|| D::Error::custom("expected an even number of hex digits"))
}

/// `#[serde(with = "crate::hex::mac")]` for `[u8; 6]`, written `52:54:00:12:34:56`.
pub mod mac {
    use super::*;

    /// Writes a MAC address.
    pub fn serialize<S: Serializer>(mac: &[u8; 6], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format(mac))
    }

    /// Reads a MAC address.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 6], D::Error> {
        let s = String::deserialize(d)?;
        parse(&s).ok_or_else(|| D::Error::custom(format!("{s:?} is not a MAC address")))
    }

    /// `aa:bb:cc:dd:ee:ff`.
    pub fn format(mac: &[u8; 6]) -> String {
        let parts: Vec<String> = mac.iter().map(|b| super::encode(&[*b])).collect();
        parts.join(":")
    }

    /// Parses `aa:bb:cc:dd:ee:ff`.
    pub fn parse(s: &str) -> Option<[u8; 6]> {
        let mut mac = [0u8; 6];
        let mut parts = s.split(':');
        for b in &mut mac {
            let part = parts.next()?;
            if part.len() != 2 {
                return None;
            }
            *b = *super::decode(part)?.first()?;
        }
        parts.next().is_none().then_some(mac)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_junk() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(decode(&encode(&all)).unwrap(), all);
        assert_eq!(decode("ABcd").unwrap(), vec![0xab, 0xcd]);
        assert!(decode("abc").is_none());
        assert!(decode("zz").is_none());
        assert_eq!(
            mac::parse("52:54:00:12:34:5f"),
            Some([0x52, 0x54, 0, 0x12, 0x34, 0x5f])
        );
        assert_eq!(
            mac::format(&[0x52, 0x54, 0, 0x12, 0x34, 0x5f]),
            "52:54:00:12:34:5f"
        );
        assert!(mac::parse("52:54:00:12:34").is_none());
        assert!(mac::parse("52:54:00:12:34:56:78").is_none());
        assert!(mac::parse("5:254:00:12:34:56").is_none());
    }
}

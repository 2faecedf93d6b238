//! The self-announce frame a migrated guest's NIC sends from its new place
//! (as QEMU's self-announce does): a RARP request from the guest's MAC to
//! the broadcast address, so that bridges and switches learn the MAC's new
//! port at once instead of when the guest next talks.
//!
//! Pure: builds bytes. The handler writes them to the backend
//! ([`super::handler::NetHandler::announce`]).

use super::backend::VNET_HDR_LEN;

/// RARP's EtherType.
const ETHERTYPE_RARP: u16 = 0x8035;
/// The shortest Ethernet frame without its FCS.
const MIN_FRAME: usize = 60;

/// A RARP "reverse request" from `mac`, padded to the minimum frame, after
/// an all-zero virtio-net header (no offloads).
pub fn rarp_frame(mac: [u8; 6]) -> Vec<u8> {
    let mut f = vec![0u8; VNET_HDR_LEN];
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&ETHERTYPE_RARP.to_be_bytes());
    f.extend_from_slice(&1u16.to_be_bytes()); // hardware: Ethernet
    f.extend_from_slice(&0x0800u16.to_be_bytes()); // protocol: IPv4
    f.extend_from_slice(&[6, 4]); // address lengths
    f.extend_from_slice(&3u16.to_be_bytes()); // reverse request
    f.extend_from_slice(&mac); // sender hardware address
    f.extend_from_slice(&[0; 4]); // sender protocol address
    f.extend_from_slice(&mac); // target hardware address
    f.extend_from_slice(&[0; 4]); // target protocol address
    f.resize(VNET_HDR_LEN + MIN_FRAME, 0);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rarp_request_from_the_mac_to_everyone() {
        let mac = [0x52, 0x54, 0, 0x12, 0x34, 0x56];
        let f = rarp_frame(mac);
        assert_eq!(f.len(), VNET_HDR_LEN + 60);
        let eth = &f[VNET_HDR_LEN..];
        let parsed = etherparse::Ethernet2Header::from_slice(eth).unwrap().0;
        assert_eq!(parsed.destination, [0xff; 6]);
        assert_eq!(parsed.source, mac);
        assert_eq!(parsed.ether_type.0, 0x8035);
        assert_eq!(&eth[14..22], &[0, 1, 8, 0, 6, 4, 0, 3]);
        assert_eq!(&eth[22..28], &mac);
        assert_eq!(&eth[32..38], &mac);
    }
}

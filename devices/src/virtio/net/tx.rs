//! TX: turns a guest descriptor chain into one frame for the tap.
//! Pure logic over guest memory; the chain is hostile input.

use crate::GuestMemoryMmap;
use virtio_queue::DescriptorChain;
use vm_memory::Bytes;

use super::backend::VNET_HDR_LEN;
use super::ChainError;

/// The largest frame a guest may send: header plus a 64 KiB GSO frame with
/// its Ethernet header (and a VLAN tag).
pub const MAX_TX_FRAME: usize = VNET_HDR_LEN + 65535 + 18;

/// Gathers the chain's (device-readable) buffers into `frame`.
pub fn gather(
    chain: DescriptorChain<&GuestMemoryMmap>,
    mem: &GuestMemoryMmap,
    frame: &mut Vec<u8>,
) -> Result<(), ChainError> {
    frame.clear();
    for desc in chain {
        if desc.is_write_only() {
            return Err(ChainError::WrongDirection);
        }
        let len = desc.len() as usize;
        if frame.len() + len > MAX_TX_FRAME {
            return Err(ChainError::TooLong);
        }
        let start = frame.len();
        frame.resize(start + len, 0);
        mem.read_slice(&mut frame[start..], desc.addr())
            .map_err(|_| ChainError::Memory)?;
    }
    if frame.len() < VNET_HDR_LEN {
        return Err(ChainError::TooShort);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use virtio_queue::QueueT;

    use super::*;
    use crate::virtio::test_util::{Driver, DATA};

    fn first(d: &Driver) -> Result<Vec<u8>, ChainError> {
        let mut q = d.queue();
        let chain = q.pop_descriptor_chain(&d.mem).expect("a chain");
        let mut f = Vec::new();
        gather(chain, &d.mem, &mut f).map(|_| f)
    }

    #[test]
    fn gathers_a_split_frame() {
        let mut d = Driver::new(16);
        d.write(DATA, &[1; 12]);
        d.write(DATA + 0x1000, &[2; 60]);
        d.add_chain(&[(DATA, 12, false), (DATA + 0x1000, 60, false)]);
        let f = first(&d).unwrap();
        assert_eq!(f.len(), 72);
        assert_eq!(&f[..12], &[1; 12]);
        assert_eq!(&f[12..], &[2; 60]);
    }

    #[test]
    fn rejects_hostile_chains() {
        let mut d = Driver::new(16);
        d.add_chain(&[(DATA, 8, false)]);
        assert_eq!(first(&d), Err(ChainError::TooShort));

        let mut d = Driver::new(16);
        d.add_chain(&[(DATA, 60, true)]);
        assert_eq!(first(&d), Err(ChainError::WrongDirection));

        let mut d = Driver::new(16);
        d.add_chain(&[(0xffff_0000_0000, 60, false)]);
        assert_eq!(first(&d), Err(ChainError::Memory));

        let mut d = Driver::new(16);
        d.add_chain(&[(DATA, 65535, false), (DATA, 65535, false)]);
        assert_eq!(first(&d), Err(ChainError::TooLong));

        // A loop: descriptor 0 -> 1 -> 0 ... ends (the queue's TTL), and
        // whatever was gathered stays bounded.
        let mut d = Driver::new(16);
        d.write_desc(0, DATA, 64, 1, 1);
        d.write_desc(1, DATA, 64, 1, 0);
        d.publish(0);
        let r = first(&d);
        assert!(
            matches!(r, Ok(ref f) if f.len() <= 16 * 64) || r.is_err(),
            "{r:?}"
        );
    }
}

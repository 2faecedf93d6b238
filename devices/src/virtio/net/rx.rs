//! RX: places one frame from the tap into the guest's receive buffers.
//! With MRG_RXBUF a frame may span several chains (their count goes in the
//! header's `num_buffers`); without it, one chain must hold it all. Pure
//! logic over guest memory; the chains are hostile input.

use crate::GuestMemoryMmap;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::ChainError;

const NUM_BUFFERS_OFFSET: usize = 10;

/// What happened to a frame.
#[derive(Debug, PartialEq, Eq)]
pub enum RxOutcome {
    /// Delivered into this many chains.
    Delivered(u16),
    /// Not enough buffers posted: nothing consumed, try again later.
    NoBuffers,
}

/// Delivers `frame` (virtio-net header included; its `num_buffers` field is
/// set here). On a malformed chain, the chains taken so far are returned to
/// the guest as used with length 0 and the frame is not delivered.
pub fn deliver(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    frame: &mut [u8],
    mergeable: bool,
) -> Result<RxOutcome, ChainError> {
    let start = queue.next_avail();
    // First pass: take chains until they can hold the frame.
    let mut chains: Vec<(u16, Vec<(GuestAddress, usize)>)> = Vec::new();
    let mut capacity = 0usize;
    while capacity < frame.len() {
        if !mergeable && !chains.is_empty() {
            give_back_empty(queue, mem, &chains);
            return Err(ChainError::BufferTooSmall);
        }
        let Some(chain) = queue.pop_descriptor_chain(mem) else {
            queue.set_next_avail(start);
            return Ok(RxOutcome::NoBuffers);
        };
        let head = chain.head_index();
        let mut bufs = Vec::new();
        let mut bad = None;
        for desc in chain {
            if !desc.is_write_only() {
                bad = Some(ChainError::WrongDirection);
                break;
            }
            let len = desc.len() as usize;
            if mem.get_slice(desc.addr(), len).map(|_| ()).is_err() {
                bad = Some(ChainError::Memory);
                break;
            }
            bufs.push((desc.addr(), len));
            capacity += len;
        }
        chains.push((head, bufs));
        if let Some(e) = bad {
            give_back_empty(queue, mem, &chains);
            return Err(e);
        }
    }
    if frame.len() >= NUM_BUFFERS_OFFSET + 2 {
        let n = chains.len() as u16;
        frame[NUM_BUFFERS_OFFSET..NUM_BUFFERS_OFFSET + 2].copy_from_slice(&n.to_le_bytes());
    }
    // Second pass: copy and complete.
    let mut off = 0usize;
    for (head, bufs) in &chains {
        let mut used = 0usize;
        for &(addr, len) in bufs {
            if off >= frame.len() {
                break;
            }
            let n = len.min(frame.len() - off);
            if mem.write_slice(&frame[off..off + n], addr).is_err() {
                give_back_empty(queue, mem, &chains);
                return Err(ChainError::Memory);
            }
            off += n;
            used += n;
        }
        if queue.add_used(mem, *head, used as u32).is_err() {
            return Err(ChainError::Memory);
        }
    }
    Ok(RxOutcome::Delivered(chains.len() as u16))
}

fn give_back_empty(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    chains: &[(u16, Vec<(GuestAddress, usize)>)],
) {
    for (head, _) in chains {
        let _ = queue.add_used(mem, *head, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::test_util::{Driver, DATA};

    fn frame(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn one_chain_holds_a_frame() {
        let mut d = Driver::new(16);
        d.add_chain(&[(DATA, 2048, true)]);
        let mut q = d.queue();
        let mut f = frame(1000);
        assert_eq!(
            deliver(&mut q, &d.mem, &mut f, true),
            Ok(RxOutcome::Delivered(1))
        );
        assert_eq!(d.used(), vec![(0, 1000)]);
        let got = d.read(DATA, 1000);
        assert_eq!(&got[10..12], &[1, 0], "num_buffers");
        assert_eq!(&got[12..], &frame(1000)[12..]);
    }

    #[test]
    fn mergeable_frame_spans_chains_and_waits_when_short() {
        let mut d = Driver::new(16);
        d.add_chain(&[(DATA, 1500, true)]);
        let mut q = d.queue();
        let mut f = frame(4000);
        assert_eq!(
            deliver(&mut q, &d.mem, &mut f, true),
            Ok(RxOutcome::NoBuffers)
        );
        assert!(d.used().is_empty(), "nothing consumed");
        d.add_chain(&[(DATA + 0x1000, 1500, true)]);
        d.add_chain(&[(DATA + 0x2000, 1500, true)]);
        assert_eq!(
            deliver(&mut q, &d.mem, &mut f, true),
            Ok(RxOutcome::Delivered(3))
        );
        assert_eq!(d.used(), vec![(0, 1500), (1, 1500), (2, 1000)]);
        assert_eq!(&d.read(DATA, 12)[10..12], &[3, 0]);
        let mut all = d.read(DATA, 1500);
        all.extend(d.read(DATA + 0x1000, 1500));
        all.extend(d.read(DATA + 0x2000, 1000));
        assert_eq!(&all[12..], &frame(4000)[12..]);
    }

    #[test]
    fn without_mergeable_a_small_buffer_is_an_error() {
        let mut d = Driver::new(16);
        d.add_chain(&[(DATA, 100, true)]);
        d.add_chain(&[(DATA + 0x1000, 100, true)]);
        let mut q = d.queue();
        let mut f = frame(150);
        assert_eq!(
            deliver(&mut q, &d.mem, &mut f, false),
            Err(ChainError::BufferTooSmall)
        );
        assert_eq!(d.used(), vec![(0, 0)]);
    }

    #[test]
    fn hostile_chains_are_returned_empty() {
        let mut d = Driver::new(16);
        d.add_chain(&[(DATA, 100, false)]);
        let mut q = d.queue();
        assert_eq!(
            deliver(&mut q, &d.mem, &mut frame(60), true),
            Err(ChainError::WrongDirection)
        );
        assert_eq!(d.used(), vec![(0, 0)]);

        let mut d = Driver::new(16);
        d.add_chain(&[(0xffff_ff00_0000, 100, true)]);
        let mut q = d.queue();
        assert_eq!(
            deliver(&mut q, &d.mem, &mut frame(60), true),
            Err(ChainError::Memory)
        );
        assert_eq!(d.used(), vec![(0, 0)]);
    }
}

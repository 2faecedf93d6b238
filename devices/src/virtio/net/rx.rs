//! RX: places one frame from the tap into the guest's receive buffers.
//! With MRG_RXBUF a frame may span several chains (their count goes in the
//! header's `num_buffers`); without it, one chain must hold it all. Pure
//! logic over guest memory; the chains are hostile input.

use std::sync::atomic::{fence, Ordering};

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
    /// `seen`: the driver's avail index looked at (the buffers before it
    /// do not hold the frame), for [`ask_for_buffers`].
    NoBuffers { seen: u16 },
}

/// The guest has too few buffers for the next frame (`deliver` looked up
/// to avail index `seen`): asks it to notify the device when it posts
/// more, and says whether it posted some since (then look again).
///
/// With EVENT_IDX the device names the avail index it wants to hear about
/// (`avail_event`). `enable_notification` names the next entry the device
/// has not taken, but a frame that needs several mergeable buffers leaves
/// the ones already posted untaken: the driver's next post is past that
/// index, so it would not notify, and receive would stop for good (seen:
/// a bulk TCP stream into the guest stalled at its first wait). So the
/// index asked for is the driver's current one, as vhost-net does.
pub fn ask_for_buffers(queue: &mut Queue, mem: &GuestMemoryMmap, seen: u16) -> bool {
    // Without EVENT_IDX: the driver notifies at every post now.
    let _ = queue.enable_notification(mem);
    if queue.event_idx_enabled() {
        let at = queue
            .used_ring()
            .checked_add(4 + 8 * u64::from(queue.size()))
            .map(GuestAddress);
        // A ring past guest memory: the driver gets no more frames.
        if at
            .map(|a| mem.write_obj(seen.to_le(), a))
            .is_none_or(|r| r.is_err())
        {
            return false;
        }
    }
    // The write above before the read below (the driver does the reverse).
    fence(Ordering::SeqCst);
    queue
        .avail_idx(mem, Ordering::Acquire)
        .is_ok_and(|now| now.0 != seen)
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
    // Only the buffers posted up to this index are looked at (see
    // `ask_for_buffers`); a ring past guest memory has none.
    let seen = queue
        .avail_idx(mem, Ordering::Acquire)
        .map_or(start, |i| i.0);
    // First pass: take chains until they can hold the frame.
    let mut chains: Vec<(u16, Vec<(GuestAddress, usize)>)> = Vec::new();
    let mut capacity = 0usize;
    while capacity < frame.len() {
        if !mergeable && !chains.is_empty() {
            give_back_empty(queue, mem, &chains);
            return Err(ChainError::BufferTooSmall);
        }
        let chain = match queue.next_avail() == seen {
            true => None,
            false => queue.pop_descriptor_chain(mem),
        };
        let Some(chain) = chain else {
            queue.set_next_avail(start);
            return Ok(RxOutcome::NoBuffers { seen });
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

    /// Whether a driver that moved its avail index from `old` to `new`
    /// notifies a device that asked for `event` (the spec's
    /// `vring_need_event`).
    fn driver_notifies(event: u16, new: u16, old: u16) -> bool {
        new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
    }

    #[test]
    fn a_short_wait_asks_for_the_drivers_next_buffer() {
        let mut d = Driver::new(16);
        d.add_chain(&[(DATA, 1500, true)]);
        let mut q = d.queue();
        q.set_event_idx(true);
        let mut f = frame(4000);
        let seen = match deliver(&mut q, &d.mem, &mut f, true) {
            Ok(RxOutcome::NoBuffers { seen }) => seen,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            (seen, q.next_avail()),
            (1, 0),
            "one buffer posted, none taken"
        );
        assert!(!ask_for_buffers(&mut q, &d.mem, seen), "none came since");
        let avail_event = crate::virtio::test_util::USED + 4 + 8 * 16;
        let event: u16 = d.mem.read_obj(GuestAddress(avail_event)).unwrap();
        assert_eq!(
            event, 1,
            "the index after the posted buffer, not the next untaken"
        );
        // The driver posts two more: it notifies (with the next untaken
        // entry, 0, it would not, and receive would stop).
        assert!(driver_notifies(event, 3, 1));
        assert!(!driver_notifies(0, 3, 1));
        d.add_chain(&[(DATA + 0x1000, 1500, true)]);
        d.add_chain(&[(DATA + 0x2000, 1500, true)]);
        assert_eq!(
            deliver(&mut q, &d.mem, &mut f, true),
            Ok(RxOutcome::Delivered(3))
        );
    }

    #[test]
    fn buffers_posted_while_asking_are_looked_at() {
        let mut d = Driver::new(16);
        d.add_chain(&[(DATA, 1500, true)]);
        let mut q = d.queue();
        q.set_event_idx(true);
        let mut f = frame(4000);
        assert_eq!(
            deliver(&mut q, &d.mem, &mut f, true),
            Ok(RxOutcome::NoBuffers { seen: 1 })
        );
        // Posted after `deliver` looked, before the device asked.
        d.add_chain(&[(DATA + 0x1000, 1500, true)]);
        assert!(ask_for_buffers(&mut q, &d.mem, 1), "look again");
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
            Ok(RxOutcome::NoBuffers { seen: 1 })
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

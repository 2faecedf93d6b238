//! The one loop that takes descriptor chains off a queue for a device
//! handler (virtio-net TX, virtio-blk), defensive against a hostile ring.
//!
//! Runs on the VMM thread, inside a handler's run; pure logic over guest
//! memory, unit-tested here over mock memory. The ring is guest memory, so
//! its indices are hostile input: an available index more than a queue
//! ahead of ours (virtio-queue refuses to iterate), or a ring that says more
//! is available yet yields nothing, ends the run and is counted as a fault,
//! instead of spinning on the VMM thread or panicking. A used ring the
//! device cannot write is counted the same way. With EVENT_IDX, an empty
//! ring re-enables notifications and is looked at once more, so a chain
//! published meanwhile is not left without a notification.
//!
//! virtio-net RX does not use it: RX is driven by frames, not by the
//! ring (a frame takes one chain, or several with mergeable buffers, and
//! waits in the backend when the ring is empty), so `rx::deliver` pops the
//! chains a frame needs itself; `pop_descriptor_chain` yields nothing for a
//! hostile index, and RX then waits for the guest's next notification
//! rather than spinning.
//!
//! Never does: hold the thread for a ring that does not move, log at a
//! level a guest can flood, look at what a chain holds (that is `serve`'s).

use crate::GuestMemoryMmap;
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};

/// What `serve` did with one chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// Done: return it to the guest as used, with this many bytes written.
    Used(u32),
    /// Not now (the backend would block): the chain goes back to the ring,
    /// untouched, and the run ends.
    PutBack,
}

/// How a run ended.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// Chains returned as used.
    pub used: usize,
    /// The run ended on [`Served::PutBack`].
    pub put_back: bool,
    /// Ring faults: a hostile available index, a ring that yields nothing
    /// while saying more is available, a used entry that cannot be written.
    pub faults: u64,
    /// Chains were used and the driver wants an interrupt for them.
    pub notify: bool,
}

/// Takes every chain the driver made available and hands it to `serve`,
/// until the ring is empty, `serve` puts one back, or the ring turns out
/// hostile.
pub fn drain(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    mut serve: impl FnMut(DescriptorChain<&GuestMemoryMmap>) -> Served,
) -> Drained {
    let mut out = Drained::default();
    // Whether the last look found a chain: two empty looks in a row, the
    // second after the ring said more is available, end the run.
    let mut popped = true;
    loop {
        let chain = match queue.iter(mem) {
            Ok(mut iter) => iter.next(),
            Err(e) => {
                // More than a queue's worth available, or a queue not ready.
                log::debug!("virtio: unusable available ring: {e}");
                out.faults += 1;
                break;
            }
        };
        let Some(chain) = chain else {
            if !popped {
                // More is "available", yet nothing can be taken (the ring
                // entry is outside guest memory).
                out.faults += 1;
                break;
            }
            popped = false;
            // With EVENT_IDX, re-enable notifications and look once more.
            match queue.enable_notification(mem) {
                Ok(true) => continue,
                _ => break,
            }
        };
        popped = true;
        let head = chain.head_index();
        match serve(chain) {
            Served::PutBack => {
                queue.go_to_previous_position();
                out.put_back = true;
                break;
            }
            Served::Used(len) => match queue.add_used(mem, head, len) {
                Ok(()) => out.used += 1,
                Err(e) => {
                    log::debug!("virtio: cannot return chain {head}: {e}");
                    out.faults += 1;
                }
            },
        }
    }
    out.notify = out.used > 0 && queue.needs_notification(mem).unwrap_or(true);
    out
}

#[cfg(test)]
mod tests {
    use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

    use super::*;
    use crate::virtio::test_util::{Driver, DATA};

    #[test]
    fn serves_every_chain_and_returns_it_used() {
        let mut d = Driver::new(16);
        for i in 0..5u64 {
            d.add_chain(&[(DATA + i * 0x100, 64, false)]);
        }
        let mut q = d.queue();
        let mut seen = Vec::new();
        let r = drain(&mut q, &d.mem, |c| {
            seen.push(c.head_index());
            Served::Used(u32::from(c.head_index()) + 1)
        });
        assert_eq!(seen, [0, 1, 2, 3, 4]);
        assert_eq!(
            r,
            Drained {
                used: 5,
                put_back: false,
                faults: 0,
                notify: true
            }
        );
        assert_eq!(d.used(), vec![(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]);
        // An empty ring: nothing served, nothing to signal.
        assert_eq!(
            drain(&mut q, &d.mem, |_| unreachable!()),
            Drained::default()
        );
    }

    #[test]
    fn a_chain_put_back_is_served_again_next_run() {
        let mut d = Driver::new(16);
        d.add_chain(&[(DATA, 64, false)]);
        d.add_chain(&[(DATA + 0x100, 64, false)]);
        let mut q = d.queue();
        let mut calls = 0;
        let r = drain(&mut q, &d.mem, |_| {
            calls += 1;
            if calls == 2 {
                Served::PutBack
            } else {
                Served::Used(0)
            }
        });
        assert!(r.put_back && r.used == 1 && r.faults == 0, "{r:?}");
        assert_eq!(d.used(), vec![(0, 0)]);
        let mut heads = Vec::new();
        let r = drain(&mut q, &d.mem, |c| {
            heads.push(c.head_index());
            Served::Used(0)
        });
        assert_eq!(heads, [1], "the chain put back comes first");
        assert!(!r.put_back && r.used == 1);
    }

    #[test]
    fn an_available_index_far_ahead_is_one_fault_and_no_chain() {
        for idx in [17u16, 1000, u16::MAX] {
            let mut d = Driver::new(16);
            d.add_chain(&[(DATA, 64, false)]);
            d.set_avail_idx(idx);
            let mut q = d.queue();
            let r = drain(&mut q, &d.mem, |_| panic!("nothing may be served"));
            assert_eq!(r.faults, 1, "avail idx {idx}");
            assert_eq!(r.used, 0);
            assert!(d.used().is_empty());
            // The next run (the next notify) fails the same way, once.
            assert_eq!(drain(&mut q, &d.mem, |_| Served::Used(0)).faults, 1);
        }
    }

    #[test]
    fn a_full_queue_ahead_is_still_served() {
        // Exactly a queue's worth available is legal.
        let mut d = Driver::new(16);
        for i in 0..16u64 {
            d.add_chain(&[(DATA + i * 0x100, 64, false)]);
        }
        let mut q = d.queue();
        let r = drain(&mut q, &d.mem, |_| Served::Used(0));
        assert_eq!((r.used, r.faults), (16, 0));
    }

    #[test]
    fn an_index_that_moves_ahead_during_the_run_ends_it() {
        // A guest that, while chains are served, pushes its index more than
        // a queue ahead: the chains before are used, then one fault.
        let mut d = Driver::new(16);
        d.add_chain(&[(DATA, 64, false)]);
        d.add_chain(&[(DATA + 0x100, 64, false)]);
        let mut q = d.queue();
        let r = drain(&mut q, &d.mem, |_| {
            d.set_avail_idx(500);
            Served::Used(0)
        });
        assert_eq!((r.used, r.faults), (1, 1), "{r:?}");
    }

    #[test]
    fn a_ring_outside_memory_is_a_fault_not_a_spin() {
        // The available ring's entries lie past the end of guest memory
        // while its index (the ring's first bytes) is readable.
        let d = Driver::new(16);
        let mut q = d.queue();
        let last = d.mem.last_addr().0;
        q.set_avail_ring_address(Some((last - 3) as u32), Some((last >> 32) as u32));
        d.mem.write_obj(3u16, GuestAddress(last - 1)).unwrap();
        let r = drain(&mut q, &d.mem, |_| panic!("nothing may be served"));
        assert_eq!((r.used, r.faults), (0, 1), "{r:?}");
    }

    #[test]
    fn a_used_ring_outside_memory_is_counted() {
        let mut d = Driver::new(16);
        d.add_chain(&[(DATA, 64, false)]);
        let mut q = d.queue();
        q.set_used_ring_address(Some(0xffff_f000), Some(0xff));
        let r = drain(&mut q, &d.mem, |_| Served::Used(0));
        assert_eq!((r.used, r.faults, r.notify), (0, 1, false), "{r:?}");
    }
}

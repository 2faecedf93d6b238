//! Post-copy's page requests through the source's reading of them, for the
//! `postcopy_requests` target: a guest of [`MEM`] whose every other run of
//! 8 pages is still to send.
//!
//! Invariants asserted (a panic is a finding): a page is taken at most
//! once, so the pages left plus the pages taken are the pages needed.

use vmm::migrate::postcopy::serve::{requests as read_requests, Needed};
use vmm::vstate::memory::DirtyBitmap;

/// The guest's memory.
pub const MEM: u64 = 4 << 20;

fn needed() -> Needed {
    let pages = MEM / 4096;
    let bits = (0..pages.div_ceil(64))
        .map(|_| 0x00ff_00ff_00ff_00ffu64)
        .collect();
    Needed::new(vec![DirtyBitmap {
        slot: 0,
        gpa: 0,
        pages,
        bits,
    }])
}

/// Runs the reading on `data`.
pub fn requests(data: &[u8]) {
    let mut n = needed();
    let total = n.left();
    let taken = match read_requests(data, &[(0, MEM)], &mut n) {
        Ok(t) => t,
        Err(_) => total - n.left(),
    };
    assert_eq!(n.left() + taken, total, "a page taken twice or lost");
    // The background finds exactly the pages left.
    let left = n.left();
    assert_eq!(n.next(left as usize + 1).len() as u64, left);
}

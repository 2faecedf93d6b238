//! Where a frame's time goes in the pair's proxies ([`super::proxy`]):
//! histograms of each stage, kept by the proxy's own thread and copied
//! into its side's report (`colo-status`, metrics). With the compare's
//! hold times ([`replication::compare::Holds`]: held until matched, or
//! until a checkpoint, and why) they give a frame's whole path:
//!
//! - primary: `tap_to_link` (a client frame read from the tap until its
//!   mirror is written to the link), `guest_reply` (a frame handed to the
//!   guest until the guest's next output on that NIC), `release_to_tap`
//!   (a released frame's write to the tap, waiting for room included);
//! - secondary: `link_to_guest` (a mirrored frame read from the link until
//!   handed to its guest), `guest_reply`, `guest_to_link` (its guest's
//!   output read until written to the link).
//!
//! Runs on the proxy's thread; pure bookkeeping, no I/O, bounded.

use std::collections::VecDeque;
use std::time::Instant;

use replication::histogram::Histogram;
use serde::Serialize;

/// The histograms (see the module doc); a stage a side does not have
/// stays empty.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Stages {
    pub tap_to_link: Histogram,
    pub link_to_guest: Histogram,
    pub guest_reply: Histogram,
    pub guest_to_link: Histogram,
    pub release_to_tap: Histogram,
}

/// Frames queued for the link, by the byte their encoding ends at, until
/// the link took that byte.
#[derive(Default)]
pub struct InFlight {
    queued: u64,
    written: u64,
    frames: VecDeque<(u64, Instant)>,
}

/// Most frames followed at once (the link's outbox is bounded too).
const MAX_FOLLOWED: usize = 4096;

impl InFlight {
    /// `bytes` were queued; `since`: when their frame was taken, to be
    /// timed (None: not timed).
    pub fn queued(&mut self, bytes: usize, since: Option<Instant>) {
        self.queued += bytes as u64;
        if let Some(t) = since {
            if self.frames.len() < MAX_FOLLOWED {
                self.frames.push_back((self.queued, t));
            }
        }
    }

    /// The link took `bytes` more at `now`: the frames it finished go into
    /// `h`.
    pub fn written(&mut self, bytes: usize, now: Instant, h: &mut Histogram) {
        self.written += bytes as u64;
        while let Some(&(end, t)) = self.frames.front() {
            if end > self.written {
                break;
            }
            h.record(now.saturating_duration_since(t));
            self.frames.pop_front();
        }
    }

    /// The link is gone: what was queued will never be written.
    pub fn lost(&mut self) {
        self.frames.clear();
        self.written = self.queued;
    }
}

/// Per NIC, when the guest was handed a frame it has not answered yet.
#[derive(Default)]
pub struct Replies {
    since: Vec<Option<Instant>>,
}

impl Replies {
    /// A frame went to guest `nic` at `now`.
    pub fn handed(&mut self, nic: usize, now: Instant) {
        if self.since.len() <= nic {
            self.since.resize(nic + 1, None);
        }
        self.since[nic].get_or_insert(now);
    }

    /// Guest `nic` sent a frame at `now`: the wait since the oldest frame
    /// it was handed and had not answered goes into `h`.
    pub fn sent(&mut self, nic: usize, now: Instant, h: &mut Histogram) {
        if let Some(t) = self.since.get_mut(nic).and_then(Option::take) {
            h.record(now.saturating_duration_since(t));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_frame_is_timed_when_its_last_byte_is_written() {
        let t0 = Instant::now();
        let mut f = InFlight::default();
        let mut h = Histogram::default();
        f.queued(100, Some(t0));
        f.queued(50, None);
        f.queued(100, Some(t0 + Duration::from_millis(1)));
        f.written(99, t0 + Duration::from_millis(2), &mut h);
        assert_eq!(h.count(), 0);
        f.written(1, t0 + Duration::from_millis(3), &mut h);
        assert_eq!((h.count(), h.max()), (1, Duration::from_millis(3)));
        f.written(150, t0 + Duration::from_millis(5), &mut h);
        assert_eq!((h.count(), h.max()), (2, Duration::from_millis(4)));
        f.queued(10, Some(t0));
        f.lost();
        f.written(10, t0 + Duration::from_millis(9), &mut h);
        assert_eq!(h.count(), 2);
    }

    #[test]
    fn a_reply_is_timed_from_the_oldest_unanswered_frame() {
        let t0 = Instant::now();
        let mut r = Replies::default();
        let mut h = Histogram::default();
        r.sent(1, t0, &mut h);
        assert_eq!(h.count(), 0);
        r.handed(1, t0);
        r.handed(1, t0 + Duration::from_millis(2));
        r.sent(1, t0 + Duration::from_millis(7), &mut h);
        r.sent(1, t0 + Duration::from_millis(8), &mut h);
        assert_eq!((h.count(), h.max()), (1, Duration::from_millis(7)));
    }
}

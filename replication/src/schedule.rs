//! Checkpoint scheduling: when the next checkpoint is due, and why
//! (design.md §6, Checkpoint).
//!
//! Owns the pending checkpoint request, the time of the last checkpoint,
//! the minimum gap between two checkpoints, and the checkpoint figures
//! ([`Stats`]). Run by the VMM thread or the checkpoint thread, whichever
//! drives the checkpoints; it is plain data, so one owner calls it.
//!
//! It never reads a clock (every call takes `now`), never sleeps, never
//! runs a checkpoint itself: it says when one is due and records what the
//! caller did.
//!
//! The rules:
//! - Requests coalesce: any number of requests before the checkpoint
//!   starts make one checkpoint; the first request's reason is the one
//!   counted, the others are counted as coalesced.
//! - A request made while a checkpoint runs is kept for the next one (the
//!   running checkpoint may already have captured the state it is about).
//! - The period counts from the end of the last checkpoint (or from the
//!   scheduler's creation, the initial sync counting as one).
//! - No checkpoint starts less than `min_gap` after the previous one
//!   ended, whatever its reason, so a mismatch storm cannot keep the guest
//!   paused back to back; `min_gap` is 0 by default (allowed).

use std::time::{Duration, Instant};

use serde::Serialize;

/// QEMU's default checkpoint period (`x-checkpoint-delay`, 20 s).
pub const DEFAULT_PERIOD: Duration = Duration::from_secs(20);

/// Why a checkpoint is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The compare saw primary and secondary output differ.
    Mismatch,
    /// A primary frame waited past the compare timeout.
    Timeout,
    /// The period elapsed since the last checkpoint.
    Period,
    /// A queue asked for one (the drop policy normally does not).
    Queue,
    /// An operator or another part of the VMM asked for one.
    Demand,
    /// The primary's disk writes since the last checkpoint reached the
    /// secondary journal's share (the journal is emptied by a commit).
    Disk,
}

/// Errors of the scheduler: calls out of order.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScheduleError {
    /// `started` while a checkpoint is already running.
    #[error("a checkpoint is already running")]
    AlreadyRunning,
    /// `finished` or `abandoned` without a running checkpoint.
    #[error("no checkpoint is running")]
    NotRunning,
}

/// The scheduler's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// A checkpoint is due this long after the last one ended.
    pub period: Duration,
    /// The least time between the end of one checkpoint and the start of
    /// the next, whatever the reason.
    pub min_gap: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            period: DEFAULT_PERIOD,
            min_gap: Duration::ZERO,
        }
    }
}

/// Checkpoints counted by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ByReason {
    pub mismatch: u64,
    pub timeout: u64,
    pub period: u64,
    pub queue: u64,
    pub demand: u64,
    pub disk: u64,
}

impl ByReason {
    fn count(&mut self, reason: Reason) {
        let slot = match reason {
            Reason::Mismatch => &mut self.mismatch,
            Reason::Timeout => &mut self.timeout,
            Reason::Period => &mut self.period,
            Reason::Queue => &mut self.queue,
            Reason::Demand => &mut self.demand,
            Reason::Disk => &mut self.disk,
        };
        *slot += 1;
    }
}

/// Checkpoint figures, as reported (JSON).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Stats {
    /// Checkpoints finished, in all.
    pub total: u64,
    /// Finished checkpoints by the reason they were taken for.
    pub by_reason: ByReason,
    /// Requests folded into a checkpoint already requested.
    pub coalesced: u64,
    /// Checkpoints started and then abandoned.
    pub abandoned: u64,
    pub last_pause_ms: f64,
    pub mean_pause_ms: f64,
    pub max_pause_ms: f64,
    pub last_bytes: u64,
    pub mean_bytes: u64,
    pub max_bytes: u64,
    pub total_bytes: u64,
}

/// Decides when a checkpoint is due; see the module doc for the rules.
#[derive(Debug, Clone)]
pub struct Scheduler {
    config: Config,
    /// The end of the last checkpoint (or the creation time).
    last_end: Instant,
    /// The first reason requested since the last checkpoint started.
    pending: Option<Reason>,
    /// The reason and start time of the running checkpoint.
    running: Option<(Reason, Instant)>,
    stats: Stats,
    total_pause: Duration,
}

impl Scheduler {
    /// A scheduler whose last checkpoint is `now` (the initial sync).
    pub fn new(config: Config, now: Instant) -> Self {
        Scheduler {
            config,
            last_end: now,
            pending: None,
            running: None,
            stats: Stats::default(),
            total_pause: Duration::ZERO,
        }
    }

    /// The settings in use.
    pub fn config(&self) -> Config {
        self.config
    }

    /// Asks for a checkpoint. Coalesces with a request already pending
    /// (the first reason is kept, this one is counted as coalesced).
    pub fn request(&mut self, reason: Reason, _now: Instant) {
        if self.pending.is_some() {
            self.stats.coalesced += 1;
        } else {
            self.pending = Some(reason);
        }
    }

    /// The pending request's reason, if any.
    pub fn pending(&self) -> Option<Reason> {
        self.pending
    }

    /// Whether a checkpoint is running (started, not yet finished).
    pub fn is_running(&self) -> bool {
        self.running.is_some()
    }

    /// The checkpoint to take now, if one is due: a pending request, or
    /// the period elapsed since the last checkpoint; never while one runs
    /// or before the minimum gap has passed.
    pub fn due(&self, now: Instant) -> Option<Reason> {
        if self.running.is_some() {
            return None;
        }
        let since = now.saturating_duration_since(self.last_end);
        if since < self.config.min_gap {
            return None;
        }
        match self.pending {
            Some(reason) => Some(reason),
            None if since >= self.config.period => Some(Reason::Period),
            None => None,
        }
    }

    /// How long the caller may wait before calling [`Self::due`] again
    /// (its poll timeout): zero when a checkpoint is due now. While a
    /// checkpoint runs nothing can become due before it finishes, so the
    /// period is returned as an upper bound.
    pub fn next_deadline(&self, now: Instant) -> Duration {
        if self.running.is_some() {
            return self.config.period;
        }
        let since = now.saturating_duration_since(self.last_end);
        let until = if self.pending.is_some() {
            self.config.min_gap
        } else {
            self.config.period.max(self.config.min_gap)
        };
        until.saturating_sub(since)
    }

    /// Records that a checkpoint started at `now` and returns the reason
    /// it counts under: the pending request's, else [`Reason::Period`].
    /// Requests made from now on wait for the next checkpoint.
    pub fn started(&mut self, now: Instant) -> Result<Reason, ScheduleError> {
        if self.running.is_some() {
            return Err(ScheduleError::AlreadyRunning);
        }
        let reason = self.pending.take().unwrap_or(Reason::Period);
        self.running = Some((reason, now));
        Ok(reason)
    }

    /// Records that the running checkpoint finished at `now`, having paused
    /// the guest for `pause` and sent `bytes`.
    pub fn finished(
        &mut self,
        now: Instant,
        pause: Duration,
        bytes: u64,
    ) -> Result<Reason, ScheduleError> {
        let (reason, _start) = self.running.take().ok_or(ScheduleError::NotRunning)?;
        self.last_end = now;
        self.total_pause = self.total_pause.saturating_add(pause);
        let s = &mut self.stats;
        s.total += 1;
        s.by_reason.count(reason);
        let pause_ms = pause.as_secs_f64() * 1000.0;
        s.last_pause_ms = pause_ms;
        s.max_pause_ms = s.max_pause_ms.max(pause_ms);
        s.last_bytes = bytes;
        s.max_bytes = s.max_bytes.max(bytes);
        s.total_bytes = s.total_bytes.saturating_add(bytes);
        Ok(reason)
    }

    /// Records that the running checkpoint was given up at `now` (the
    /// caller fails over or retries). Its reason is not requested again;
    /// the period and the gap count from `now`.
    pub fn abandoned(&mut self, now: Instant) -> Result<Reason, ScheduleError> {
        let (reason, _start) = self.running.take().ok_or(ScheduleError::NotRunning)?;
        self.last_end = now;
        self.stats.abandoned += 1;
        Ok(reason)
    }

    /// The figures so far, means included.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        if s.total > 0 {
            // Precision loss past 2^53 checkpoints is of no concern.
            #[allow(clippy::cast_precision_loss)]
            let total = s.total as f64;
            s.mean_pause_ms = self.total_pause.as_secs_f64() * 1000.0 / total;
            s.mean_bytes = s.total_bytes / s.total;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn sched(period: u64, gap: u64) -> (Scheduler, Instant) {
        let t0 = Instant::now();
        let config = Config {
            period: ms(period),
            min_gap: ms(gap),
        };
        (Scheduler::new(config, t0), t0)
    }

    #[test]
    fn default_is_qemus_period_without_gap() {
        let c = Config::default();
        assert_eq!(c.period, Duration::from_secs(20));
        assert_eq!(c.min_gap, Duration::ZERO);
    }

    #[test]
    fn period_elapses() {
        let (mut s, t0) = sched(1000, 0);
        assert_eq!(s.due(t0), None);
        assert_eq!(s.due(t0 + ms(999)), None);
        assert_eq!(s.next_deadline(t0 + ms(400)), ms(600));
        assert_eq!(s.due(t0 + ms(1000)), Some(Reason::Period));
        assert_eq!(s.next_deadline(t0 + ms(1500)), Duration::ZERO);
        assert_eq!(s.started(t0 + ms(1000)), Ok(Reason::Period));
        assert_eq!(s.due(t0 + ms(5000)), None, "nothing due while running");
        s.finished(t0 + ms(1100), ms(100), 4096).unwrap();
        assert_eq!(s.due(t0 + ms(2000)), None);
        assert_eq!(s.due(t0 + ms(2100)), Some(Reason::Period));
    }

    #[test]
    fn requests_coalesce_first_reason_counts() {
        let (mut s, t0) = sched(1000, 0);
        s.request(Reason::Mismatch, t0);
        s.request(Reason::Timeout, t0);
        s.request(Reason::Demand, t0);
        assert_eq!(s.due(t0), Some(Reason::Mismatch));
        assert_eq!(s.next_deadline(t0), Duration::ZERO);
        assert_eq!(s.started(t0), Ok(Reason::Mismatch));
        s.finished(t0 + ms(10), ms(10), 100).unwrap();
        assert_eq!(
            s.due(t0 + ms(10)),
            None,
            "one checkpoint for three requests"
        );
        let st = s.stats();
        assert_eq!(st.total, 1);
        assert_eq!(st.coalesced, 2);
        assert_eq!(st.by_reason.mismatch, 1);
        assert_eq!(st.by_reason.timeout, 0);
    }

    #[test]
    fn request_while_running_waits_for_the_next() {
        let (mut s, t0) = sched(1000, 0);
        s.request(Reason::Demand, t0);
        s.started(t0).unwrap();
        s.request(Reason::Mismatch, t0 + ms(1));
        assert_eq!(s.due(t0 + ms(2)), None);
        s.finished(t0 + ms(5), ms(5), 1).unwrap();
        assert_eq!(s.due(t0 + ms(5)), Some(Reason::Mismatch));
        assert_eq!(s.stats().coalesced, 0);
    }

    #[test]
    fn min_gap_holds_back_a_storm() {
        let (mut s, t0) = sched(10_000, 50);
        s.request(Reason::Mismatch, t0);
        assert_eq!(s.due(t0 + ms(49)), None);
        assert_eq!(s.next_deadline(t0 + ms(20)), ms(30));
        assert_eq!(s.due(t0 + ms(50)), Some(Reason::Mismatch));
        s.started(t0 + ms(50)).unwrap();
        s.finished(t0 + ms(60), ms(10), 1).unwrap();
        s.request(Reason::Mismatch, t0 + ms(61));
        assert_eq!(s.due(t0 + ms(100)), None);
        assert_eq!(s.due(t0 + ms(110)), Some(Reason::Mismatch));
    }

    #[test]
    fn zero_gap_allows_back_to_back() {
        let (mut s, t0) = sched(10_000, 0);
        for i in 0..5 {
            let t = t0 + ms(i);
            s.request(Reason::Mismatch, t);
            assert_eq!(s.due(t), Some(Reason::Mismatch));
            s.started(t).unwrap();
            s.finished(t, Duration::ZERO, 0).unwrap();
        }
        assert_eq!(s.stats().by_reason.mismatch, 5);
    }

    #[test]
    fn stats_last_mean_max() {
        let (mut s, t0) = sched(1000, 0);
        for (i, (p, b)) in [(10, 100), (30, 300), (20, 200)].into_iter().enumerate() {
            let t = t0 + ms(1000 * (i as u64 + 1));
            s.started(t).unwrap();
            s.finished(t, ms(p), b).unwrap();
        }
        let st = s.stats();
        assert_eq!(st.total, 3);
        assert_eq!(st.by_reason.period, 3);
        assert!((st.last_pause_ms - 20.0).abs() < 1e-9);
        assert!((st.max_pause_ms - 30.0).abs() < 1e-9);
        assert!((st.mean_pause_ms - 20.0).abs() < 1e-9);
        assert_eq!(
            (st.last_bytes, st.max_bytes, st.mean_bytes),
            (200, 300, 200)
        );
        assert_eq!(st.total_bytes, 600);
    }

    #[test]
    fn out_of_order_calls_are_errors() {
        let (mut s, t0) = sched(1000, 0);
        assert_eq!(s.finished(t0, ms(1), 1), Err(ScheduleError::NotRunning));
        assert_eq!(s.abandoned(t0), Err(ScheduleError::NotRunning));
        s.started(t0).unwrap();
        assert_eq!(s.started(t0), Err(ScheduleError::AlreadyRunning));
        assert!(s.is_running());
        assert_eq!(s.next_deadline(t0), ms(1000));
    }

    #[test]
    fn abandoned_restarts_the_period() {
        let (mut s, t0) = sched(1000, 0);
        s.request(Reason::Timeout, t0);
        s.started(t0).unwrap();
        assert_eq!(s.abandoned(t0 + ms(100)), Ok(Reason::Timeout));
        assert_eq!(s.due(t0 + ms(1099)), None);
        assert_eq!(s.due(t0 + ms(1100)), Some(Reason::Period));
        let st = s.stats();
        assert_eq!((st.total, st.abandoned), (0, 1));
    }
}

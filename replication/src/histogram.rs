//! Latency histograms for the pair's frame path: each duration counted in
//! a power-of-two bucket of microseconds (bucket `i` holds `[2^i, 2^(i+1))`
//! µs, bucket 0 also 0), with the count, the sum and the largest. Fixed
//! size (no allocation per sample); percentiles are read from the buckets
//! (the bucket's upper bound, never above the largest sample seen), so they
//! are within a factor of two, which is what "where does a frame wait"
//! needs.
//!
//! Pure data: callers pass the durations (no clock read here); never
//! panics, never grows.

use std::time::Duration;

use serde::{Serialize, Serializer};

const BUCKETS: usize = 32;

/// See the module doc.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Histogram {
    buckets: [u64; BUCKETS],
    count: u64,
    sum_us: u64,
    max_us: u64,
}

/// What a histogram shows: count, mean and percentiles, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    pub count: u64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Histogram {
    /// Counts one duration.
    pub fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let i = (u64::BITS - us.leading_zeros()).saturating_sub(1) as usize;
        self.buckets[i.min(BUCKETS - 1)] += 1;
        self.count += 1;
        self.sum_us = self.sum_us.saturating_add(us);
        self.max_us = self.max_us.max(us);
    }

    /// The samples counted.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The largest sample.
    pub fn max(&self) -> Duration {
        Duration::from_micros(self.max_us)
    }

    /// The `q` quantile (0 to 1): the upper bound of the bucket it falls
    /// in, at most the largest sample; zero with no samples.
    pub fn quantile(&self, q: f64) -> Duration {
        if self.count == 0 {
            return Duration::ZERO;
        }
        let rank = ((self.count as f64) * q.clamp(0.0, 1.0)).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let upper = (1u64 << (i + 1)).saturating_sub(1);
                return Duration::from_micros(upper.min(self.max_us));
            }
        }
        self.max()
    }

    /// Count, mean, p50, p90, p99 and max.
    pub fn summary(&self) -> Summary {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        Summary {
            count: self.count,
            mean_ms: if self.count == 0 {
                0.0
            } else {
                self.sum_us as f64 / self.count as f64 / 1000.0
            },
            p50_ms: ms(self.quantile(0.5)),
            p90_ms: ms(self.quantile(0.9)),
            p99_ms: ms(self.quantile(0.99)),
            max_ms: ms(self.max()),
        }
    }
}

impl Serialize for Histogram {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.summary().serialize(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_reads_zero() {
        let h = Histogram::default();
        assert_eq!(h.quantile(0.99), Duration::ZERO);
        assert_eq!(h.summary().count, 0);
        assert_eq!(h.summary().mean_ms, 0.0);
    }

    #[test]
    fn quantiles_fall_in_the_right_bucket_and_never_pass_the_max() {
        let mut h = Histogram::default();
        for _ in 0..98 {
            h.record(Duration::from_micros(300));
        }
        h.record(Duration::from_millis(40));
        h.record(Duration::from_millis(900));
        // 300 µs is in [256, 512).
        assert_eq!(h.quantile(0.5), Duration::from_micros(511));
        assert_eq!(h.quantile(0.98), Duration::from_micros(511));
        assert_eq!(h.quantile(0.99), Duration::from_micros(65535));
        assert_eq!(h.quantile(1.0), Duration::from_millis(900));
        assert_eq!(h.max(), Duration::from_millis(900));
        let s = h.summary();
        assert_eq!(s.count, 100);
        assert!((s.mean_ms - (98.0 * 0.3 + 40.0 + 900.0) / 100.0).abs() < 1e-9);
    }

    #[test]
    fn extremes_do_not_overflow() {
        let mut h = Histogram::default();
        h.record(Duration::ZERO);
        h.record(Duration::MAX);
        h.record(Duration::MAX);
        assert_eq!(h.count(), 3);
        assert_eq!(h.quantile(0.1), Duration::from_micros(1));
        assert_eq!(h.max(), Duration::from_micros(u64::MAX));
    }
}

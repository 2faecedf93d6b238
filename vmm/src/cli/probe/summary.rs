//! What a probe's records say, before vs during a migration: the guest's
//! gaps, ping loss and round trips per window, and the lines the migration
//! report prints.
//!
//! Pure data, run by whoever holds a [`ProbeData`] (after
//! [`super::Probe::finish`]); never fails: an empty window is all zeroes
//! and `None`s.
//!
//! What falls in a window: a gap by when it ended, a ping by when it was
//! sent, a datagram's maximum by its arrival.

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use super::ProbeData;

/// How many of the largest gaps a window lists.
pub const LARGEST: usize = 5;

/// The two windows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// `[0, during.0)`.
    pub before: Window,
    /// `[during.0, during.1]`.
    pub during: Window,
}

/// What one window of the timeline saw.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Window {
    pub secs: f64,
    /// The largest gaps, at most [`LARGEST`], largest first.
    pub largest_gaps_ms: Vec<f64>,
    pub gaps_over_100ms: u64,
    pub gaps_over_400ms: u64,
    /// The largest gap, reported as a gap or as a datagram's maximum (0:
    /// none).
    pub max_gap_ms: f64,
    pub pings: u64,
    pub lost: u64,
    /// `lost` in % of `pings` (0 without pings).
    pub loss_pct: f64,
    pub rtt_avg_ms: Option<f64>,
    pub rtt_max_ms: Option<f64>,
    /// Datagrams from the guest's tool.
    pub reports: u64,
}

/// Splits `data` at `during` (ms on its timeline).
pub fn summarize(data: &ProbeData, during: (f64, f64)) -> Summary {
    let (from, to) = during;
    Summary {
        before: window(data, |t| (0.0..from).contains(&t), from),
        during: window(data, |t| (from..=to).contains(&t), to - from),
    }
}

fn window(data: &ProbeData, inside: impl Fn(f64) -> bool, ms: f64) -> Window {
    let mut w = Window {
        secs: (ms / 1000.0).max(0.0),
        ..Window::default()
    };
    let mut gaps: Vec<f64> = Vec::new();
    for g in data.gaps.iter().filter(|g| inside(g.t_ms)) {
        gaps.push(g.gap_ms);
        w.gaps_over_100ms += u64::from(g.gap_ms > 100.0);
        w.gaps_over_400ms += u64::from(g.gap_ms > 400.0);
        w.max_gap_ms = w.max_gap_ms.max(g.gap_ms);
    }
    gaps.sort_by(|a, b| b.total_cmp(a));
    gaps.truncate(LARGEST);
    w.largest_gaps_ms = gaps;
    for &(_, max) in data
        .guest_max_gap_ms_by_report
        .iter()
        .filter(|(t, _)| inside(*t))
    {
        w.reports += 1;
        w.max_gap_ms = w.max_gap_ms.max(max);
    }
    let (mut sum, mut answered) = (0.0, 0u64);
    for p in data.pings.iter().filter(|p| inside(p.t_ms)) {
        w.pings += 1;
        match p.rtt_ms {
            Some(rtt) => {
                sum += rtt;
                answered += 1;
                w.rtt_max_ms = Some(w.rtt_max_ms.map_or(rtt, |m: f64| m.max(rtt)));
            }
            None => w.lost += 1,
        }
    }
    if w.pings > 0 {
        w.loss_pct = w.lost as f64 * 100.0 / w.pings as f64;
    }
    if answered > 0 {
        w.rtt_avg_ms = Some(sum / answered as f64);
    }
    w
}

impl Summary {
    /// A few aligned lines, a column per window, for the migration report.
    pub fn text(&self) -> String {
        let (b, d) = (&self.before, &self.during);
        let mut out = format!("{:<20}{:>12}{:>12}\n", "guest jitter", "before", "during");
        let mut row = |label: &str, f: &dyn Fn(&Window) -> String| {
            let _ = writeln!(out, "{label:<20}{:>12}{:>12}", f(b), f(d));
        };
        row("window (s)", &|w| format!("{:.1}", w.secs));
        row("max gap (ms)", &|w| format!("{:.1}", w.max_gap_ms));
        row("gaps > 100 ms", &|w| w.gaps_over_100ms.to_string());
        row("gaps > 400 ms", &|w| w.gaps_over_400ms.to_string());
        row("pings", &|w| w.pings.to_string());
        row("lost", &|w| format!("{} ({:.1}%)", w.lost, w.loss_pct));
        row("rtt avg (ms)", &|w| ms(w.rtt_avg_ms));
        row("rtt max (ms)", &|w| ms(w.rtt_max_ms));
        row("reports", &|w| w.reports.to_string());
        for (name, w) in [("before", b), ("during", d)] {
            let list: Vec<String> = w
                .largest_gaps_ms
                .iter()
                .map(|g| format!("{g:.1}"))
                .collect();
            let list = if list.is_empty() {
                "-".to_owned()
            } else {
                list.join(" ")
            };
            let _ = writeln!(out, "{:<20}{list}", format!("largest {name} (ms)"));
        }
        out
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.3}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::probe::{Gap, Ping};

    fn ping(t_ms: f64, rtt_ms: Option<f64>) -> Ping {
        Ping {
            t_ms,
            seq: 0,
            rtt_ms,
        }
    }

    fn gap(t_ms: f64, gap_ms: f64) -> Gap {
        Gap {
            t_ms,
            gap_ms,
            id: 0,
        }
    }

    fn data() -> ProbeData {
        ProbeData {
            pings: vec![
                ping(100.0, Some(0.2)),
                ping(200.0, Some(0.4)),
                ping(999.9, None),
                ping(1000.0, Some(1.0)),
                ping(1500.0, None),
                ping(2000.0, Some(3.0)),
                ping(2000.1, Some(9.0)), // after the window
            ],
            gaps: vec![
                gap(-5.0, 900.0), // before the probe: in no window
                gap(50.0, 12.0),
                gap(500.0, 150.0),
                gap(1000.0, 11.0),
                gap(1100.0, 450.0),
                gap(1200.0, 101.0),
                gap(1300.0, 100.0),
                gap(1400.0, 20.0),
                gap(1500.0, 30.0),
                gap(1600.0, 40.0),
                gap(2500.0, 999.0),
            ],
            guest_max_gap_ms_by_report: vec![(100.0, 2.0), (900.0, 160.0), (1500.0, 500.0)],
            ..ProbeData::default()
        }
    }

    #[test]
    fn windows_split_at_during() {
        let s = summarize(&data(), (1000.0, 2000.0));
        let b = &s.before;
        assert_eq!(b.secs, 1.0);
        assert_eq!(b.largest_gaps_ms, vec![150.0, 12.0]);
        assert_eq!((b.gaps_over_100ms, b.gaps_over_400ms), (1, 0));
        assert_eq!(b.max_gap_ms, 160.0, "a datagram's maximum counts");
        assert_eq!((b.pings, b.lost), (3, 1));
        assert!((b.loss_pct - 100.0 / 3.0).abs() < 1e-9);
        assert!((b.rtt_avg_ms.unwrap() - 0.3).abs() < 1e-9);
        assert_eq!(b.rtt_max_ms, Some(0.4));
        assert_eq!(b.reports, 2);

        let d = &s.during;
        assert_eq!(d.secs, 1.0);
        assert_eq!(d.largest_gaps_ms, vec![450.0, 101.0, 100.0, 40.0, 30.0]);
        assert_eq!(
            (d.gaps_over_100ms, d.gaps_over_400ms),
            (2, 1),
            "100 is not over 100"
        );
        assert_eq!(d.max_gap_ms, 500.0);
        assert_eq!((d.pings, d.lost), (3, 1));
        assert_eq!(d.rtt_avg_ms, Some(2.0));
        assert_eq!(d.rtt_max_ms, Some(3.0));
        assert_eq!(d.reports, 1);
    }

    #[test]
    fn empty_windows() {
        let s = summarize(&ProbeData::default(), (0.0, 0.0));
        assert_eq!(s.before, Window::default());
        assert_eq!(s.during, Window::default());
        let text = s.text();
        let row = "\nrtt avg (ms)                   -           -\n";
        assert!(text.contains(row), "{text}");
        assert!(text.contains("\nlargest before (ms) -\n"), "{text}");
    }

    #[test]
    fn text_is_aligned() {
        let text = summarize(&data(), (1000.0, 2000.0)).text();
        let expected = "\
guest jitter              before      during
window (s)                   1.0         1.0
max gap (ms)               160.0       500.0
gaps > 100 ms                  1           2
gaps > 400 ms                  0           1
pings                          3           3
lost                   1 (33.3%)   1 (33.3%)
rtt avg (ms)               0.300       2.000
rtt max (ms)               0.400       3.000
reports                        2           1
largest before (ms) 150.0 12.0
largest during (ms) 450.0 101.0 100.0 40.0 30.0
";
        assert_eq!(text, expected);
    }
}

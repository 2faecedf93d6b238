//! The migration jitter probe, the host's side: while a guest migrates, ping
//! it every few ms ([`icmp`]) and collect the gaps its `tandem-jitter` tool
//! reports over UDP ([`gaps`]), on one timeline with the migration's marks,
//! so the report can say what the guest felt before vs during the migration
//! ([`summary`]) and draw it ([`plot`]).
//!
//! Runs in the process that drives the migration (e.g. `tandem ctl`), not in
//! the VMM, and in that process's network namespace: both sockets are opened
//! by [`Probe::start`] on the calling thread. A [`Probe`] owns two threads,
//! the pinger and the gap collector; each keeps its own records and hands
//! them back when [`Probe::finish`] joins it, so they share nothing but a
//! stop flag and the clock. The caller's only shared state is the list of
//! marks, behind one short lock.
//!
//! Never does: panic or allocate without bound on what the guest sends (a
//! datagram is parsed into at most 32 gaps, and what is kept is capped), or
//! spawn a process; [`Probe::finish`] waits at most 1 s (for replies to the
//! last pings).

pub mod gaps;
pub mod icmp;
pub mod plot;
pub mod summary;

pub use plot::plot;
pub use summary::{summarize, Summary, Window};

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// The default ping interval.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(10);
/// The shortest and longest ping intervals [`Probe::start`] takes.
pub const MIN_INTERVAL: Duration = Duration::from_millis(1);
pub const MAX_INTERVAL: Duration = Duration::from_secs(10);

/// Why the probe could not start, or draw.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("ping interval {0:?} is out of range (1 ms to 10 s)")]
    Interval(Duration),
    #[error("cannot open an ICMP socket (raw: {raw}; datagram: {dgram})")]
    IcmpSocket {
        raw: std::io::Error,
        #[source]
        dgram: std::io::Error,
    },
    #[error("cannot aim the ICMP socket at {0}: {1}")]
    IcmpConnect(Ipv4Addr, #[source] std::io::Error),
    #[error("cannot listen on UDP {0}: {1}")]
    Listen(SocketAddr, #[source] std::io::Error),
    #[error("cannot start the probe's {0} thread: {1}")]
    Thread(&'static str, #[source] std::io::Error),
    #[error("cannot read the plot's font {0}: {1} (install the Debian package fonts-dejavu-core)")]
    Font(PathBuf, #[source] std::io::Error),
    #[error("the plot's font {0} is not a TrueType font the plotter can use")]
    FontInvalid(PathBuf),
    #[error("drawing {0}: {1}")]
    Plot(PathBuf, #[source] Box<dyn std::error::Error + Send + Sync>),
}

/// What to probe and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeConfig {
    /// The guest's address, pinged.
    pub guest: Ipv4Addr,
    /// Where the guest's `tandem-jitter` sends its datagrams (UDP).
    pub listen: SocketAddr,
    /// Ping every this long ([`DEFAULT_INTERVAL`]).
    pub interval: Duration,
}

impl ProbeConfig {
    /// Pings `guest` every [`DEFAULT_INTERVAL`], listens on `listen`.
    pub fn new(guest: Ipv4Addr, listen: SocketAddr) -> ProbeConfig {
        ProbeConfig {
            guest,
            listen,
            interval: DEFAULT_INTERVAL,
        }
    }
}

/// One echo request: when it was sent and its round trip.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Ping {
    /// When it was sent, ms on the probe's timeline.
    pub t_ms: f64,
    /// Counts the probe's pings from 0 (the wire carries its low 16 bits).
    pub seq: u64,
    /// The round trip; none: lost (no reply within 1 s, or not sent).
    pub rtt_ms: Option<f64>,
}

/// A gap the guest reported: its tool did not run for `gap_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Gap {
    /// When the gap ended, ms on the probe's timeline.
    pub t_ms: f64,
    pub gap_ms: f64,
    /// The tool's id for it (increasing).
    pub id: u64,
}

/// An instant the caller named ("migrate", "stop-and-copy", "done").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mark {
    pub t_ms: f64,
    pub label: String,
}

/// What a probe recorded. Times are ms since it started (monotonic).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProbeData {
    /// When it started, ms since the Unix epoch (wall clock), so another
    /// program can put its own events on this timeline.
    pub start_unix_ms: f64,
    /// The ping interval, ms.
    pub interval_ms: f64,
    /// Every ping, in order.
    pub pings: Vec<Ping>,
    /// Pings the kernel refused to send (counted lost in `pings` too).
    pub send_errors: u64,
    /// The guest's gaps, each once, in time order.
    pub gaps: Vec<Gap>,
    pub marks: Vec<Mark>,
    /// Valid datagrams from the guest's tool.
    pub reports: u64,
    /// Datagrams refused (malformed, too long, not `TJ1`).
    pub bad_datagrams: u64,
    /// Valid datagrams or gaps not kept because the probe's caps were
    /// reached ([`gaps::MAX_GAPS`], [`gaps::MAX_REPORTS`]).
    pub overflow: u64,
    /// The tool's loop wake-ups so far, from its latest datagram.
    pub guest_loops: u64,
    /// Per datagram: its arrival (ms) and the largest gap the tool saw
    /// since its previous datagram (ms), threshold or not.
    pub guest_max_gap_ms_by_report: Vec<(f64, f64)>,
}

/// The probe's timeline: ms since it started.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    start: Instant,
}

impl Clock {
    fn new() -> Clock {
        Clock {
            start: Instant::now(),
        }
    }

    /// `at` on the timeline, ms.
    pub fn ms(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.start).as_secs_f64() * 1000.0
    }

    /// Now on the timeline, ms.
    pub fn now_ms(&self) -> f64 {
        self.ms(Instant::now())
    }
}

/// A running probe. Dropping it stops it too (and discards its data).
pub struct Probe {
    clock: Clock,
    start_unix_ms: f64,
    interval: Duration,
    listen: SocketAddr,
    stop: Arc<AtomicBool>,
    marks: Mutex<Vec<Mark>>,
    pinger: Option<JoinHandle<icmp::PingLog>>,
    collector: Option<JoinHandle<gaps::GapLog>>,
}

impl Probe {
    /// Opens the sockets (in this thread's network namespace) and starts
    /// pinging and collecting.
    pub fn start(cfg: &ProbeConfig) -> Result<Probe, ProbeError> {
        if !(MIN_INTERVAL..=MAX_INTERVAL).contains(&cfg.interval) {
            return Err(ProbeError::Interval(cfg.interval));
        }
        let listen_err = |e| ProbeError::Listen(cfg.listen, e);
        let udp = UdpSocket::bind(cfg.listen).map_err(listen_err)?;
        let listen = udp.local_addr().map_err(listen_err)?;
        let pinger = icmp::Pinger::open(cfg.guest, cfg.interval)?;
        let clock = Clock::new();
        let start_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0);
        let stop = Arc::new(AtomicBool::new(false));
        let mut probe = Probe {
            clock,
            start_unix_ms,
            interval: cfg.interval,
            listen,
            stop: stop.clone(),
            marks: Mutex::new(Vec::new()),
            pinger: None,
            collector: None,
        };
        let s = stop.clone();
        probe.collector = Some(
            std::thread::Builder::new()
                .name("probe-gaps".into())
                .spawn(move || gaps::collect(&udp, clock, &s))
                .map_err(|e| ProbeError::Thread("gap collector", e))?,
        );
        // On an error here, dropping `probe` stops the collector.
        probe.pinger = Some(
            std::thread::Builder::new()
                .name("probe-ping".into())
                .spawn(move || pinger.run(clock, &stop))
                .map_err(|e| ProbeError::Thread("pinger", e))?,
        );
        Ok(probe)
    }

    /// Records `label` at this instant.
    pub fn mark(&self, label: &str) {
        let t_ms = self.now_ms();
        devices::sync::lock(&self.marks).push(Mark {
            t_ms,
            label: label.to_owned(),
        });
    }

    /// Now, ms since the probe started.
    pub fn now_ms(&self) -> f64 {
        self.clock.now_ms()
    }

    /// Where it listens for the guest's datagrams (the port, if
    /// [`ProbeConfig::listen`] gave 0).
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen
    }

    /// The probe's clock (for the caller's own timestamps).
    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// Stops the threads (waiting at most 1 s for the last pings' replies)
    /// and returns what they recorded.
    pub fn finish(mut self) -> ProbeData {
        self.stop.store(true, Ordering::SeqCst);
        let pings = join(self.pinger.take());
        let gaps = join(self.collector.take());
        let marks = std::mem::take(&mut *devices::sync::lock(&self.marks));
        ProbeData {
            start_unix_ms: self.start_unix_ms,
            interval_ms: self.interval.as_secs_f64() * 1000.0,
            pings: pings.pings,
            send_errors: pings.send_errors,
            gaps: gaps.gaps,
            marks,
            reports: gaps.reports,
            bad_datagrams: gaps.bad,
            overflow: gaps.overflow,
            guest_loops: gaps.loops,
            guest_max_gap_ms_by_report: gaps.by_report,
        }
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        join(self.pinger.take());
        join(self.collector.take());
    }
}

/// Joins a probe thread; one that panicked (a bug) left no records.
fn join<T: Default>(thread: Option<JoinHandle<T>>) -> T {
    match thread.map(JoinHandle::join) {
        Some(Ok(records)) => records,
        Some(Err(_)) => {
            log::error!("a jitter probe thread panicked; its records are lost");
            T::default()
        }
        None => T::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_bad_intervals() {
        let mut cfg = ProbeConfig::new(Ipv4Addr::LOCALHOST, "127.0.0.1:0".parse().unwrap());
        cfg.interval = Duration::from_micros(999);
        assert!(matches!(Probe::start(&cfg), Err(ProbeError::Interval(_))));
        cfg.interval = Duration::from_secs(11);
        assert!(matches!(Probe::start(&cfg), Err(ProbeError::Interval(_))));
    }

    #[test]
    fn listen_in_use_is_an_error() {
        let taken = UdpSocket::bind("127.0.0.1:0").unwrap();
        let cfg = ProbeConfig::new(Ipv4Addr::LOCALHOST, taken.local_addr().unwrap());
        let e = Probe::start(&cfg).err().unwrap();
        assert!(matches!(e, ProbeError::Listen(..)), "{e}");
    }

    /// The whole probe on loopback: it pings 127.0.0.1 and takes datagrams
    /// a test socket sends as the guest tool would.
    #[test]
    fn probes_loopback() {
        let cfg = ProbeConfig::new(Ipv4Addr::LOCALHOST, "127.0.0.1:0".parse().unwrap());
        let probe = Probe::start(&cfg).unwrap();
        let tool = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = probe.listen_addr();
        std::thread::sleep(Duration::from_millis(100));
        probe.mark("migrate");
        let sent_at = probe.now_ms();
        // Gap 1 ended 50 ms before the datagram was sent (guest at 10 s).
        tool.send_to(b"TJ1 0 10000000 1000 80000 1 1 9950000 80000\n", to)
            .unwrap();
        tool.send_to(b"TJ1 oops", to).unwrap();
        tool.send_to(&[b'7'; 5000], to).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        // Gap 1 again (a duplicate) and gap 2.
        tool.send_to(
            b"TJ1 1 10100000 2000 5000 2 1 9950000 80000 2 10090000 400000",
            to,
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(100));
        probe.mark("done");
        let data = probe.finish();

        assert!(data.start_unix_ms > 1.6e12, "{}", data.start_unix_ms);
        assert_eq!(data.interval_ms, 10.0);
        assert_eq!((data.reports, data.bad_datagrams, data.overflow), (2, 2, 0));
        assert_eq!(data.guest_loops, 2000);
        assert_eq!(data.gaps.len(), 2);
        let (g1, g2) = (data.gaps[0], data.gaps[1]);
        assert_eq!((g1.id, g1.gap_ms, g2.id, g2.gap_ms), (1, 80.0, 2, 400.0));
        // Mapped by arrival: about 50 ms before sending.
        let off = g1.t_ms - (sent_at - 50.0);
        assert!(
            (0.0..30.0).contains(&off),
            "gap 1 at {} (sent {sent_at})",
            g1.t_ms
        );
        assert_eq!(data.guest_max_gap_ms_by_report.len(), 2);
        assert_eq!(data.guest_max_gap_ms_by_report[0].1, 80.0);
        let labels: Vec<&str> = data.marks.iter().map(|m| m.label.as_str()).collect();
        assert_eq!(labels, ["migrate", "done"]);
        assert!(data.marks[0].t_ms >= 100.0 && data.marks[1].t_ms >= 300.0);

        let n = data.pings.len();
        assert!((15..=40).contains(&n), "{n} pings in 0.3 s");
        assert!(data
            .pings
            .iter()
            .all(|p| p.rtt_ms.is_some_and(|r| r < 50.0)));
        let s = summarize(&data, (data.marks[0].t_ms, data.marks[1].t_ms));
        assert_eq!(s.during.reports, 2);
        assert_eq!(
            s.before.largest_gaps_ms,
            vec![80.0],
            "ended before the mark"
        );
        assert_eq!(s.during.largest_gaps_ms, vec![400.0]);
        assert_eq!(s.during.lost, 0);
        assert!(s.before.pings >= 8, "{:?}", s.before);
    }

    #[test]
    fn two_probes_keep_their_own_replies() {
        let cfg = ProbeConfig::new(Ipv4Addr::LOCALHOST, "127.0.0.1:0".parse().unwrap());
        let (a, b) = (Probe::start(&cfg).unwrap(), Probe::start(&cfg).unwrap());
        std::thread::sleep(Duration::from_millis(200));
        let (a, b) = (a.finish(), b.finish());
        for d in [a, b] {
            // Each reply matched exactly one of its own pings.
            assert!(d.pings.iter().all(|p| p.rtt_ms.is_some()));
            assert!(d.pings.len() <= 25, "{}", d.pings.len());
        }
    }
}

//! Counts of the exits from `KVM_RUN` that reach the VMM, per kind and, for
//! port I/O, per port: on a host whose KVM emulates the guest kernel each
//! one costs the guest a round trip through the VMM, so the metrics show
//! what the guest pokes and how often.
//!
//! Bumped by the vCPU threads (one relaxed atomic add per exit, no lock),
//! read by the VMM thread for the metrics.

use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{json, Map, Value};

/// Ports below this are counted one by one; the rest together.
const PORTS: usize = 0x400;

/// The kinds of exit counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    IoIn,
    IoOut,
    MmioRead,
    MmioWrite,
    /// `KVM_RUN` returned EINTR: a kick (pause, profiler sample).
    Interrupted,
    /// Emulation failures completed or reported (`emulation.rs`).
    InternalError,
    /// HLT, IRQ window, shutdown, system events, anything else.
    Other,
}

const KINDS: [(&str, Kind); 7] = [
    ("io_in", Kind::IoIn),
    ("io_out", Kind::IoOut),
    ("mmio_read", Kind::MmioRead),
    ("mmio_write", Kind::MmioWrite),
    ("interrupted", Kind::Interrupted),
    ("internal_error", Kind::InternalError),
    ("other", Kind::Other),
];

/// The counters of one VM (all vCPUs).
pub struct ExitCounts {
    kinds: [AtomicU64; KINDS.len()],
    ports: Box<[AtomicU64]>,
    high_ports: AtomicU64,
}

impl Default for ExitCounts {
    fn default() -> Self {
        ExitCounts {
            kinds: Default::default(),
            ports: (0..PORTS).map(|_| AtomicU64::new(0)).collect(),
            high_ports: AtomicU64::new(0),
        }
    }
}

impl ExitCounts {
    /// Counts one exit of `kind`.
    pub fn count(&self, kind: Kind) {
        self.kinds[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one port access (in or out) at `port`, besides its kind.
    pub fn count_port(&self, kind: Kind, port: u16) {
        self.count(kind);
        match self.ports.get(usize::from(port)) {
            Some(c) => c.fetch_add(1, Ordering::Relaxed),
            None => self.high_ports.fetch_add(1, Ordering::Relaxed),
        };
    }

    /// The counts as JSON: each kind, the total, and the ports that were
    /// accessed (`"0x3f8": N`, ports from 0x400 up as `"high"`).
    pub fn json(&self) -> Value {
        let mut out = Map::new();
        let mut total = 0;
        for (name, kind) in KINDS {
            let n = self.kinds[kind as usize].load(Ordering::Relaxed);
            total += n;
            out.insert(name.into(), json!(n));
        }
        out.insert("total".into(), json!(total));
        let mut ports = Map::new();
        for (port, c) in self.ports.iter().enumerate() {
            let n = c.load(Ordering::Relaxed);
            if n > 0 {
                ports.insert(format!("{port:#x}"), json!(n));
            }
        }
        let high = self.high_ports.load(Ordering::Relaxed);
        if high > 0 {
            ports.insert("high".into(), json!(high));
        }
        out.insert("io_ports".into(), Value::Object(ports));
        Value::Object(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_and_ports_are_counted() {
        let c = ExitCounts::default();
        c.count_port(Kind::IoOut, 0x3f8);
        c.count_port(Kind::IoOut, 0x3f8);
        c.count_port(Kind::IoIn, 0x3fd);
        c.count_port(Kind::IoIn, 0xcf8);
        c.count(Kind::Interrupted);
        let j = c.json();
        assert_eq!(j["io_out"], 2);
        assert_eq!(j["io_in"], 2);
        assert_eq!(j["interrupted"], 1);
        assert_eq!(j["total"], 5);
        assert_eq!(j["io_ports"]["0x3f8"], 2);
        assert_eq!(j["io_ports"]["0x3fd"], 1);
        assert_eq!(j["io_ports"]["high"], 1);
        assert!(j["io_ports"].get("0x60").is_none());
    }
}

//! The TCP connection table: for each connection, the two guests' initial
//! sequence numbers (hence the secondary's offset), its state, and when it
//! was last seen.
//!
//! The guests are usually servers: their ISNs come from their SYN-ACKs; a
//! guest-initiated connection gives them in the guests' SYNs. Either way a
//! segment with SYN from guest X sets X's ISN. The offset is
//! `primary_isn - secondary_isn` (wrapping); for a connection whose SYNs
//! were never seen (opened before the secondary started from a
//! checkpoint) it is 0: the secondary is then a copy of the primary.
//!
//! Owns the table, bounded by `max_entries`: when full, the connection
//! seen least recently is evicted (and counted). A closed connection
//! (both FINs, or an RST from the guest or the client) lingers for
//! `closed_linger` (its last ACKs still need the offset), then
//! [`ConnTrack::expire`] removes it, as it removes a connection idle for
//! `idle_timeout`.
//!
//! Runs on the compare thread. Pure: the time is an argument, it never
//! reads a clock, never blocks, and never grows past its bound.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::packet::{ConnKey, TcpFlags, TcpSeg};

/// The table's bounds and timeouts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnTrackConfig {
    /// The most connections tracked.
    pub max_entries: usize,
    /// A connection not seen for this long is removed.
    pub idle_timeout: Duration,
    /// A closed connection is removed this long after it was last seen.
    pub closed_linger: Duration,
}

impl Default for ConnTrackConfig {
    fn default() -> Self {
        ConnTrackConfig {
            max_entries: 4096,
            idle_timeout: Duration::from_secs(600),
            closed_linger: Duration::from_secs(10),
        }
    }
}

/// A configuration refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConnTrackError {
    /// `max_entries` is 0.
    #[error("the connection table needs room for at least one connection")]
    NoRoom,
}

/// Who sent a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The primary guest.
    Primary,
    /// The secondary guest (its own sequence space).
    Secondary,
    /// The client (the far end, as seen on the primary's tap).
    Client,
}

/// A connection's state, as far as the table needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcpState {
    /// First seen without a SYN (opened before tracking began).
    Midstream,
    /// A SYN was seen, the handshake is not over.
    SynSeen,
    /// Past the handshake.
    Established,
    /// One side sent a FIN.
    Closing,
    /// Both sides sent a FIN, or the guest or the client an RST.
    Closed,
}

/// One tracked connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conn {
    /// The state.
    pub state: TcpState,
    /// The primary guest's ISN, once its SYN was seen.
    pub primary_isn: Option<u32>,
    /// The secondary guest's ISN, once its SYN was seen.
    pub secondary_isn: Option<u32>,
    /// The primary guest sent a FIN.
    pub guest_fin: bool,
    /// The client sent a FIN.
    pub client_fin: bool,
    /// When a segment was last seen.
    pub last_seen: Instant,
    stamp: u64,
}

impl Conn {
    /// The secondary's offset (`primary_isn - secondary_isn`), or `None`
    /// while the secondary's SYN is known and the primary's not yet (the
    /// secondary's segments must wait for it).
    pub fn offset(&self) -> Option<u32> {
        match (self.primary_isn, self.secondary_isn) {
            (Some(p), Some(s)) => Some(p.wrapping_sub(s)),
            (None, Some(_)) => None,
            _ => Some(0),
        }
    }

    fn fresh(now: Instant, stamp: u64) -> Conn {
        Conn {
            state: TcpState::Midstream,
            primary_isn: None,
            secondary_isn: None,
            guest_fin: false,
            client_fin: false,
            last_seen: now,
            stamp,
        }
    }
}

/// The connection table.
#[derive(Debug)]
pub struct ConnTrack {
    cfg: ConnTrackConfig,
    map: HashMap<ConnKey, Conn>,
    // Last-seen order: stamp → key, the oldest first.
    lru: BTreeMap<u64, ConnKey>,
    next_stamp: u64,
    evictions: u64,
}

impl ConnTrack {
    /// An empty table.
    pub fn new(cfg: ConnTrackConfig) -> Result<ConnTrack, ConnTrackError> {
        if cfg.max_entries == 0 {
            return Err(ConnTrackError::NoRoom);
        }
        Ok(ConnTrack {
            cfg,
            map: HashMap::new(),
            lru: BTreeMap::new(),
            next_stamp: 0,
            evictions: 0,
        })
    }

    /// Records a segment `side` sent; returns its connection.
    pub fn observe(&mut self, seg: &TcpSeg, side: Side, now: Instant) -> &Conn {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        if let Some(conn) = self.map.get(&seg.conn) {
            self.lru.remove(&conn.stamp);
        } else if self.map.len() >= self.cfg.max_entries {
            if let Some((_, oldest)) = self.lru.pop_first() {
                self.map.remove(&oldest);
                self.evictions += 1;
            }
        }
        self.lru.insert(stamp, seg.conn);
        let conn = self
            .map
            .entry(seg.conn)
            .or_insert_with(|| Conn::fresh(now, stamp));
        conn.last_seen = now;
        conn.stamp = stamp;
        update(conn, seg, side, now);
        conn
    }

    /// The connection of `key`, if tracked.
    pub fn get(&self, key: &ConnKey) -> Option<&Conn> {
        self.map.get(key)
    }

    /// The offset of `key`'s connection: see [`Conn::offset`]; 0 for a
    /// connection not tracked.
    pub fn offset(&self, key: &ConnKey) -> Option<u32> {
        self.map.get(key).map_or(Some(0), Conn::offset)
    }

    /// Removes the closed connections past their linger and the idle
    /// ones; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let before = self.map.len();
        let cfg = &self.cfg;
        let lru = &mut self.lru;
        self.map.retain(|_, c| {
            let idle = now.saturating_duration_since(c.last_seen);
            let keep = idle < cfg.idle_timeout
                && !(c.state == TcpState::Closed && idle >= cfg.closed_linger);
            if !keep {
                lru.remove(&c.stamp);
            }
            keep
        });
        before - self.map.len()
    }

    /// After a checkpoint the secondary is a copy of the primary, its
    /// sequence numbers the primary's: every offset becomes 0.
    pub fn checkpoint_done(&mut self) {
        for c in self.map.values_mut() {
            c.secondary_isn = c.primary_isn;
        }
    }

    /// How many connections are tracked.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// How many connections were evicted because the table was full.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }
}

fn update(conn: &mut Conn, seg: &TcpSeg, side: Side, now: Instant) {
    let f = seg.flags;
    if f.has(TcpFlags::SYN) {
        if conn.state == TcpState::Closed && side != Side::Secondary {
            // The 4-tuple reused: a new connection.
            *conn = Conn::fresh(now, conn.stamp);
        }
        match side {
            Side::Primary => conn.primary_isn = Some(seg.seq),
            Side::Secondary => conn.secondary_isn = Some(seg.seq),
            Side::Client => {}
        }
        if conn.state == TcpState::Midstream {
            conn.state = TcpState::SynSeen;
        }
        return;
    }
    if side == Side::Secondary || conn.state == TcpState::Closed {
        return;
    }
    if f.has(TcpFlags::RST) {
        conn.state = TcpState::Closed;
        return;
    }
    if f.has(TcpFlags::FIN) {
        match side {
            Side::Primary => conn.guest_fin = true,
            _ => conn.client_fin = true,
        }
    }
    conn.state = match (conn.guest_fin, conn.client_fin) {
        (true, true) => TcpState::Closed,
        (true, false) | (false, true) => TcpState::Closing,
        (false, false) => TcpState::Established,
    };
}

#[cfg(test)]
#[path = "conntrack_tests.rs"]
mod tests;

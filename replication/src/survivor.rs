//! The secondary's own table of sequence offsets, so that it can go on
//! rewriting after it takes over (design.md §6, Network).
//!
//! A TCP connection opened since the last checkpoint has different initial
//! sequence numbers in the two guests; the client knows only the
//! primary's. The primary's compare learns each connection's offset
//! (`primary_isn - secondary_isn`, [`crate::conntrack`]) and tells it with
//! every client segment it mirrors ([`Offsets::learn`]); a commit makes the
//! secondary a copy of the primary, so every offset becomes 0
//! ([`Offsets::clear`]). Once the secondary serves, its guest's segments
//! are moved into the client's (the primary's) space (`seq += offset`)
//! and the client's segments into its guest's (`ack -= offset`), for the
//! connections in the table; every other frame goes through untouched.
//!
//! Owns the table, bounded by its `cap` (a connection past it is not
//! learned, and counted: it breaks at a failover, as it would without this
//! table). Pure: runs on the secondary's proxy thread; never panics on a
//! frame (one shorter than its parse is an error).

use std::collections::HashMap;

use crate::packet::{parse, ConnKey, Frame};
use crate::rewrite::{self, Csum, RewriteError};

/// The default bound: as many connections as the compare tracks.
pub const DEFAULT_CAP: usize = 65_536;

/// See the module doc.
#[derive(Debug)]
pub struct Offsets {
    map: HashMap<ConnKey, u32>,
    cap: usize,
    refused: u64,
}

impl Offsets {
    /// An empty table of at most `cap` connections.
    pub fn new(cap: usize) -> Offsets {
        Offsets {
            map: HashMap::new(),
            cap,
            refused: 0,
        }
    }

    /// A client frame the primary mirrored with `offset` (its ack already
    /// moved by it): remembers the connection's offset (a 0 forgets it).
    pub fn learn(&mut self, client_frame: &[u8], offset: u32) {
        let Frame::Tcp(seg) = parse(client_frame) else {
            return;
        };
        if offset == 0 {
            self.map.remove(&seg.conn);
        } else if self.map.len() < self.cap || self.map.contains_key(&seg.conn) {
            self.map.insert(seg.conn, offset);
        } else {
            self.refused += 1;
        }
    }

    /// A checkpoint committed: the guests agree on every connection.
    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// Connections with an offset.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Connections not learned because the table was full.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// A frame of the serving secondary's guest, to the client: its
    /// sequence number moved to the client's space. Whether it was moved.
    pub fn guest_to_client(&self, frame: &mut [u8], csum: Csum) -> Result<bool, RewriteError> {
        let Frame::Tcp(seg) = parse(frame) else {
            return Ok(false);
        };
        match self.map.get(&seg.conn) {
            Some(&off) => rewrite::secondary_to_primary(frame, &seg, off, csum).map(|()| true),
            None => Ok(false),
        }
    }

    /// A client frame to the serving secondary's guest: its ack moved to
    /// the guest's space. Whether it was moved.
    pub fn client_to_guest(&self, frame: &mut [u8], csum: Csum) -> Result<bool, RewriteError> {
        let Frame::Tcp(seg) = parse(frame) else {
            return Ok(false);
        };
        match self.map.get(&seg.conn) {
            Some(&off) => rewrite::client_to_secondary(frame, &seg, off, csum).map(|()| true),
            None => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::tests::{arp, Tcp};
    use crate::packet::TcpSeg;

    fn seg(f: &[u8]) -> TcpSeg {
        match parse(f) {
            Frame::Tcp(s) => s,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_learned_connection_is_rewritten_both_ways_until_a_commit() {
        let mut t = Offsets::new(DEFAULT_CAP);
        // The primary chose 1000, the secondary 500: offset 500.
        t.learn(&Tcp::client(7001).ack(Some(501)).build(b"x"), 500);
        assert_eq!(t.len(), 1);
        let mut out = Tcp::guest(501).ack(Some(7002)).build(b"reply");
        assert!(t.guest_to_client(&mut out, Csum::Full).unwrap());
        assert_eq!(seg(&out).seq, 1001, "the client's space");
        let mut want = Tcp::guest(1001).ack(Some(7002)).build(b"reply");
        assert_eq!(out, want, "checksum updated as a full computation");
        let mut from = Tcp::client(7002).ack(Some(1006)).build(b"next");
        assert!(t.client_to_guest(&mut from, Csum::Full).unwrap());
        assert_eq!(seg(&from).ack, 506, "the guest's space");
        // Not TCP, or another connection: untouched.
        let mut a = arp();
        assert!(!t.guest_to_client(&mut a, Csum::Full).unwrap());
        let mut other = Tcp::guest(5).build(b"");
        other[37] ^= 1; // another port
        let before = other.clone();
        assert!(!t.guest_to_client(&mut other, Csum::Full).unwrap());
        assert_eq!(other, before);
        t.clear();
        want = Tcp::guest(501).build(b"");
        assert!(!t.guest_to_client(&mut want, Csum::Full).unwrap());
    }

    #[test]
    fn offset_zero_forgets_and_the_cap_holds() {
        let mut t = Offsets::new(1);
        let f = Tcp::client(1).build(b"");
        t.learn(&f, 9);
        t.learn(&f, 0);
        assert!(t.is_empty());
        t.learn(&f, 9);
        let mut g = Tcp::client(1).build(b"");
        g[35] ^= 1; // another client port
        t.learn(&g, 9);
        assert_eq!((t.len(), t.refused()), (1, 1));
        t.learn(&f, 10);
        assert_eq!(t.len(), 1, "a known one is updated");
    }

    #[test]
    fn hostile_bytes_never_panic() {
        let mut t = Offsets::new(4);
        for len in 0..80 {
            let mut f = Tcp::client(1).build(b"payload");
            f.truncate(len);
            t.learn(&f, 3);
            let _ = t.guest_to_client(&mut f, Csum::Full);
            let _ = t.client_to_guest(&mut f, Csum::Partial);
        }
    }
}

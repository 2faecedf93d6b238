//! A backend on one end of a Unix datagram socket pair: each datagram is
//! one frame, virtio-net header first. COLO puts it under a NIC so that
//! the vmm's proxy, on the other end ([`Peer`]), sees every frame the
//! guest sends and chooses what it receives (the primary's compare, the
//! secondary's mirror).
//!
//! Towards the guest each datagram starts with an 8-byte generation
//! (little-endian) before the frame: the backend drops, unread by the
//! guest, every datagram of a generation below the floor the proxy sets
//! ([`Peer::set_floor`]), and a raised floor makes the device drop what it
//! holds for the guest too, so that a proxy can take back at once all it
//! queued and not yet delivered (the COLO secondary at each checkpoint).
//! It counts the frames it hands on ([`Peer::taken`]) and hears from the
//! device how many of those the guest does not have yet, so that the proxy
//! knows which of its frames the guest has ([`Peer::delivered`], the COLO
//! primary at each checkpoint). The guest's output crosses as it is.
//!
//! Driven from the device thread only; never blocks (the socket is
//! non-blocking: `WouldBlock` both ways, as a tap). A datagram shorter
//! than its generation is dropped.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use super::backend::NetBackend;

/// The generation's bytes before each frame towards the guest.
pub const GEN_LEN: usize = 8;

/// What the two ends share.
#[derive(Default)]
struct Shared {
    floor: AtomicU64,
    taken: AtomicU64,
    /// Of those taken, the frames the device still holds for the guest.
    held: AtomicU64,
    /// The floor rose: the device drops what it holds.
    drop_held: AtomicBool,
}

/// See the module doc.
pub struct Datagram {
    name: String,
    sock: UnixDatagram,
    shared: Arc<Shared>,
    buf: Vec<u8>,
}

/// The proxy's end of a [`Datagram`].
pub struct Peer {
    pub sock: UnixDatagram,
    shared: Arc<Shared>,
}

impl Datagram {
    /// A connected pair: the backend, and the proxy's end (non-blocking
    /// too).
    pub fn pair(name: &str) -> io::Result<(Datagram, Peer)> {
        let (a, b) = UnixDatagram::pair()?;
        a.set_nonblocking(true)?;
        b.set_nonblocking(true)?;
        let shared = Arc::new(Shared::default());
        Ok((
            Datagram {
                name: name.to_string(),
                sock: a,
                shared: shared.clone(),
                buf: Vec::new(),
            },
            Peer { sock: b, shared },
        ))
    }
}

impl Peer {
    /// Sends `frame` to the guest's side as of `generation`.
    pub fn send(&self, generation: u64, frame: &[u8]) -> io::Result<usize> {
        let mut d = Vec::with_capacity(GEN_LEN + frame.len());
        d.extend_from_slice(&generation.to_le_bytes());
        d.extend_from_slice(frame);
        self.sock.send(&d)
    }

    /// From now on, what was sent below `generation` is dropped unread.
    /// The device drops the frames it holds for the guest, at its next
    /// receive run.
    pub fn set_floor(&self, generation: u64) {
        self.shared.floor.store(generation, Ordering::SeqCst);
        self.shared.drop_held.store(true, Ordering::SeqCst);
    }

    /// Frames the backend handed to the device so far.
    pub fn taken(&self) -> u64 {
        self.shared.taken.load(Ordering::SeqCst)
    }

    /// Frames the guest has (or that its device dropped for good): those
    /// taken but the ones the device still holds. Exact while the device
    /// thread is parked (a paused VM).
    pub fn delivered(&self) -> u64 {
        self.taken()
            .saturating_sub(self.shared.held.load(Ordering::SeqCst))
    }

    /// The guest's next frame.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.sock.recv(buf)
    }
}

impl AsRawFd for Peer {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}

impl NetBackend for Datagram {
    fn name(&self) -> &str {
        &self.name
    }

    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.buf.resize(buf.len() + GEN_LEN, 0);
        loop {
            let n = self.sock.recv(&mut self.buf)?;
            let Some((head, frame)) = self.buf[..n].split_first_chunk::<GEN_LEN>() else {
                continue;
            };
            if u64::from_le_bytes(*head) < self.shared.floor.load(Ordering::SeqCst) {
                continue;
            }
            buf[..frame.len()].copy_from_slice(frame);
            self.shared.taken.fetch_add(1, Ordering::SeqCst);
            return Ok(frame.len());
        }
    }

    fn write_frame(&mut self, frame: &[u8]) -> io::Result<usize> {
        self.sock.send(frame)
    }

    fn held_by_device(&mut self, frames: u64) {
        self.shared.held.store(frames, Ordering::SeqCst);
    }

    fn drop_held(&mut self) -> bool {
        self.shared.drop_held.swap(false, Ordering::SeqCst)
    }

    fn rx_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    fn tx_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    fn set_offload(&mut self, _flags: u32) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_cross_whole_both_ways() {
        let (mut d, other) = Datagram::pair("colo0").unwrap();
        assert_eq!(d.write_frame(&[1u8; 70]).unwrap(), 70);
        let mut buf = [0u8; 128];
        assert_eq!(other.recv(&mut buf).unwrap(), 70);
        other.send(0, &[2u8; 80]).unwrap();
        assert_eq!(d.read_frame(&mut buf).unwrap(), 80);
        assert_eq!(buf[..80], [2u8; 80]);
        assert_eq!(other.taken(), 1);
        let e = d.read_frame(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
    }

    #[test]
    fn frames_below_the_floor_are_dropped_unread_and_short_ones_too() {
        let (mut d, other) = Datagram::pair("colo0").unwrap();
        other.send(0, &[1u8; 60]).unwrap();
        other.send(1, &[2u8; 60]).unwrap();
        other.sock.send(&[9u8; 3]).unwrap();
        other.send(1, &[3u8; 60]).unwrap();
        other.set_floor(1);
        let mut buf = [0u8; 64];
        assert_eq!(d.read_frame(&mut buf).unwrap(), 60);
        assert_eq!(buf[..60], [2u8; 60]);
        assert_eq!(d.read_frame(&mut buf).unwrap(), 60);
        assert_eq!(buf[..60], [3u8; 60]);
        assert_eq!(other.taken(), 2);
        assert!(d.read_frame(&mut buf).is_err());
    }

    #[test]
    fn the_device_hears_what_it_holds_and_a_raised_floor_drops_it() {
        let (mut d, other) = Datagram::pair("colo0").unwrap();
        for _ in 0..3 {
            other.send(0, &[1u8; 60]).unwrap();
        }
        let mut buf = [0u8; 64];
        for _ in 0..3 {
            d.read_frame(&mut buf).unwrap();
        }
        d.held_by_device(2);
        assert_eq!((other.taken(), other.delivered()), (3, 1));
        assert!(!d.drop_held(), "nothing taken back yet");
        other.set_floor(1);
        assert!(d.drop_held());
        assert!(!d.drop_held(), "asked once");
    }
}

//! A backend on one end of a Unix datagram socket pair: each datagram is
//! one frame, virtio-net header first. COLO puts it under a NIC so that
//! the vmm's proxy, on the other end, sees every frame the guest sends and
//! chooses what it receives (the primary's compare, the secondary's
//! mirror).
//!
//! Driven from the device thread only; never blocks (the socket is
//! non-blocking: `WouldBlock` both ways, as a tap).

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixDatagram;

use super::backend::NetBackend;

/// See the module doc.
pub struct Datagram {
    name: String,
    sock: UnixDatagram,
}

impl Datagram {
    /// A connected pair: the backend, and the proxy's end (non-blocking
    /// too).
    pub fn pair(name: &str) -> io::Result<(Datagram, UnixDatagram)> {
        let (a, b) = UnixDatagram::pair()?;
        a.set_nonblocking(true)?;
        b.set_nonblocking(true)?;
        Ok((
            Datagram {
                name: name.to_string(),
                sock: a,
            },
            b,
        ))
    }
}

impl NetBackend for Datagram {
    fn name(&self) -> &str {
        &self.name
    }

    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.sock.recv(buf)
    }

    fn write_frame(&mut self, frame: &[u8]) -> io::Result<usize> {
        self.sock.send(frame)
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
        other.send(&[2u8; 80]).unwrap();
        assert_eq!(d.read_frame(&mut buf).unwrap(), 80);
        let e = d.read_frame(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
    }
}

//! A backend that carries nothing: the NIC of a COLO secondary before it
//! takes over. Its guest's frames are dropped (counted), and it never has
//! a frame for the guest; at failover the vmm swaps the tap in
//! ([`super::handler::NetHandler::replace_backend`]).
//!
//! Driven from the device thread only, like every backend. Never reads or
//! writes a tap.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use vmm_sys_util::eventfd::EventFd;

use super::backend::NetBackend;

/// See the module doc.
pub struct Detached {
    name: String,
    /// Never written: never readable, so the event loop never wakes for it.
    idle: EventFd,
    dropped: u64,
}

impl Detached {
    /// A detached backend standing for the tap `name`.
    pub fn new(name: &str) -> io::Result<Detached> {
        Ok(Detached {
            name: format!("{name} (detached)"),
            idle: EventFd::new(libc::EFD_NONBLOCK)?,
            dropped: 0,
        })
    }

    /// Frames of the guest dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

impl NetBackend for Detached {
    fn name(&self) -> &str {
        &self.name
    }

    fn read_frame(&mut self, _buf: &mut [u8]) -> io::Result<usize> {
        Err(io::ErrorKind::WouldBlock.into())
    }

    fn write_frame(&mut self, frame: &[u8]) -> io::Result<usize> {
        self.dropped += 1;
        Ok(frame.len())
    }

    fn rx_fd(&self) -> RawFd {
        self.idle.as_raw_fd()
    }

    fn tx_fd(&self) -> RawFd {
        self.idle.as_raw_fd()
    }

    fn set_offload(&mut self, _flags: u32) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_drops_what_the_guest_sends_and_has_nothing_for_it() {
        let mut d = Detached::new("tap9").unwrap();
        assert_eq!(d.name(), "tap9 (detached)");
        assert_eq!(d.write_frame(&[0u8; 60]).unwrap(), 60);
        assert_eq!(d.dropped(), 1);
        let mut buf = [0u8; 64];
        let e = d.read_frame(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert!(d.set_offload(0x7).is_ok());
    }
}

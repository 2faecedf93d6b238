//! The seam between virtio-net and what carries its frames on the host: a
//! [`NetBackend`] reads and writes whole frames, each led by the 12-byte
//! virtio-net header (as a tap opened with `IFF_VNET_HDR` delivers them),
//! and names the descriptors the event loop watches for readiness. The tap
//! ([`super::tap::Tap`]) is the backend today; COLO adds a compare/mirror
//! backend and swaps it in at failover
//! ([`super::handler::NetHandler::replace_backend`]).
//!
//! A backend is driven from the device thread only (the device's
//! activation, on a vCPU thread, sets its offloads under the device's state
//! lock). It must never block: a read with no frame and a write it cannot
//! take now both fail with `WouldBlock`, and the event loop waits for the
//! descriptor to be ready; flow control depends on it.

use std::io;
use std::os::fd::RawFd;

/// Size of the virtio-net header with `num_buffers` (virtio 1.x) that leads
/// every frame a backend reads or writes.
pub const VNET_HDR_LEN: usize = 12;

/// Offload flags for [`NetBackend::set_offload`] (the tap's `TUNSETOFFLOAD`
/// values): what the backend may hand the guest.
pub const TUN_F_CSUM: u32 = 0x01;
pub const TUN_F_TSO4: u32 = 0x02;
pub const TUN_F_TSO6: u32 = 0x04;

/// The host side of a virtio-net device.
pub trait NetBackend: Send {
    /// A name for messages (the tap's interface name).
    fn name(&self) -> &str;

    /// Reads one frame, virtio-net header first, into `buf`; returns its
    /// length (a frame longer than `buf` is cut). `WouldBlock` when none is
    /// queued.
    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize>;

    /// Writes one frame, virtio-net header first. `WouldBlock` when it
    /// cannot be taken now: the device keeps it and waits for
    /// [`NetBackend::tx_fd`] to be writable.
    fn write_frame(&mut self, frame: &[u8]) -> io::Result<usize>;

    /// The descriptor that is readable when a frame can be read.
    fn rx_fd(&self) -> RawFd;

    /// The descriptor that is writable when a frame can be written; may be
    /// the same as [`NetBackend::rx_fd`] (it is for a tap).
    fn tx_fd(&self) -> RawFd;

    /// Sets the offloads (`TUN_F_*`) of the frames the backend may hand
    /// the device: what the guest can receive.
    fn set_offload(&mut self, flags: u32) -> io::Result<()>;

    /// Told after each receive run how many of the frames it handed on the
    /// guest does not have yet (the device holds them). Nothing to do for
    /// most backends.
    fn held_by_device(&mut self, _frames: u64) {}

    /// Asked before each receive run: whether the device must drop the
    /// frames it holds for the guest (their sender took them back). No,
    /// for most backends.
    fn drop_held(&mut self) -> bool {
        false
    }
}

/// Readiness the event loop is asked for: reading from the backend (RX),
/// writing to it (TX).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Watch {
    pub rx: bool,
    pub tx: bool,
}

impl Watch {
    /// Nothing watched.
    pub const NONE: Watch = Watch {
        rx: false,
        tx: false,
    };
}

/// One descriptor to watch and its readiness, as `epoll` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdWatch {
    pub fd: RawFd,
    pub readable: bool,
    pub writable: bool,
}

/// The registrations `watch` needs on a backend whose descriptors are
/// `rx_fd` and `tx_fd`: one for a descriptor that serves both (a tap),
/// else one each.
pub fn fd_watches(rx_fd: RawFd, tx_fd: RawFd, watch: Watch) -> Vec<FdWatch> {
    if rx_fd == tx_fd {
        vec![FdWatch {
            fd: rx_fd,
            readable: watch.rx,
            writable: watch.tx,
        }]
    } else {
        vec![
            FdWatch {
                fd: rx_fd,
                readable: watch.rx,
                writable: false,
            },
            FdWatch {
                fd: tx_fd,
                readable: false,
                writable: watch.tx,
            },
        ]
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A backend over `SOCK_SEQPACKET` socket pairs (one frame per
    /// message, like a tap): one pair for both directions, or one each;
    /// the test holds the other ends. It records the offloads it is given,
    /// or refuses them.
    pub struct PairBackend {
        name: String,
        rx: OwnedFd,
        /// `None`: `rx` serves both directions.
        tx: Option<OwnedFd>,
        pub offload: Arc<Mutex<Option<u32>>>,
        pub refuse_offload: bool,
    }

    fn socketpair() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: socketpair writes two descriptors into `fds`; checked.
        let r = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0, "socketpair: {}", io::Error::last_os_error());
        // SAFETY: two fresh descriptors that nothing else owns.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    impl PairBackend {
        /// A backend on one socket pair, and the peer end.
        pub fn pair(name: &str) -> (PairBackend, OwnedFd) {
            let (ours, peer) = socketpair();
            (PairBackend::new(name, ours, None), peer)
        }

        /// A backend reading from one pair and writing to another, and the
        /// peer ends (the one to send frames on, the one they arrive at).
        pub fn split(name: &str) -> (PairBackend, OwnedFd, OwnedFd) {
            let (rx, rx_peer) = socketpair();
            let (tx, tx_peer) = socketpair();
            (PairBackend::new(name, rx, Some(tx)), rx_peer, tx_peer)
        }

        fn new(name: &str, rx: OwnedFd, tx: Option<OwnedFd>) -> Self {
            PairBackend {
                name: name.to_string(),
                rx,
                tx,
                offload: Arc::new(Mutex::new(None)),
                refuse_offload: false,
            }
        }

        fn tx_sock(&self) -> &OwnedFd {
            self.tx.as_ref().unwrap_or(&self.rx)
        }

        /// Fills the socket frames are written to, so that the next write
        /// would block (the peer reads nothing).
        pub fn fill(&self) {
            for size in [32 << 10, 1 << 10, 1] {
                let msg = vec![0u8; size];
                while send(self.tx_sock(), &msg).is_ok() {}
            }
        }
    }

    /// Sends one message on `fd`.
    pub fn send(fd: &OwnedFd, bytes: &[u8]) -> io::Result<usize> {
        // SAFETY: reading `bytes.len()` bytes of a slice we hold.
        let n = unsafe { libc::send(fd.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// Receives one message from `fd`.
    pub fn recv(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: writing at most `buf.len()` bytes into a buffer we own.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    impl NetBackend for PairBackend {
        fn name(&self) -> &str {
            &self.name
        }
        fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            recv(&self.rx, buf)
        }
        fn write_frame(&mut self, frame: &[u8]) -> io::Result<usize> {
            send(self.tx_sock(), frame)
        }
        fn rx_fd(&self) -> RawFd {
            self.rx.as_raw_fd()
        }
        fn tx_fd(&self) -> RawFd {
            self.tx_sock().as_raw_fd()
        }
        fn set_offload(&mut self, flags: u32) -> io::Result<()> {
            if self.refuse_offload {
                return Err(io::Error::from(io::ErrorKind::Unsupported));
            }
            *self.offload.lock().unwrap() = Some(flags);
            Ok(())
        }
    }

    #[test]
    fn one_registration_for_a_shared_descriptor() {
        let w = Watch { rx: true, tx: true };
        assert_eq!(
            fd_watches(7, 7, w),
            [FdWatch {
                fd: 7,
                readable: true,
                writable: true
            }]
        );
        let w = Watch {
            rx: false,
            tx: true,
        };
        assert_eq!(
            fd_watches(7, 9, w),
            [
                FdWatch {
                    fd: 7,
                    readable: false,
                    writable: false
                },
                FdWatch {
                    fd: 9,
                    readable: false,
                    writable: true
                }
            ]
        );
    }
}

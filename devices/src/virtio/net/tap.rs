//! A tap device opened for virtio-net: `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`,
//! non-blocking, with a 12-byte virtio-net header on every frame: the
//! [`NetBackend`] of a NIC on the host's network. Opening a name that does
//! not exist creates the interface (it goes away with us).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use super::backend::{NetBackend, VNET_HDR_LEN};

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
const TUNSETSNDBUF: libc::c_ulong = 0x4004_54d4;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;

/// Tap errors.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("tap name '{0}' is empty or longer than 15 bytes")]
    BadName(String),
    #[error("cannot open /dev/net/tun: {err}{}", access_hint(err))]
    OpenTun {
        #[source]
        err: io::Error,
    },
    #[error("cannot attach to tap '{name}': {err}{}", attach_hint(name, err))]
    Attach {
        name: String,
        #[source]
        err: io::Error,
    },
    #[error("cannot configure tap '{name}' ({what}): {err}")]
    Configure {
        name: String,
        what: &'static str,
        #[source]
        err: io::Error,
    },
}

/// What to do when /dev/net/tun is not ours to open.
fn access_hint(err: &io::Error) -> &'static str {
    match err.raw_os_error() {
        Some(libc::EACCES | libc::EPERM) => {
            " (this user needs read and write access to it; Debian makes it 0666)"
        }
        _ => "",
    }
}

/// What to do when a tap may not be attached: making one needs root, and
/// a tap made for another user is theirs.
fn attach_hint(name: &str, err: &io::Error) -> String {
    match err.raw_os_error() {
        Some(libc::EPERM | libc::EACCES) => format!(
            " (a tap that does not exist is created, which needs root (CAP_NET_ADMIN), \
             and a tap made for another user is theirs: as root, make it for this user \
             beforehand with `ip tuntap add {name} mode tap user USER` and set it up)"
        ),
        _ => String::new(),
    }
}

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// An open tap.
pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Opens (or creates) tap `name`.
    pub fn open(name: &str) -> Result<Tap, TapError> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('\0') {
            return Err(TapError::BadName(name.to_string()));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(|err| TapError::OpenTun { err })?;
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is (same layout).
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req) } < 0 {
            return Err(TapError::Attach {
                name: name.to_string(),
                err: io::Error::last_os_error(),
            });
        }
        let tap = Tap {
            file,
            name: name.to_string(),
        };
        let hdr = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads an int from the pointer.
        let ret = unsafe { libc::ioctl(tap.fd(), TUNSETVNETHDRSZ, &hdr) };
        tap.check(ret, "virtio-net header size")?;
        tap.offload(0)
            .map_err(|err| tap.configure_error("offloads", err))?;
        Ok(tap)
    }

    fn configure_error(&self, what: &'static str, err: io::Error) -> TapError {
        TapError::Configure {
            name: self.name.clone(),
            what,
            err,
        }
    }

    fn check(&self, ret: libc::c_int, what: &'static str) -> Result<(), TapError> {
        if ret < 0 {
            return Err(self.configure_error(what, io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Sets the offloads the tap may hand us (what the guest can receive).
    fn offload(&self, flags: u32) -> io::Result<()> {
        // SAFETY: TUNSETOFFLOAD takes its argument by value.
        if unsafe { libc::ioctl(self.fd(), TUNSETOFFLOAD, libc::c_ulong::from(flags)) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Bounds the tap's socket send buffer, so that writes return EAGAIN
    /// when the host side is slower than the guest (flow control).
    pub fn set_sndbuf(&self, bytes: i32) -> Result<(), TapError> {
        // SAFETY: TUNSETSNDBUF reads an int from the pointer.
        let ret = unsafe { libc::ioctl(self.fd(), TUNSETSNDBUF, &bytes) };
        self.check(ret, "send buffer")
    }

    /// The descriptor, for epoll.
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Reads one frame (with its header). WouldBlock when none is queued.
    fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: reading into a buffer we own, within its length.
        let n = unsafe { libc::read(self.fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// Writes one frame (with its header). WouldBlock when the tap is full.
    fn write(&self, frame: &[u8]) -> io::Result<usize> {
        // SAFETY: writing from a buffer we own, within its length.
        let n = unsafe { libc::write(self.fd(), frame.as_ptr().cast(), frame.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl NetBackend for Tap {
    fn name(&self) -> &str {
        &self.name
    }

    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read(buf)
    }

    fn write_frame(&mut self, frame: &[u8]) -> io::Result<usize> {
        self.write(frame)
    }

    fn rx_fd(&self) -> RawFd {
        self.fd()
    }

    fn tx_fd(&self) -> RawFd {
        self.fd()
    }

    fn set_offload(&mut self, flags: u32) -> io::Result<()> {
        self.offload(flags)
    }
}

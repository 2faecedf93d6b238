//! A userfaultfd over guest memory, for post-copy: the missing pages of
//! registered ranges fault into it instead of being filled with zeroes,
//! and whoever reads the faults places each page ([`Uffd::copy`],
//! [`Uffd::zero`]), which wakes the threads waiting on it (a vCPU in
//! KVM_RUN, the device thread in a copy).
//!
//! The ioctls are Linux's `<linux/userfaultfd.h>` (the `userfaultfd`
//! crate needs libclang to build, which this project does not install).
//! Used by the incoming side's post-copy threads. Never does: place a page
//! outside a range it registered (the kernel refuses it), or block (the
//! descriptor is non-blocking; [`Uffd::wait`] polls with a timeout).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use vmm_sys_util::ioctl::ioctl_with_mut_ref;
use vmm_sys_util::{ioctl_ior_nr, ioctl_iowr_nr};

const UFFDIO: u32 = 0xAA;
const UFFD_API: u64 = 0xAA;
const REGISTER_MODE_MISSING: u64 = 1;
const EVENT_PAGEFAULT: u8 = 0x12;

#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}

/// `struct uffd_msg` (32 bytes, packed): the event, and for a page fault
/// its flags and address.
#[repr(C, packed)]
#[derive(Default, Clone, Copy)]
struct UffdMsg {
    event: u8,
    reserved1: u8,
    reserved2: u16,
    reserved3: u32,
    flags: u64,
    address: u64,
    rest: u64,
}

ioctl_iowr_nr!(UFFDIO_API, UFFDIO, 0x3F, UffdioApi);
ioctl_iowr_nr!(UFFDIO_REGISTER, UFFDIO, 0x00, UffdioRegister);
ioctl_ior_nr!(UFFDIO_UNREGISTER, UFFDIO, 0x01, UffdioRange);
ioctl_iowr_nr!(UFFDIO_COPY, UFFDIO, 0x03, UffdioCopy);
ioctl_iowr_nr!(UFFDIO_ZEROPAGE, UFFDIO, 0x04, UffdioZeropage);

/// A userfaultfd, handshaken.
pub struct Uffd {
    fd: OwnedFd,
}

/// What placing a page did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    /// It is there now.
    Now,
    /// It was there already (placed earlier, or never missing).
    Already,
}

fn check(r: i32) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn placed(r: i32) -> io::Result<Placed> {
    match check(r) {
        Ok(()) => Ok(Placed::Now),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(Placed::Already),
        Err(e) => Err(e),
    }
}

impl Uffd {
    /// A new userfaultfd for this process's faults, kernel ones included
    /// (KVM's): root, or `vm.unprivileged_userfaultfd` 1.
    pub fn new() -> io::Result<Uffd> {
        // SAFETY: the userfaultfd system call takes flags only and returns
        // a new descriptor (or -1), which is owned here from now on.
        let fd =
            unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by the kernel and nothing else
        // owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let mut api = UffdioApi {
            api: UFFD_API,
            ..Default::default()
        };
        // SAFETY: UFFDIO_API reads and writes one `uffdio_api`, which `api`
        // is, on a userfaultfd.
        check(unsafe { ioctl_with_mut_ref(&fd, UFFDIO_API(), &mut api) })?;
        Ok(Uffd { fd })
    }

    /// Missing pages of `[addr, addr + len)` (this process's memory,
    /// page-aligned) fault into this descriptor from now on.
    pub fn register(&self, addr: u64, len: u64) -> io::Result<()> {
        let mut r = UffdioRegister {
            range: UffdioRange { start: addr, len },
            mode: REGISTER_MODE_MISSING,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes one `uffdio_register`;
        // the kernel checks that the range is mapped memory.
        check(unsafe { ioctl_with_mut_ref(&self.fd, UFFDIO_REGISTER(), &mut r) })
    }

    /// Missing pages of the range fill with zeroes again.
    pub fn unregister(&self, addr: u64, len: u64) -> io::Result<()> {
        let mut r = UffdioRange { start: addr, len };
        // SAFETY: UFFDIO_UNREGISTER reads one `uffdio_range`.
        check(unsafe { ioctl_with_mut_ref(&self.fd, UFFDIO_UNREGISTER(), &mut r) })
    }

    /// Places `src` (whole pages) at `dst`, a registered missing range,
    /// and wakes whoever waits on it.
    pub fn copy(&self, dst: u64, src: &[u8]) -> io::Result<Placed> {
        let mut c = UffdioCopy {
            dst,
            src: src.as_ptr() as u64,
            len: src.len() as u64,
            mode: 0,
            copy: 0,
        };
        // SAFETY: UFFDIO_COPY reads `src.len()` bytes from `src` (a live
        // slice) into the registered range at `dst`, which the kernel
        // checks; it writes only `c`.
        placed(unsafe { ioctl_with_mut_ref(&self.fd, UFFDIO_COPY(), &mut c) })
    }

    /// Places zero pages over `[dst, dst + len)` and wakes its waiters.
    pub fn zero(&self, dst: u64, len: u64) -> io::Result<Placed> {
        let mut z = UffdioZeropage {
            range: UffdioRange { start: dst, len },
            mode: 0,
            zeropage: 0,
        };
        // SAFETY: UFFDIO_ZEROPAGE reads and writes one `uffdio_zeropage`;
        // the kernel checks the range.
        placed(unsafe { ioctl_with_mut_ref(&self.fd, UFFDIO_ZEROPAGE(), &mut z) })
    }

    /// Waits up to `timeout` for a fault; returns its address (not
    /// page-aligned), or `None` when none came.
    pub fn wait(&self, timeout: Duration) -> io::Result<Option<u64>> {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd, for the length given.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(None)
            } else {
                Err(e)
            };
        }
        if r == 0 {
            return Ok(None);
        }
        let mut msg = UffdMsg::default();
        let size = std::mem::size_of::<UffdMsg>();
        // SAFETY: reads at most `size` bytes into `msg`, a plain struct of
        // that size with no invalid bit patterns.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&mut msg as *mut UffdMsg).cast(), size) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock {
                Ok(None)
            } else {
                Err(e)
            };
        }
        if n as usize != size || msg.event != EVENT_PAGEFAULT {
            return Ok(None);
        }
        Ok(Some(msg.address))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registered anonymous page faults into the descriptor when
    /// touched, and the toucher goes on once the page is placed.
    #[test]
    fn a_missing_page_faults_and_is_placed() {
        // The suite runs as root (test.sh): userfaultfd is there.
        let u = Uffd::new().expect("a userfaultfd (as root)");
        let len = 2 * 4096;
        // SAFETY: a fresh anonymous mapping, unmapped at the end.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let addr = p as u64;
        u.register(addr, len as u64).unwrap();
        let reader = std::thread::spawn(move || {
            // SAFETY: the mapping lives until after this thread is joined.
            unsafe { std::ptr::read_volatile((addr + 4096 + 8) as *const u64) }
        });
        let fault = loop {
            if let Some(a) = u.wait(Duration::from_secs(5)).unwrap() {
                break a;
            }
        };
        assert_eq!(fault & !0xfff, addr + 4096);
        let page = [7u8; 4096];
        assert_eq!(u.copy(addr + 4096, &page).unwrap(), Placed::Now);
        assert_eq!(reader.join().unwrap(), u64::from_le_bytes([7; 8]));
        assert_eq!(u.copy(addr + 4096, &page).unwrap(), Placed::Already);
        assert_eq!(u.zero(addr, 4096).unwrap(), Placed::Now);
        u.unregister(addr, len as u64).unwrap();
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(p, len) };
    }
}

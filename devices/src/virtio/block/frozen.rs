//! A disk that refuses the guest's writes until it is thawed: a COLO
//! secondary's, whose image must stay as the primary's was until it takes
//! over (its guest's writes fail with an I/O error meanwhile; the primary
//! ends the pair as soon as its own guest writes, since disks are not
//! replicated yet). Reads, flushes and the lock go to the image.
//!
//! Called where the wrapped backend is (the device thread for requests);
//! [`Frozen::thaw`] from any thread.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vm_memory::GuestAddress;

use super::backend::DiskBackend;
use crate::GuestMemoryMmap;

/// See the module doc.
pub struct Frozen<B> {
    inner: B,
    frozen: Arc<AtomicBool>,
}

impl<B: DiskBackend> Frozen<B> {
    /// `inner`, frozen; the [`Thaw`] thaws it.
    pub fn new(inner: B) -> (Frozen<B>, Thaw) {
        let frozen = Arc::new(AtomicBool::new(true));
        (
            Frozen {
                inner,
                frozen: frozen.clone(),
            },
            Thaw(frozen),
        )
    }

    fn writable(&self) -> io::Result<()> {
        if self.frozen.load(Ordering::SeqCst) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "a COLO secondary's disk takes no write before it takes over",
            ));
        }
        Ok(())
    }
}

/// What lets a [`Frozen`] disk's writes through.
#[derive(Clone)]
pub struct Thaw(Arc<AtomicBool>);

impl Thaw {
    /// From now on.
    pub fn thaw(&self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

impl<B: DiskBackend> DiskBackend for Frozen<B> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn readonly(&self) -> bool {
        self.inner.readonly()
    }
    fn read_to_guest(
        &self,
        mem: &GuestMemoryMmap,
        addr: GuestAddress,
        len: usize,
        offset: u64,
    ) -> io::Result<()> {
        self.inner.read_to_guest(mem, addr, len, offset)
    }
    fn write_from_guest(
        &self,
        mem: &GuestMemoryMmap,
        addr: GuestAddress,
        len: usize,
        offset: u64,
    ) -> io::Result<()> {
        self.writable()?;
        self.inner.write_from_guest(mem, addr, len, offset)
    }
    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }
    fn hold_lock(&self, held: bool) -> io::Result<()> {
        self.inner.hold_lock(held)
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.writable()?;
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        self.writable()?;
        self.inner.write_zeroes(offset, len, unmap)
    }
}

#[cfg(test)]
mod tests {
    use super::super::backend::tests::MemDisk;
    use super::*;

    #[test]
    fn writes_fail_until_thawed() {
        let (d, flag) = Frozen::new(MemDisk::new(4096, 7, false));
        let e = d.discard(0, 512).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        assert!(d.write_zeroes(0, 512, false).is_err());
        assert!(d.flush().is_ok());
        flag.thaw();
        assert!(d.write_zeroes(0, 512, false).is_ok());
        assert_eq!(d.inner.bytes.lock().unwrap()[..512], [0u8; 512]);
    }
}

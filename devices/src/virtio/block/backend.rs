//! The seam between virtio-blk and the storage behind it: a
//! [`DiskBackend`] is a fixed-size array of bytes that the request code
//! reads into guest memory, writes from guest memory, flushes, discards and
//! zeroes. The raw image file ([`super::disk::DiskFile`]) is the backend
//! today; COLO's disk replication adds one that forwards the primary's
//! writes (design §6).
//!
//! Called on the VMM thread for requests, and from the device (a vCPU
//! thread) for its size and mode. Ranges are checked by the caller
//! (`request`) against [`DiskBackend::size`] before any call, and guest
//! addresses are range-checked by vm-memory; a backend never trusts either
//! to go beyond failing with an error.

use std::io;

use crate::GuestMemoryMmap;
use vm_memory::GuestAddress;

/// The storage of a virtio-blk device.
pub trait DiskBackend: Send + Sync {
    /// A name for messages (the image's path).
    fn name(&self) -> &str;

    /// Capacity in bytes, a whole number of 512-byte sectors.
    fn size(&self) -> u64;

    /// Whether the guest may only read.
    fn readonly(&self) -> bool;

    /// Reads `len` bytes at `offset` into guest memory at `addr` (marking
    /// the pages dirty).
    fn read_to_guest(
        &self,
        mem: &GuestMemoryMmap,
        addr: GuestAddress,
        len: usize,
        offset: u64,
    ) -> io::Result<()>;

    /// Writes `len` bytes of guest memory at `addr` at `offset`;
    /// `PermissionDenied` on a read-only backend.
    fn write_from_guest(
        &self,
        mem: &GuestMemoryMmap,
        addr: GuestAddress,
        len: usize,
        offset: u64,
    ) -> io::Result<()>;

    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;

    /// Takes (`held`) or releases the image's lock, without waiting: at a
    /// migration's switch-over the source releases it and the destination
    /// takes it, so that one VM at a time writes the image. A backend
    /// without a lock has nothing to do.
    fn hold_lock(&self, _held: bool) -> io::Result<()> {
        Ok(())
    }

    /// Deallocates a range (advisory: it may read back as before).
    fn discard(&self, offset: u64, len: u64) -> io::Result<()>;

    /// Makes a range read back as zeroes; `unmap`: it may be deallocated.
    fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()>;
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Mutex;

    use vm_memory::Bytes;

    use super::*;

    /// A disk in memory, with the calls it saw.
    pub struct MemDisk {
        pub bytes: Mutex<Vec<u8>>,
        pub readonly: bool,
        pub flushes: Mutex<usize>,
    }

    impl MemDisk {
        pub fn new(size: usize, byte: u8, readonly: bool) -> Self {
            MemDisk {
                bytes: Mutex::new(vec![byte; size]),
                readonly,
                flushes: Mutex::new(0),
            }
        }

        fn range(&self, offset: u64, len: u64) -> io::Result<std::ops::Range<usize>> {
            let size = self.bytes.lock().unwrap().len() as u64;
            match offset.checked_add(len) {
                Some(end) if end <= size => Ok(offset as usize..end as usize),
                _ => Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            }
        }

        fn writable(&self) -> io::Result<()> {
            if self.readonly {
                return Err(io::Error::from(io::ErrorKind::PermissionDenied));
            }
            Ok(())
        }
    }

    impl DiskBackend for MemDisk {
        fn name(&self) -> &str {
            "memdisk"
        }
        fn size(&self) -> u64 {
            self.bytes.lock().unwrap().len() as u64
        }
        fn readonly(&self) -> bool {
            self.readonly
        }
        fn read_to_guest(
            &self,
            mem: &GuestMemoryMmap,
            addr: GuestAddress,
            len: usize,
            offset: u64,
        ) -> io::Result<()> {
            let r = self.range(offset, len as u64)?;
            mem.write_slice(&self.bytes.lock().unwrap()[r], addr)
                .map_err(io::Error::other)
        }
        fn write_from_guest(
            &self,
            mem: &GuestMemoryMmap,
            addr: GuestAddress,
            len: usize,
            offset: u64,
        ) -> io::Result<()> {
            self.writable()?;
            let r = self.range(offset, len as u64)?;
            mem.read_slice(&mut self.bytes.lock().unwrap()[r], addr)
                .map_err(io::Error::other)
        }
        fn flush(&self) -> io::Result<()> {
            *self.flushes.lock().unwrap() += 1;
            Ok(())
        }
        fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
            self.write_zeroes(offset, len, true)
        }
        fn write_zeroes(&self, offset: u64, len: u64, _unmap: bool) -> io::Result<()> {
            self.writable()?;
            let r = self.range(offset, len)?;
            self.bytes.lock().unwrap()[r].fill(0);
            Ok(())
        }
    }
}

//! A COLO secondary's writable disk (design.md §6, Disk): the
//! [`DiskBackend`] its guest sees, over `replication::journal`'s
//! [`SecondaryDisk`] on the image file. Before a takeover the guest reads
//! the last checkpoint's image under its own writes (an overlay in memory,
//! dropped at each checkpoint) and the primary's forwarded writes wait in
//! the journal until the checkpoint commits; at takeover the overlay goes
//! into the image and the journal is dropped, and from then on the disk is
//! plain.
//!
//! Called from the device thread (the guest's requests) and the
//! secondary's `incoming` thread (the primary's writes, the commit, the
//! takeover); one mutex orders them. Never does: let the guest see a
//! primary write before its checkpoint commits; hold more than
//! [`OVERLAY_CAP`] bytes of the guest's own writes (further writes fail
//! with an I/O error, counted); allocate a bounce buffer over
//! [`CHUNK`] bytes whatever the request's length.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use devices::virtio::block::disk::DiskFile;
use devices::virtio::block::tracked::WriteLog;
use devices::virtio::block::DiskBackend;
use devices::GuestMemoryMmap;
use replication::journal::{BlockImage, DiskStats, JournalError, SecondaryDisk, BLOCK_SIZE};
use vm_memory::{Address, Bytes, GuestAddress};

use crate::device_manager::KeptDisk as Kept;

/// The journal's cap: the primary's writes between two checkpoints.
pub const JOURNAL_CAP: u64 = 256 << 20;
/// The primary checkpoints once it forwarded this much since the last.
pub const CHECKPOINT_AT: u64 = JOURNAL_CAP / 8;
/// The overlay's cap: the secondary guest's own writes between two
/// checkpoints.
pub const OVERLAY_CAP: u64 = 256 << 20;
/// The largest bounce buffer between guest memory and the layers.
const CHUNK: usize = 1 << 20;

/// The image file beneath, by positioned I/O.
struct Image {
    file: File,
    len: u64,
}

impl BlockImage for Image {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn len(&self) -> u64 {
        self.len
    }
}

/// See the module doc.
pub struct Replica {
    file: DiskFile,
    /// What its guest wrote, once it serves and a new pair forwards it
    /// (`colo_reprotect`); off until then.
    log: Arc<WriteLog>,
    disk: Mutex<SecondaryDisk<Image>>,
    /// Guest writes refused because the overlay was full.
    overlay_full: AtomicU64,
}

fn to_io(e: JournalError) -> io::Error {
    match e {
        JournalError::Io { source, .. } => source,
        other => io::Error::other(other),
    }
}

impl Replica {
    /// The replica of the writable image `file` (as the initial sync left
    /// it, checked equal to the primary's).
    pub fn new(file: DiskFile) -> io::Result<Replica> {
        let image = Image {
            file: file.file().try_clone()?,
            len: file.size(),
        };
        Ok(Replica {
            file,
            log: Arc::new(WriteLog::default()),
            disk: Mutex::new(SecondaryDisk::new(image, JOURNAL_CAP)),
            overlay_full: AtomicU64::new(0),
        })
    }

    fn disk(&self) -> std::sync::MutexGuard<'_, SecondaryDisk<Image>> {
        devices::sync::lock(&self.disk)
    }

    /// A write of the primary's guest (checked against the image's size).
    pub fn journal(&self, offset: u64, data: &[u8]) -> Result<(), JournalError> {
        self.disk().journal_primary_write(offset, data)
    }

    /// The checkpoint committed (the guest paused): the journal goes into
    /// the image, the overlay is dropped.
    pub fn commit(&self) -> Result<(), JournalError> {
        self.disk().commit_checkpoint()
    }

    /// The takeover (the guest paused): the overlay goes into the image,
    /// the journal is dropped; the disk is plain from then on.
    pub fn take_over(&self) -> Result<(), JournalError> {
        self.disk().failover()
    }

    /// The log of its guest's writes (for a new pair after a takeover),
    /// and a handle on the image to read them back from.
    pub fn write_log(&self) -> io::Result<(Arc<WriteLog>, File)> {
        Ok((self.log.clone(), self.file.file().try_clone()?))
    }

    /// The journal's and the overlay's figures.
    pub fn stats(&self) -> DiskStats {
        self.disk().stats()
    }

    /// A guest write of `data` at `offset`, into the overlay (or the
    /// image, after the takeover), refused past the overlay's cap.
    fn guest_write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut d = self.disk();
        let blocks = d.stats().overlay_blocks;
        if !d.stats().failed_over && blocks * BLOCK_SIZE as u64 >= OVERLAY_CAP {
            self.overlay_full.fetch_add(1, Ordering::Relaxed);
            return Err(io::Error::other(format!(
                "the secondary's overlay holds {blocks} blocks, its cap"
            )));
        }
        d.guest_write(offset, data).map_err(to_io)?;
        // Noted while the disk is locked: a forwarder reads the range back
        // only after the write is in.
        self.log.note(offset, data.len() as u64);
        Ok(())
    }

    /// Runs `f` on each chunk of `len` bytes at `offset`, with the chunk's
    /// offset within the request.
    fn chunks(len: usize, mut f: impl FnMut(usize, &mut [u8]) -> io::Result<()>) -> io::Result<()> {
        let mut buf = vec![0u8; len.min(CHUNK)];
        let mut done = 0usize;
        while done < len {
            let n = (len - done).min(CHUNK);
            f(done, &mut buf[..n])?;
            done += n;
        }
        Ok(())
    }
}

impl DiskBackend for Replica {
    fn name(&self) -> &str {
        self.file.name()
    }
    fn size(&self) -> u64 {
        self.file.size()
    }
    fn readonly(&self) -> bool {
        self.file.readonly()
    }
    fn read_to_guest(
        &self,
        mem: &GuestMemoryMmap,
        addr: GuestAddress,
        len: usize,
        offset: u64,
    ) -> io::Result<()> {
        Self::chunks(len, |at, buf| {
            self.disk()
                .guest_read(offset + at as u64, buf)
                .map_err(to_io)?;
            let to = addr
                .checked_add(at as u64)
                .ok_or_else(|| io::Error::other("guest address overflow"))?;
            mem.write_slice(buf, to).map_err(io::Error::other)
        })
    }
    fn write_from_guest(
        &self,
        mem: &GuestMemoryMmap,
        addr: GuestAddress,
        len: usize,
        offset: u64,
    ) -> io::Result<()> {
        if self.readonly() {
            return Err(io::Error::from(io::ErrorKind::PermissionDenied));
        }
        Self::chunks(len, |at, buf| {
            let from = addr
                .checked_add(at as u64)
                .ok_or_else(|| io::Error::other("guest address overflow"))?;
            mem.read_slice(buf, from).map_err(io::Error::other)?;
            self.guest_write(offset + at as u64, buf)
        })
    }
    /// Before the takeover the guest's writes live in the overlay until
    /// the next checkpoint drops them: nothing to make durable.
    fn flush(&self) -> io::Result<()> {
        if self.disk().stats().failed_over {
            return self.file.flush();
        }
        Ok(())
    }
    fn hold_lock(&self, held: bool) -> io::Result<()> {
        self.file.hold_lock(held)
    }
    /// Advisory: before the takeover nothing is deallocated (the range
    /// reads back as before, which discard allows).
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let d = self.disk();
        if d.stats().failed_over {
            self.file.discard(offset, len)?;
            self.log.note(offset, len);
        }
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64, _unmap: bool) -> io::Result<()> {
        if self.readonly() {
            return Err(io::Error::from(io::ErrorKind::PermissionDenied));
        }
        let len = usize::try_from(len).map_err(|_| io::Error::other("length"))?;
        Self::chunks(len, |at, buf| {
            buf.fill(0);
            self.guest_write(offset + at as u64, buf)
        })
    }
}

/// The replicas of `vm`'s disks, indexed as the primary's `DiskWrite`s
/// are (every disk in device order; `None` for a read-only one).
pub fn of(vm: &crate::vm::VmHandle) -> Vec<Option<Arc<Replica>>> {
    vm.virtio()
        .iter()
        .filter_map(|slot| slot.disk_writes())
        .map(|d| match d {
            crate::device_manager::DiskWrites::Wrapped(w) => downcast(w),
            _ => None,
        })
        .collect()
}

/// A secondary's disk backend (the VM's `WrapDisk`): the image served
/// through a [`Replica`], which the COLO code gets back with [`downcast`].
pub fn wrap(file: DiskFile) -> io::Result<(Arc<dyn DiskBackend>, Kept)> {
    let r = Arc::new(Replica::new(file)?);
    Ok((r.clone(), r))
}

/// The [`Replica`] a [`wrap`] made, if `kept` is one.
pub fn downcast(kept: &Kept) -> Option<Arc<Replica>> {
    kept.clone().downcast::<Replica>().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(bytes: &[u8]) -> (Replica, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!(
            "tandem-replica-{}-{}",
            std::process::id(),
            bytes.len()
        ));
        std::fs::write(&path, bytes).unwrap();
        let file = DiskFile::open(&path, false).unwrap();
        (Replica::new(file).unwrap(), path)
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap()
    }

    #[test]
    fn the_guest_sees_its_writes_the_image_gets_the_primarys_at_commit() {
        let (r, path) = replica(&[1u8; 8192]);
        let m = mem();
        m.write_slice(&[7u8; 512], GuestAddress(0)).unwrap();
        r.write_from_guest(&m, GuestAddress(0), 512, 1024).unwrap();
        r.journal(4096, &[9u8; 100]).unwrap();
        r.read_to_guest(&m, GuestAddress(0x1000), 8192, 0).unwrap();
        let mut seen = vec![0u8; 8192];
        m.read_slice(&mut seen, GuestAddress(0x1000)).unwrap();
        assert_eq!(&seen[1024..1536], &[7u8; 512], "its own write");
        assert_eq!(&seen[4096..4196], &[1u8; 100], "not the primary's yet");
        assert_eq!(std::fs::read(&path).unwrap(), vec![1u8; 8192]);
        r.commit().unwrap();
        let image = std::fs::read(&path).unwrap();
        assert_eq!(&image[1024..1536], &[1u8; 512], "its own write dropped");
        assert_eq!(&image[4096..4196], &[9u8; 100], "the primary's applied");
        // The takeover keeps its writes since the commit.
        r.write_zeroes(0, 512, false).unwrap();
        r.journal(512, &[5u8; 10]).unwrap();
        r.take_over().unwrap();
        let image = std::fs::read(&path).unwrap();
        assert_eq!(&image[..512], &[0u8; 512]);
        assert_eq!(
            &image[512..522],
            &[1u8; 10],
            "the uncommitted journal dropped"
        );
        r.write_from_guest(&m, GuestAddress(0), 512, 2048).unwrap();
        assert_eq!(&std::fs::read(&path).unwrap()[2048..2560], &[7u8; 512]);
        assert!(r.journal(0, &[1]).is_err(), "no primary writes after");
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn requests_beyond_the_image_fail_without_panic() {
        let (r, path) = replica(&[0u8; 4096]);
        let m = mem();
        assert!(r.read_to_guest(&m, GuestAddress(0), 512, 4000).is_err());
        assert!(r.write_from_guest(&m, GuestAddress(0), 512, 4000).is_err());
        assert!(r.journal(u64::MAX, &[1]).is_err());
        assert!(r.read_to_guest(&m, GuestAddress(1 << 20), 512, 0).is_err());
        let _ = std::fs::remove_file(path);
    }
}

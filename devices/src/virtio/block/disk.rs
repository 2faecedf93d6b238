//! The [`DiskBackend`] of a raw image (regular file or block device)
//! opened read-write or read-only and locked against a second writer, with positioned I/O straight between the file and guest memory
//! (no bounce buffer; guest pages written by a read are marked in vm-memory's
//! dirty bitmap), flush (`fdatasync`), discard and write-zeroes
//! (`fallocate`). Offsets are checked by the caller (`request`); this module
//! never sees a guest address that was not range-checked by vm-memory.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::backend::DiskBackend;
use crate::GuestMemoryMmap;
use vm_memory::bitmap::BitmapSlice;
use vm_memory::{
    Bytes, GuestAddress, ReadVolatile, VolatileMemoryError, VolatileSlice, WriteVolatile,
};

/// Bytes per sector, as virtio-blk counts them.
pub const SECTOR_SIZE: u64 = 512;
/// Length of the device id string (`VIRTIO_BLK_ID_BYTES`).
pub const ID_BYTES: usize = 20;
/// Largest chunk written at once when zeroes must be written by hand.
const ZERO_CHUNK: usize = 1 << 20;

/// Why a disk image cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("cannot open {path}: {err}")]
    Open {
        path: PathBuf,
        #[source]
        err: io::Error,
    },
    #[error("{0} is not a regular file or a block device")]
    NotAFile(PathBuf),
    #[error("{0} is in use: another process (or another disk of this VM) holds a lock on it")]
    Locked(PathBuf),
    #[error("cannot lock {path}: {err}")]
    Lock {
        path: PathBuf,
        #[source]
        err: io::Error,
    },
    #[error("cannot get the size of {path}: {err}")]
    Size {
        path: PathBuf,
        #[source]
        err: io::Error,
    },
}

/// An open disk image.
#[derive(Debug)]
pub struct DiskFile {
    file: File,
    /// The path, for messages.
    name: String,
    /// In bytes, whole sectors.
    size: u64,
    readonly: bool,
}

impl DiskFile {
    /// Opens `path` (read-only when `readonly`) and takes a lock on it: an
    /// exclusive one for a writable disk, a shared one for a read-only disk,
    /// so two VMs never write the same image and nobody writes an image a
    /// VM reads. A size that is not a whole number of sectors loses its tail.
    pub fn open(path: &Path, readonly: bool) -> Result<DiskFile, DiskError> {
        let disk = Self::open_unlocked(path, readonly)?;
        disk.lock(path)?;
        Ok(disk)
    }

    /// Opens `path` as [`DiskFile::open`] does but takes no lock yet: a
    /// migration's destination, whose source holds the image's lock until
    /// the switch-over ([`DiskBackend::hold_lock`]).
    pub fn open_unlocked(path: &Path, readonly: bool) -> Result<DiskFile, DiskError> {
        let file = OpenOptions::new()
            .read(true)
            .write(!readonly)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|err| DiskError::Open {
                path: path.to_path_buf(),
                err,
            })?;
        let ft = file
            .metadata()
            .map_err(|err| DiskError::Size {
                path: path.to_path_buf(),
                err,
            })?
            .file_type();
        if !ft.is_file() && !ft.is_block_device() {
            return Err(DiskError::NotAFile(path.to_path_buf()));
        }
        Self::from_file(file, path, readonly)
    }

    /// Takes the image's lock, without waiting: exclusive for a writable
    /// disk, shared for a read-only one.
    fn lock(&self, path: &Path) -> Result<(), DiskError> {
        let op = if self.readonly {
            libc::LOCK_SH
        } else {
            libc::LOCK_EX
        };
        // SAFETY: flock on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(self.file.as_raw_fd(), op | libc::LOCK_NB) } < 0 {
            let err = io::Error::last_os_error();
            return Err(if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                DiskError::Locked(path.to_path_buf())
            } else {
                DiskError::Lock {
                    path: path.to_path_buf(),
                    err,
                }
            });
        }
        Ok(())
    }

    /// Wraps an already open file (no lock taken).
    pub fn from_file(mut file: File, path: &Path, readonly: bool) -> Result<DiskFile, DiskError> {
        let size = file.seek(SeekFrom::End(0)).map_err(|err| DiskError::Size {
            path: path.to_path_buf(),
            err,
        })?;
        if size % SECTOR_SIZE != 0 {
            log::warn!(
                "virtio-blk {}: size {size} is not a multiple of {SECTOR_SIZE}; \
                 the last {} bytes are not visible to the guest",
                path.display(),
                size % SECTOR_SIZE
            );
        }
        Ok(DiskFile {
            file,
            name: path.display().to_string(),
            size: size - size % SECTOR_SIZE,
            readonly,
        })
    }

    /// The open image, for positioned I/O of a backend built on it (a
    /// COLO secondary's journal and overlay, the primary's forwarder).
    pub fn file(&self) -> &File {
        &self.file
    }

    fn write_zeroes_by_hand(&self, offset: u64, len: u64) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let zeroes = vec![0u8; ZERO_CHUNK.min(usize::try_from(len).unwrap_or(ZERO_CHUNK))];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(zeroes.len() as u64) as usize;
            self.file.write_all_at(&zeroes[..n], offset + done)?;
            done += n as u64;
        }
        Ok(())
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
        if self.readonly {
            return Err(io::Error::from(io::ErrorKind::PermissionDenied));
        }
        let off =
            i64::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let len = i64::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: fallocate on a descriptor we own; no memory is passed.
        if unsafe { libc::fallocate64(self.file.as_raw_fd(), mode, off, len) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl DiskBackend for DiskFile {
    fn name(&self) -> &str {
        &self.name
    }

    fn hold_lock(&self, held: bool) -> io::Result<()> {
        if held {
            return self.lock(Path::new(&self.name)).map_err(io::Error::other);
        }
        // SAFETY: flock on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn readonly(&self) -> bool {
        self.readonly
    }

    /// Reads `len` bytes at `offset` of the file into guest memory at `addr`.
    fn read_to_guest(
        &self,
        mem: &GuestMemoryMmap,
        addr: GuestAddress,
        len: usize,
        offset: u64,
    ) -> io::Result<()> {
        let mut src = FileAt {
            file: &self.file,
            offset,
        };
        mem.read_exact_volatile_from(addr, &mut src, len)
            .map_err(io::Error::other)
    }

    /// Writes `len` bytes of guest memory at `addr` to the file at `offset`.
    fn write_from_guest(
        &self,
        mem: &GuestMemoryMmap,
        addr: GuestAddress,
        len: usize,
        offset: u64,
    ) -> io::Result<()> {
        if self.readonly {
            return Err(io::Error::from(io::ErrorKind::PermissionDenied));
        }
        let mut dst = FileAt {
            file: &self.file,
            offset,
        };
        mem.write_all_volatile_to(addr, &mut dst, len)
            .map_err(io::Error::other)
    }

    /// Makes every completed write durable (`fdatasync`).
    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// Deallocates a range; it reads back as zeroes where the file system
    /// can punch holes, and is a no-op (discard is advisory) where it cannot.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        match self.fallocate(
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        ) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
            r => r,
        }
    }

    /// Makes a range read back as zeroes: a punched hole when `unmap` is
    /// allowed, else zeroes allocated in place; written by hand when the
    /// file system supports neither.
    fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        let mode = if unmap {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        };
        match self.fallocate(mode, offset, len) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                self.write_zeroes_by_hand(offset, len)
            }
            r => r,
        }
    }
}

/// The file seen from a position that advances with each transfer
/// (`pread`/`pwrite`, so the file's own offset is never used).
struct FileAt<'a> {
    file: &'a File,
    offset: u64,
}

impl FileAt<'_> {
    fn pos(&self, done: usize) -> Result<libc::off64_t, VolatileMemoryError> {
        self.offset
            .checked_add(done as u64)
            .and_then(|o| libc::off64_t::try_from(o).ok())
            .ok_or_else(|| {
                VolatileMemoryError::IOError(io::Error::from(io::ErrorKind::InvalidInput))
            })
    }
}

impl ReadVolatile for FileAt<'_> {
    /// Fills `buf` unless the file ends first (a short count then).
    fn read_volatile<B: BitmapSlice>(
        &mut self,
        buf: &mut VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        let guard = buf.ptr_guard_mut();
        let base = guard.as_ptr();
        let mut done = 0usize;
        while done < buf.len() {
            let pos = self.pos(done)?;
            // SAFETY: `base` points to `buf.len()` bytes of guest memory that
            // the VolatileSlice vouches for; we write at most the remaining
            // `buf.len() - done` bytes past `done`.
            let n = unsafe {
                libc::pread64(
                    self.file.as_raw_fd(),
                    base.add(done).cast(),
                    buf.len() - done,
                    pos,
                )
            };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                // A partial read may have happened: all of it may be dirty.
                buf.bitmap().mark_dirty(0, buf.len());
                return Err(VolatileMemoryError::IOError(err));
            }
            if n == 0 {
                break;
            }
            done += n as usize;
        }
        buf.bitmap().mark_dirty(0, done);
        self.offset += done as u64;
        Ok(done)
    }
}

impl WriteVolatile for FileAt<'_> {
    /// Writes all of `buf`.
    fn write_volatile<B: BitmapSlice>(
        &mut self,
        buf: &VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        let guard = buf.ptr_guard();
        let base = guard.as_ptr();
        let mut done = 0usize;
        while done < buf.len() {
            let pos = self.pos(done)?;
            // SAFETY: `base` points to `buf.len()` readable bytes of guest
            // memory (VolatileSlice invariant); we read at most the remaining
            // `buf.len() - done` bytes past `done`.
            let n = unsafe {
                libc::pwrite64(
                    self.file.as_raw_fd(),
                    base.add(done).cast(),
                    buf.len() - done,
                    pos,
                )
            };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(VolatileMemoryError::IOError(err));
            }
            if n == 0 {
                break;
            }
            done += n as usize;
        }
        self.offset += done as u64;
        Ok(done)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::os::fd::FromRawFd;
    use std::os::unix::fs::FileExt;

    use super::*;

    /// An anonymous in-memory file of `size` bytes (memfd).
    pub fn memfile(size: u64) -> File {
        // SAFETY: the name is a valid C string; the result is checked.
        let fd = unsafe { libc::memfd_create(c"tandem-disk-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(size).unwrap();
        f
    }

    /// A disk over a memfd filled with `byte`.
    pub fn disk(size: u64, byte: u8, readonly: bool) -> (DiskFile, File) {
        let f = memfile(size);
        f.write_all_at(&vec![byte; size as usize], 0).unwrap();
        let keep = f.try_clone().unwrap();
        (
            DiskFile::from_file(f, Path::new("memfd"), readonly).unwrap(),
            keep,
        )
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    #[test]
    fn capacity_rounds_down_to_sectors() {
        let f = memfile(4096 + 100);
        let d = DiskFile::from_file(f, Path::new("m"), false).unwrap();
        assert_eq!(d.size(), 4096);
        assert_eq!(d.name(), "m");
    }

    #[test]
    fn read_write_round_trip() {
        let (d, raw) = disk(8192, 0xaa, false);
        let m = mem();
        m.write_slice(&[7u8; 1024], GuestAddress(0x1000)).unwrap();
        d.write_from_guest(&m, GuestAddress(0x1000), 1024, 512)
            .unwrap();
        let mut b = vec![0u8; 2048];
        raw.read_exact_at(&mut b, 0).unwrap();
        assert_eq!(&b[..512], &[0xaa; 512][..]);
        assert_eq!(&b[512..1536], &[7; 1024][..]);
        assert_eq!(&b[1536..], &[0xaa; 512][..]);
        d.read_to_guest(&m, GuestAddress(0x8000), 2048, 0).unwrap();
        let mut g = vec![0u8; 2048];
        m.read_slice(&mut g, GuestAddress(0x8000)).unwrap();
        assert_eq!(g, b);
        d.flush().unwrap();
    }

    #[test]
    fn reads_past_the_end_of_the_file_fail() {
        let (d, raw) = disk(4096, 1, false);
        raw.set_len(1024).unwrap(); // shrunk under the device
        let m = mem();
        assert!(d.read_to_guest(&m, GuestAddress(0), 4096, 0).is_err());
        assert!(d.read_to_guest(&m, GuestAddress(0), 1024, 0).is_ok());
    }

    #[test]
    fn readonly_refuses_every_write() {
        let (d, raw) = disk(4096, 3, true);
        let m = mem();
        assert!(d.write_from_guest(&m, GuestAddress(0), 512, 0).is_err());
        assert!(d.discard(0, 4096).is_err());
        assert!(d.write_zeroes(0, 4096, true).is_err());
        let mut b = vec![0u8; 4096];
        raw.read_exact_at(&mut b, 0).unwrap();
        assert!(b.iter().all(|&x| x == 3));
    }

    #[test]
    fn discard_and_write_zeroes_read_back_as_zeroes() {
        let (d, raw) = disk(64 << 10, 0x55, false);
        d.discard(4096, 8192).unwrap();
        d.write_zeroes(32 << 10, 4096, false).unwrap();
        d.write_zeroes(40 << 10, 4096, true).unwrap();
        d.write_zeroes_by_hand(48 << 10, 1000).unwrap();
        let mut b = vec![0u8; 64 << 10];
        raw.read_exact_at(&mut b, 0).unwrap();
        let zero = |r: std::ops::Range<usize>| b[r].iter().all(|&x| x == 0);
        let kept = |r: std::ops::Range<usize>| b[r].iter().all(|&x| x == 0x55);
        assert!(kept(0..4096) && zero(4096..12288) && kept(12288..32768));
        assert!(zero(32768..36864) && kept(36864..40960) && zero(40960..45056));
        assert!(kept(45056..49152) && zero(49152..50152) && kept(50152..65536));
    }

    #[test]
    fn a_second_writer_is_refused() {
        let path = std::env::temp_dir().join(format!("tandem-lock-{}.img", std::process::id()));
        std::fs::write(&path, vec![0u8; 4096]).unwrap();
        let first = DiskFile::open(&path, false).unwrap();
        assert!(matches!(
            DiskFile::open(&path, false),
            Err(DiskError::Locked(_))
        ));
        assert!(matches!(
            DiskFile::open(&path, true),
            Err(DiskError::Locked(_))
        ));
        drop(first);
        let r1 = DiskFile::open(&path, true).unwrap();
        let r2 = DiskFile::open(&path, true).unwrap();
        assert!(r1.readonly() && r2.readonly());
        assert!(matches!(
            DiskFile::open(&path, false),
            Err(DiskError::Locked(_))
        ));
        drop((r1, r2));
        let dir = std::env::temp_dir();
        assert!(matches!(
            DiskFile::open(&dir, true),
            Err(DiskError::NotAFile(_)) | Err(DiskError::Open { .. })
        ));
        let _ = std::fs::remove_file(&path);
    }
}

//! Guest pages mapped from a file: a snapshot's pages put over guest RAM
//! with `mmap(MAP_PRIVATE | MAP_FIXED)`, so that a restore reads nothing
//! and each page comes from the page cache when the guest (or the VMM)
//! first touches it; a write copies the page, and the file is never
//! written.
//!
//! Runs on the thread that builds the VM, before any vCPU runs and before
//! any device is activated. Never does: map outside guest RAM (every range
//! is checked against vm-memory's regions first), or map a file that
//! tandem will write (snapshots are replaced by rename, never rewritten in
//! place).

use std::fs::File;
use std::os::fd::AsRawFd;

use vm_memory::{GuestAddress, GuestMemoryBackend};

use devices::GuestMemoryMmap;

/// Why a range could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum FileMapError {
    #[error("{len:#x} bytes at {gpa:#x} are not inside one region of guest memory")]
    Outside { gpa: u64, len: u64 },
    #[error("file offset {offset:#x} or length {len:#x} is not page-aligned")]
    Unaligned { offset: u64, len: u64 },
    #[error("cannot map {len:#x} bytes of the file at {gpa:#x}: {source}")]
    Mmap {
        gpa: u64,
        len: u64,
        source: std::io::Error,
    },
}

/// Maps `len` bytes of `file` from `offset` over guest memory at `gpa`,
/// private (copy on write). The range must lie inside one region, and
/// `offset` and `len` be page multiples.
pub fn map_private(
    mem: &GuestMemoryMmap,
    gpa: u64,
    len: u64,
    file: &File,
    offset: u64,
) -> Result<(), FileMapError> {
    if !offset.is_multiple_of(4096) || !len.is_multiple_of(4096) || !gpa.is_multiple_of(4096) {
        return Err(FileMapError::Unaligned { offset, len });
    }
    let outside = || FileMapError::Outside { gpa, len };
    let n = usize::try_from(len).map_err(|_| outside())?;
    let slice = mem.get_slice(GuestAddress(gpa), n).map_err(|_| outside())?;
    let host = slice.ptr_guard_mut().as_ptr();
    let off = libc::off_t::try_from(offset).map_err(|_| FileMapError::Unaligned { offset, len })?;
    // SAFETY: `host..host + n` lies inside one mapping that `mem` owns and
    // keeps until the VM ends (get_slice checked the bounds), so MAP_FIXED
    // replaces only guest RAM, never another mapping of this process. The
    // VMM reaches guest RAM only through vm-memory's volatile accessors, so
    // no Rust reference to these bytes exists. The result is checked.
    let got = unsafe {
        libc::mmap(
            host.cast(),
            n,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
            file.as_raw_fd(),
            off,
        )
    };
    if got == libc::MAP_FAILED || got != host.cast() {
        return Err(FileMapError::Mmap {
            gpa,
            len,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

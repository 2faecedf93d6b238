//! The virtio-blk devices' parts (image opened and locked, its backend,
//! handler) and what the VM asks of a disk slot: its lock's hand-over, a
//! flush, the record of its writes ([`DiskWrites`]).
//!
//! Built on the VMM thread with the other devices; the slot methods are
//! called from the migration and COLO threads. A writable disk's backend
//! is a [`Tracked`] image (its log off unless a COLO pair runs), unless
//! the layer above gives a [`WrapDisk`] (a COLO secondary's replica): the
//! wiring names no feature's backend. Never does: read or write the
//! image itself.

use std::any::Any;
use std::fs::File;
use std::sync::{Arc, Mutex};

use devices::virtio::block::backend::DiskBackend;
use devices::virtio::block::disk::DiskFile;
use devices::virtio::block::handler::BlockHandler;
use devices::virtio::block::tracked::{Tracked, WriteLog};
use devices::virtio::block::{Block, BlockConfig};

use super::{eventfd, DeviceError, Report, VirtioParts, VirtioSlot, Wiring};
use crate::config::{self, DiskSpec};

/// Serves a writable image through another backend (a COLO secondary's
/// replica): returns the backend the device uses and what the layer above
/// keeps of it ([`DiskWrites::Wrapped`]).
pub type WrapDisk = fn(DiskFile) -> std::io::Result<(Arc<dyn DiskBackend>, KeptDisk)>;

/// What the layer above keeps of a wrapped disk's backend.
pub type KeptDisk = Arc<dyn Any + Send + Sync>;

/// What the layer above (COLO) can read back of a disk's writes.
pub enum DiskWrites {
    /// A read-only disk: nothing to replicate.
    None,
    /// Any VM's but a COLO secondary's: the log of what its guest wrote,
    /// and the image to read that back from.
    Tracked { log: Arc<WriteLog>, file: File },
    /// The backend a [`WrapDisk`] made, for that layer to downcast.
    Wrapped(KeptDisk),
}

impl VirtioSlot {
    /// A disk's image lock taken (`held`) or released, after its completed
    /// writes are made durable; `None` for a device that is not a disk.
    pub fn hold_disk_lock(&self, held: bool) -> Option<std::io::Result<()>> {
        match &self.report {
            Report::Disk { backend, .. } => {
                Some(backend.flush().and_then(|()| backend.hold_lock(held)))
            }
            _ => None,
        }
    }

    /// Makes a disk's completed writes durable (`None`: not a disk).
    pub fn flush_disk(&self) -> Option<std::io::Result<()>> {
        match &self.report {
            Report::Disk { backend, .. } => Some(backend.flush()),
            _ => None,
        }
    }

    /// What is kept of this disk's writes (`None`: not a disk).
    pub fn disk_writes(&self) -> Option<&DiskWrites> {
        match &self.report {
            Report::Disk { writes, .. } => Some(writes),
            _ => None,
        }
    }
}

/// A virtio-blk device on the image of `spec`.
/// With `defer_lock` (a migration's destination) the image is opened
/// without its lock, which is taken at the switch-over; with `wrap` (a
/// COLO secondary's) a writable image is served through what it makes.
pub(super) fn disk_parts(
    spec: &DiskSpec,
    w: Wiring,
    defer_lock: bool,
    wrap: Option<WrapDisk>,
) -> Result<VirtioParts, DeviceError> {
    let path = spec.path.display().to_string();
    let open = if defer_lock {
        DiskFile::open_unlocked
    } else {
        DiskFile::open
    };
    let file = open(&spec.path, spec.readonly).map_err(|source| DeviceError::Disk {
        path: path.clone(),
        source,
    })?;
    let id = spec
        .id
        .clone()
        .unwrap_or_else(|| config::default_disk_id(&spec.path));
    let activate = eventfd()?;
    let evt = activate.try_clone().map_err(DeviceError::EventFd)?;
    let size_err = |source| DeviceError::DiskSize {
        path: path.clone(),
        source,
    };
    let config = BlockConfig::with_id(&id);
    let (block, writes) = if spec.readonly {
        (Block::new(config, file, evt), DiskWrites::None)
    } else if let Some(wrap) = wrap {
        let (backend, kept) = wrap(file).map_err(size_err)?;
        (
            Block::shared(config, backend, evt),
            DiskWrites::Wrapped(kept),
        )
    } else {
        let read = file.file().try_clone().map_err(size_err)?;
        let (tracked, log) = Tracked::new(file);
        (
            Block::new(config, tracked, evt),
            DiskWrites::Tracked { log, file: read },
        )
    };
    let Some(queue_evt) = w.queue_evts.into_iter().next() else {
        return Err(DeviceError::EventFd(std::io::Error::other(
            "one queue wanted",
        )));
    };
    let counters = block.metrics.clone();
    let disk = block.disk();
    let handler = BlockHandler::new(
        block.state(),
        block.disk(),
        block.id(),
        activate,
        queue_evt,
        w.interrupt,
        counters.clone(),
    );
    Ok(VirtioParts {
        device: Box::new(block),
        handler: Arc::new(Mutex::new(handler)),
        report: Report::Disk {
            path,
            id,
            readonly: spec.readonly,
            counters,
            backend: disk,
            writes,
        },
    })
}

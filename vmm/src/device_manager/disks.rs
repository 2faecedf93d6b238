//! The virtio-blk devices' parts (image opened and locked, the backend
//! COLO needs, handler) and what the VM asks of a disk slot: its lock's
//! hand-over, a flush, COLO's write log or replica.
//!
//! Built on the VMM thread with the other devices; the slot methods are
//! called from the migration and COLO threads. A writable disk's backend
//! is a [`Tracked`] image (its log off unless a COLO pair runs) on a
//! VM that is not a COLO secondary, and a [`Replica`] on one.

use std::fs::File;
use std::sync::{Arc, Mutex};

use devices::virtio::block::disk::DiskFile;
use devices::virtio::block::handler::BlockHandler;
use devices::virtio::block::tracked::{Tracked, WriteLog};
use devices::virtio::block::{Block, BlockConfig};

use super::{eventfd, DeviceError, Report, VirtioParts, VirtioSlot, Wiring};
use crate::colo::replica::Replica;
use crate::config::{self, DiskSpec};

/// What COLO holds of a disk.
pub enum ColoDisk {
    /// A read-only disk: nothing to replicate.
    None,
    /// A primary's (any VM's but a secondary's): the log of what its guest
    /// wrote, and the image to read that back from.
    Tracked { log: Arc<WriteLog>, file: File },
    /// A secondary's: journal, overlay, image.
    Replica(Arc<Replica>),
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

    /// What COLO holds of this disk (`None`: not a disk).
    pub fn colo_disk(&self) -> Option<&ColoDisk> {
        match &self.report {
            Report::Disk { colo, .. } => Some(colo),
            _ => None,
        }
    }
}

/// A virtio-blk device on the image of `spec`.
/// With `defer_lock` (a migration's destination) the image is opened
/// without its lock, which is taken at the switch-over; with `replica` (a
/// COLO secondary's) a writable image is served through a [`Replica`].
pub(super) fn disk_parts(
    spec: &DiskSpec,
    w: Wiring,
    defer_lock: bool,
    replica: bool,
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
    let (block, colo) = if spec.readonly {
        (Block::new(config, file, evt), ColoDisk::None)
    } else if replica {
        let r = Arc::new(Replica::new(file).map_err(size_err)?);
        (Block::shared(config, r.clone(), evt), ColoDisk::Replica(r))
    } else {
        let read = file.file().try_clone().map_err(size_err)?;
        let (tracked, log) = Tracked::new(file);
        (
            Block::new(config, tracked, evt),
            ColoDisk::Tracked { log, file: read },
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
            colo,
        },
    })
}

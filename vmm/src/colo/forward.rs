//! The COLO primary's disk forwarding (design.md §6, Disk): the ranges its
//! guest changed on each writable disk (noted by the disk's
//! [`WriteLog`]) are read back from the image and sent to the secondary
//! as `DiskWrite` messages, a share at each turn of the `colo` thread and
//! the rest with the guest paused at a checkpoint, before the pages.
//!
//! Runs on the primary's `colo` thread. The logs are on from before the
//! disks are hashed at the start (so nothing written during the initial
//! sync is missed) until the pair ends. Never does: send a range before
//! the write that noted it completed (the log notes after); leave a range
//! unsent at a checkpoint's commit; allocate more than one message's data
//! at a time.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use devices::virtio::block::tracked::WriteLog;
use migration::protocol::colo::{DiskWrite, DISK_WRITE_MAX};
use migration::protocol::{self, Message};

use super::ColoError;
use crate::device_manager::DiskWrites;
use crate::vm::VmHandle;

/// One writable disk's log and a handle on its image for reading.
struct Disk {
    index: u32,
    log: Arc<WriteLog>,
    file: File,
}

/// See the module doc.
pub struct Forwarder {
    disks: Vec<Disk>,
    /// Bytes sent since the last committed checkpoint.
    since_commit: u64,
    /// Bytes sent in all.
    total: u64,
}

impl Forwarder {
    /// Turns on the log of each writable disk of `vm`.
    pub fn start(vm: &VmHandle) -> Result<Forwarder, ColoError> {
        let mut disks = Vec::new();
        let mut index = 0u32;
        for slot in vm.virtio().iter() {
            let Some(disk) = slot.disk_writes() else {
                continue;
            };
            // A primary's disk, or a secondary's that took over (a
            // re-protect).
            let logged = match disk {
                DiskWrites::Tracked { log, file } => Some((log.clone(), file.try_clone())),
                DiskWrites::Wrapped(w) => match super::replica::downcast(w) {
                    Some(r) => {
                        let (l, f) = r.write_log().map_err(ColoError::Stream)?;
                        Some((l, Ok(f)))
                    }
                    None => None,
                },
                DiskWrites::None => None,
            };
            if let Some((log, file)) = logged {
                let file = file.map_err(ColoError::Stream)?;
                log.set(true);
                disks.push(Disk { index, log, file });
            }
            index += 1;
        }
        Ok(Forwarder {
            disks,
            since_commit: 0,
            total: 0,
        })
    }

    /// Sends up to `budget` bytes of what the guests wrote (all of it with
    /// `u64::MAX`); returns the bytes sent.
    pub fn send(&mut self, conn: &mut impl std::io::Write, budget: u64) -> Result<u64, ColoError> {
        let mut sent = 0u64;
        let mut buf = Vec::new();
        for d in &self.disks {
            for (start, end) in d.log.take(budget - sent) {
                let mut at = start;
                while at < end {
                    let n = (end - at).min(DISK_WRITE_MAX as u64) as usize;
                    buf.resize(n, 0);
                    d.file
                        .read_exact_at(&mut buf, at)
                        .map_err(ColoError::Stream)?;
                    let w = DiskWrite {
                        disk: d.index,
                        offset: at,
                        data: std::mem::take(&mut buf),
                    };
                    let m = Message::DiskWrite(w);
                    protocol::write_message(conn, &m)?;
                    if let Message::DiskWrite(w) = m {
                        buf = w.data;
                    }
                    at += n as u64;
                }
                sent += end - start;
            }
            if sent >= budget {
                break;
            }
        }
        self.since_commit += sent;
        self.total += sent;
        Ok(sent)
    }

    /// Whether the guest wrote anything not forwarded yet.
    pub fn pending(&self) -> bool {
        self.disks.iter().any(|d| d.log.pending() > 0)
    }

    /// Whether the secondary's journal is due to be emptied by a
    /// checkpoint.
    pub fn due(&self) -> bool {
        self.since_commit >= super::replica::CHECKPOINT_AT
    }

    /// A checkpoint committed: the secondary's journal is empty again.
    pub fn committed(&mut self) {
        self.since_commit = 0;
    }

    /// Bytes forwarded in all.
    pub fn total(&self) -> u64 {
        self.total
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        for d in &self.disks {
            d.log.set(false);
        }
    }
}

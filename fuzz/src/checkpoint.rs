//! A COLO checkpoint through the secondary's reader, short of KVM, for the
//! `colo_checkpoint` target: `vmm::colo::incoming::read_checkpoint` (memory
//! batches checked against the secondary's layout and bounded by its guest
//! size, one state image checked as a restore checks it, then the commit)
//! and, for a checkpoint taken whole, its pages written into guest memory;
//! the same fixed secondary as `stream` ([`crate::stream::MEM`], one vCPU,
//! the serial console).
//!
//! Invariants asserted (a panic is a finding): a checkpoint taken carries
//! no more pages than the guest has, its state is this VM's, and its pages
//! all land inside guest memory.

use migration::protocol::{self, MemoryBatch, Message};
use replication::journal::SecondaryDisk;
use vmm::boot::layout;
use vmm::colo::incoming::{read_checkpoint, write_pages};

use crate::stream::{manifest, memory, reset, MEM};

/// The secondary's disk here, bytes.
const DISK: usize = 1 << 20;

/// Reads a checkpoint from `bytes`: `Ok(pages)` when a whole one was taken.
pub fn receive(bytes: &[u8]) -> Result<u64, String> {
    let ours = manifest();
    let limit = MEM / protocol::PAGE_SIZE;
    // The primary's disk writes go to a journal over a small disk, as the
    // secondary's replica does.
    let mut disk = SecondaryDisk::new(vec![0u8; DISK], DISK as u64);
    let mut journal = |w: &protocol::colo::DiskWrite| {
        if w.disk != 0 {
            return Err(vmm::colo::ColoError::NotReplicated(w.disk));
        }
        disk.journal_primary_write(w.offset, &w.data)
            .map_err(|source| vmm::colo::ColoError::Journal { disk: 0, source })
    };
    let c = read_checkpoint(
        &mut &bytes[..],
        &layout::ram_ranges(MEM),
        limit,
        &ours,
        &mut journal,
    )
    .map_err(|e| e.to_string())?;
    disk.commit_checkpoint()
        .unwrap_or_else(|e| panic!("a journal over memory failed its commit: {e}"));
    assert!(c.pages <= limit, "{} pages taken for {limit}", c.pages);
    assert_eq!(c.state.manifest.mem_bytes, MEM, "another VM's state taken");
    let mem = memory();
    reset(mem);
    if let Err(e) = write_pages(mem, &c) {
        panic!("a checked checkpoint failed against guest memory: {e}");
    }
    Ok(c.pages)
}

/// A well-formed checkpoint: a disk write, `batches`, the state `image`,
/// the commit.
pub fn checkpoint(batches: &[MemoryBatch], image: Vec<u8>) -> Vec<u8> {
    let mut out = Vec::new();
    let mut msgs = vec![Message::DiskWrite(protocol::colo::DiskWrite {
        disk: 0,
        offset: 4096,
        data: vec![0x5a; 512],
    })];
    msgs.extend(batches.iter().cloned().map(Message::Memory));
    msgs.push(Message::State(image));
    msgs.push(Message::Commit);
    for m in &msgs {
        protocol::write_message(&mut out, m).expect("encode a message");
    }
    out
}

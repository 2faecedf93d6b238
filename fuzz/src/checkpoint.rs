//! A COLO checkpoint through the secondary's reader, short of KVM, for the
//! `colo_checkpoint` target: the pages sent ahead (leading `Memory`
//! messages into `vmm::colo::incoming::Staged`, checked and bounded), then
//! `vmm::colo::incoming::read_checkpoint` (memory
//! batches checked against the secondary's layout and bounded by its guest
//! size, one state image checked as a restore checks it, then the commit)
//! and, for a checkpoint taken whole, its pages written into guest memory;
//! the same fixed secondary as `stream` ([`crate::stream::MEM`], one vCPU,
//! the serial console).
//!
//! Invariants asserted (a panic is a finding): a checkpoint taken carries
//! no more pages than twice the guest's (as many ahead, as many in it), its state is this VM's, and its pages
//! all land inside guest memory.

use migration::protocol::{self, MemoryBatch, Message};
use replication::journal::SecondaryDisk;
use vmm::boot::layout;
use vmm::colo::incoming::{read_checkpoint, write_pages, Staged};

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
    let layout = layout::ram_ranges(MEM);
    // The pages sent ahead: leading `Memory` messages.
    let mut staged = Staged::default();
    let mut rest = bytes;
    loop {
        let mut r = rest;
        match protocol::read_message(&mut r) {
            Ok(Message::Memory(b)) => {
                staged.push(b, &layout, limit).map_err(|e| e.to_string())?;
                rest = r;
            }
            _ => break,
        }
    }
    assert!(staged.pages() <= limit, "{} pages held for {limit}", staged.pages());
    let mut c = read_checkpoint(
        &mut &rest[..],
        &layout,
        limit,
        &ours,
        &mut journal,
    )
    .map_err(|e| e.to_string())?;
    staged.prepend_to(&mut c);
    disk.commit_checkpoint()
        .unwrap_or_else(|e| panic!("a journal over memory failed its commit: {e}"));
    assert!(c.pages <= 2 * limit, "{} pages taken for {limit}", c.pages);
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

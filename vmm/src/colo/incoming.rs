//! One checkpoint as the secondary reads it, short of KVM (what the
//! `colo_checkpoint` fuzz target runs): after its `Dirty` went out, the
//! primary's last disk writes (handed to the caller's journal, which
//! applies nothing before the commit either), memory batches until
//! `Commit`, and one state image, all held until the commit before
//! anything is applied.
//!
//! Pure but for the stream it reads; called on the secondary's `incoming`
//! thread. Everything read is the peer's and hostile: each batch is checked
//! against the secondary's own layout, the pages of a checkpoint are
//! bounded by its guest size (so what is held is too), a second state
//! image or any other message is refused, and the state is checked as a
//! snapshot restore checks it, against this VM's manifest. Never writes
//! guest memory (see [`write_pages`], called once the checkpoint is whole).

use std::io::{Cursor, Read};

use devices::GuestMemoryMmap;
use migration::protocol::colo::DiskWrite;
use migration::protocol::{self, MemoryBatch, Message, ProtocolError};
use migration::Manifest;

use super::ColoError;
use crate::vstate::vm_state::VmState;

/// A whole checkpoint, checked, not applied.
pub struct Checkpoint {
    pub batches: Vec<MemoryBatch>,
    pub state: VmState,
    /// Pages its batches carry (data and zero).
    pub pages: u64,
}

/// Reads one checkpoint from `conn`: disk writes to `journal`, batches
/// checked against `layout`, at most `limit` pages in all, one state
/// checked against `ours`, then the commit.
pub fn read_checkpoint<R: Read>(
    conn: &mut R,
    layout: &[(u64, u64)],
    limit: u64,
    ours: &Manifest,
    journal: &mut dyn FnMut(&DiskWrite) -> Result<(), ColoError>,
) -> Result<Checkpoint, ColoError> {
    let mut batches = Vec::new();
    let mut pages = 0u64;
    let mut image = None;
    loop {
        match protocol::read_message(conn)? {
            Message::Memory(b) => {
                b.check(layout)?;
                pages = pages.saturating_add(b.pages());
                if pages > limit {
                    return Err(ColoError::TooBig { pages, limit });
                }
                batches.push(b);
            }
            Message::DiskWrite(w) => journal(&w)?,
            Message::State(i) if image.is_none() => image = Some(i),
            Message::Commit => break,
            Message::Abandon(why) => return Err(ProtocolError::Abandoned(why).into()),
            other => {
                return Err(ColoError::Unexpected {
                    got: other.command().name(),
                    place: "in a checkpoint",
                })
            }
        }
    }
    let image = image.ok_or(ColoError::NoState)?;
    let state = crate::snapshot::load_image_for(Cursor::new(image), "the checkpoint", ours)?.state;
    Ok(Checkpoint {
        batches,
        state,
        pages,
    })
}

/// Writes the pages of a whole checkpoint into guest memory.
pub fn write_pages(mem: &GuestMemoryMmap, c: &Checkpoint) -> Result<(), ColoError> {
    for b in &c.batches {
        crate::migrate::dest::write_batch(mem, b)?;
    }
    Ok(())
}

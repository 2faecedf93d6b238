//! One checkpoint as the secondary reads it, short of KVM (what the
//! `colo_checkpoint` fuzz target runs): the pages the primary sent ahead
//! while both guests ran ([`Staged`]); after its `Dirty` went out, the
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
    let mut own = Staged::default();
    let mut image = None;
    loop {
        match protocol::read_message(conn)? {
            Message::Memory(b) => own.push(b, layout, limit)?,
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
        batches: own.batches,
        state,
        pages: own.pages,
    })
}

/// Pages the primary sends ahead of a checkpoint while both guests run
/// (its pre-copy, `Memory` messages between checkpoints): checked as a
/// checkpoint's batches are, bounded by the guest's size, held, and put in
/// front of the next checkpoint's own batches (they are older: a page sent
/// again in the checkpoint is written after). Never applied without that
/// checkpoint's commit; a takeover drops them.
#[derive(Default)]
pub struct Staged {
    batches: Vec<MemoryBatch>,
    pages: u64,
}

impl Staged {
    /// Holds one batch, checked against `layout`; at most `limit` pages in
    /// all.
    pub fn push(
        &mut self,
        b: MemoryBatch,
        layout: &[(u64, u64)],
        limit: u64,
    ) -> Result<(), ColoError> {
        b.check(layout)?;
        let pages = self.pages.saturating_add(b.pages());
        if pages > limit {
            return Err(ColoError::TooBig { pages, limit });
        }
        self.pages = pages;
        self.batches.push(b);
        Ok(())
    }

    /// Pages held.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Puts what is held in front of `c`'s batches, and empties it.
    pub fn prepend_to(&mut self, c: &mut Checkpoint) {
        let pages = self.prepend(&mut c.batches);
        c.pages = c.pages.saturating_add(pages);
    }

    /// Puts what is held in front of `batches`, empties it, and returns
    /// how many pages it held.
    fn prepend(&mut self, batches: &mut Vec<MemoryBatch>) -> u64 {
        let mut held = std::mem::take(&mut self.batches);
        held.append(batches);
        *batches = held;
        std::mem::take(&mut self.pages)
    }
}

/// Writes the pages of a whole checkpoint into guest memory.
pub fn write_pages(mem: &GuestMemoryMmap, c: &Checkpoint) -> Result<(), ColoError> {
    for b in &c.batches {
        crate::migrate::dest::write_batch(mem, b)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use migration::protocol::PageRange;

    fn zero_batch(gpa: u64, pages: u32) -> MemoryBatch {
        MemoryBatch {
            ranges: vec![PageRange {
                gpa,
                pages,
                zero: true,
            }],
            data: Vec::new(),
        }
    }

    #[test]
    fn pages_sent_ahead_are_checked_bounded_and_go_first() {
        let layout = [(0u64, 16 * 4096u64)];
        let mut staged = Staged::default();
        staged.push(zero_batch(0, 4), &layout, 16).unwrap();
        let outside = staged.push(zero_batch(15 * 4096, 2), &layout, 16);
        assert!(outside.is_err(), "a batch past the layout was held");
        let too_many = staged.push(zero_batch(4096, 13), &layout, 16);
        assert!(matches!(
            too_many,
            Err(ColoError::TooBig {
                pages: 17,
                limit: 16
            })
        ));
        assert_eq!(staged.pages(), 4);
        let mut batches = vec![zero_batch(8192, 1)];
        assert_eq!(staged.prepend(&mut batches), 4);
        assert_eq!(batches[0].ranges[0].gpa, 0, "older pages first");
        assert_eq!(batches[1].ranges[0].gpa, 8192);
        assert_eq!(staged.pages(), 0);
    }
}

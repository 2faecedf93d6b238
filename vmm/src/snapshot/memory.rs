//! How a restore puts a snapshot's pages into guest memory: mapped from
//! the file (`MAP_PRIVATE`, through `vstate::file_map`) with their CRC
//! checked afterwards by [`PageCheck`], or copied. Runs on the thread that
//! builds the VM (the check on a thread `builder` starts for it). Never
//! does: map a file of format version 2 (its pages are not page-aligned),
//! or write the snapshot file.

use std::fs::File;
use std::time::Instant;

use devices::GuestMemoryMmap;
use migration::memory::ImageStats;
use migration::{section, SnapshotReader};

use super::{ms_since, Restore, SnapshotError};
use crate::boot::layout;

/// How a restore puts the snapshot's pages into guest memory
/// (`--restore-memory`).
#[derive(clap::ValueEnum, serde::Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum MemoryMode {
    /// Map them from the file, private (copy on write): nothing is read
    /// before the guest runs. A file of format version 2 is copied.
    #[default]
    Map,
    /// Read and copy every page, checking their CRC, before the guest runs.
    Copy,
}

/// How a restore's pages went into guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    /// Mapped from the file (`MAP_PRIVATE`).
    Mapped,
    /// Copied (read, CRC checked).
    Copied,
}

impl Restore<File> {
    /// Puts the stored pages into fresh (zeroed) guest memory as
    /// [`Restore::memory`] asks: mapped from the file where it is of format
    /// version 3, else copied.
    pub fn place_memory(
        &mut self,
        mem: &GuestMemoryMmap,
    ) -> Result<(ImageStats, Placed), SnapshotError> {
        if self.memory == MemoryMode::Copy {
            return Ok((self.fill_memory(mem)?, Placed::Copied));
        }
        let layout = layout::ram_ranges(self.state.manifest.mem_bytes);
        let plan = migration::memory::plan_mapping(&mut self.reader, section::MEMORY, &layout)
            .map_err(|err| self.memory_error(err))?;
        let Some(plan) = plan else {
            return Ok((self.fill_memory(mem)?, Placed::Copied));
        };
        let mut offset = plan.offset;
        for run in &plan.runs {
            let len = u64::from(run.pages) * migration::memory::PAGE_SIZE;
            crate::vstate::file_map::map_private(mem, run.gpa, len, self.reader.get_ref(), offset)
                .map_err(|e| self.invalid(format!("mapping its memory: {e}")))?;
            offset += len;
        }
        let stats = ImageStats {
            runs: plan.runs.len() as u64,
            pages: plan.runs.iter().map(|r| u64::from(r.pages)).sum(),
            body_len: 0,
        };
        Ok((stats, Placed::Mapped))
    }

    /// What is left to check of a restore whose pages were mapped.
    pub fn page_check(self) -> PageCheck {
        PageCheck {
            layout: layout::ram_ranges(self.state.manifest.mem_bytes),
            reader: self.reader,
            path: self.path,
        }
    }
}

/// The pages of a restore that mapped them, whose CRC is still to be
/// checked (by a thread of its own, while the guest runs: reading them
/// before would make the restore as slow as a copy).
pub struct PageCheck {
    reader: SnapshotReader<File>,
    layout: Vec<(u64, u64)>,
    path: String,
}

impl PageCheck {
    /// Reads every stored page from the file (not from guest memory, which
    /// the guest is changing) and checks their CRC; returns the time taken
    /// in ms.
    pub fn run(mut self) -> Result<f64, SnapshotError> {
        let t = Instant::now();
        migration::memory::verify_pages(&mut self.reader, section::MEMORY, &self.layout).map_err(
            |err| SnapshotError::Memory {
                path: self.path.clone(),
                err,
            },
        )?;
        Ok(ms_since(t))
    }

    /// The snapshot file's path, for messages.
    pub fn path(&self) -> &str {
        &self.path
    }
}

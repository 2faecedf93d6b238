//! The MSI-X table of a virtio-pci function (PCI 3.0, 6.8.2): per vector
//! a message address, message data and vector control (the mask bit),
//! 16 bytes each; and the pending bit array.
//!
//! The guest writes the table through the BAR (dword or aligned qword
//! accesses; anything else is refused and counted by the caller). Each
//! new message is handed to the VMM's [`MsiRoutes`] at once, so that the
//! vector's irqfd reaches the right local APIC; the mask bits live in the
//! [`Interrupt`], which holds a masked vector's interrupt as pending.

use migration::devices::MsixEntryState;

use super::MsiRoutes;
use crate::virtio::interrupt::{Interrupt, MaskState};

#[derive(Clone, Copy, Default)]
struct Entry {
    address: u64,
    data: u32,
}

/// The messages of the vectors.
pub struct MsixTable {
    entries: Vec<Entry>,
}

fn route(routes: &mut dyn MsiRoutes, vector: usize, e: Entry) {
    if let Err(err) = routes.set(vector, e.address, e.data) {
        log::warn!("virtio-pci: cannot route MSI-X vector {vector}: {err}");
    }
}

impl MsixTable {
    /// A table of `n` vectors, all zero (and masked, in the interrupt).
    pub fn new(n: usize) -> MsixTable {
        MsixTable {
            entries: vec![Entry::default(); n],
        }
    }

    /// The number of vectors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A read at `offset` in the table; `false` for a senseless one
    /// (answered with zeros).
    pub fn read_table(&self, offset: u64, data: &mut [u8]) -> bool {
        data.fill(0);
        let (index, field) = ((offset / 16) as usize, offset % 16);
        let Some(e) = self.entries.get(index) else {
            return false;
        };
        if !offset.is_multiple_of(4) || !matches!(data.len(), 4 | 8) {
            return false;
        }
        if data.len() == 8 && field % 8 != 0 {
            return false;
        }
        let mut row = [0u8; 16];
        row[0..8].copy_from_slice(&e.address.to_le_bytes());
        row[8..12].copy_from_slice(&e.data.to_le_bytes());
        // Vector control (the mask bit) is read where the interrupt keeps
        // it; the caller fills it in.
        let f = field as usize;
        data.copy_from_slice(&row[f..f + data.len()]);
        true
    }

    /// A write at `offset` in the table: a new message is routed, a
    /// vector control write masks or unmasks. `false` for a senseless
    /// one (ignored).
    pub fn write_table(
        &mut self,
        offset: u64,
        data: &[u8],
        interrupt: &Interrupt,
        routes: &mut dyn MsiRoutes,
    ) -> bool {
        let (index, field) = ((offset / 16) as usize, offset % 16);
        let Some(e) = self.entries.get_mut(index) else {
            return false;
        };
        if !offset.is_multiple_of(4) || !matches!(data.len(), 4 | 8) {
            return false;
        }
        let mut b = [0u8; 8];
        b[..data.len()].copy_from_slice(data);
        let v = u64::from_le_bytes(b);
        match (field, data.len()) {
            (0, 4) => e.address = (e.address & !0xffff_ffff) | (v & 0xffff_ffff),
            (0, 8) => e.address = v,
            (4, 4) => e.address = (e.address & 0xffff_ffff) | (v << 32),
            (8, 4) => e.data = v as u32,
            (8, 8) => {
                e.data = v as u32;
                let masked = (v >> 32) & 1 != 0;
                interrupt.update_masks(|m| set_mask(m, index, masked));
            }
            (12, 4) => {
                let masked = v & 1 != 0;
                interrupt.update_masks(|m| set_mask(m, index, masked));
                return true;
            }
            _ => return false,
        }
        route(routes, index, *e);
        true
    }

    /// The table with the masks and pending bits of `masks`.
    pub fn save(&self, masks: &MaskState) -> Vec<MsixEntryState> {
        self.entries
            .iter()
            .enumerate()
            .map(|(i, e)| MsixEntryState {
                address: e.address,
                data: e.data,
                masked: masks.masked.get(i).copied().unwrap_or(true),
                pending: masks.pending.get(i).copied().unwrap_or(false),
            })
            .collect()
    }

    /// Puts a saved table back (as long as this one: the caller checked)
    /// and routes every vector.
    pub fn restore(
        &mut self,
        saved: &[MsixEntryState],
        interrupt: &Interrupt,
        routes: &mut dyn MsiRoutes,
    ) {
        for (i, (e, s)) in self.entries.iter_mut().zip(saved).enumerate() {
            *e = Entry {
                address: s.address,
                data: s.data,
            };
            route(routes, i, *e);
        }
        interrupt.update_masks(|m| {
            for (i, s) in saved.iter().enumerate() {
                set_mask(m, i, s.masked);
                if let Some(p) = m.pending.get_mut(i) {
                    *p = s.pending;
                }
            }
        });
    }
}

fn set_mask(m: &mut MaskState, index: usize, masked: bool) {
    if let Some(b) = m.masked.get_mut(index) {
        *b = masked;
    }
}

/// Fills in the vector control dword (its mask bit) of a table read at
/// `offset` of `data.len()` bytes, from `masks`.
pub fn fill_control(masks: &MaskState, offset: u64, data: &mut [u8]) {
    let (index, field) = ((offset / 16) as usize, offset % 16);
    let masked = u8::from(masks.masked.get(index).copied().unwrap_or(true));
    match (field, data.len()) {
        (12, 4) => data[0] = masked,
        (8, 8) => data[4] = masked,
        _ => {}
    }
}

/// A read of the pending bit array at `offset`; `false` for a senseless
/// one (answered with zeros).
pub fn read_pba(pending: &[bool], offset: u64, data: &mut [u8]) -> bool {
    data.fill(0);
    if !offset.is_multiple_of(4) || !matches!(data.len(), 4 | 8) {
        return false;
    }
    let first = (offset * 8) as usize;
    if first >= pending.len().max(1).div_ceil(64) * 64 {
        return false;
    }
    for (bit, p) in pending.iter().enumerate().skip(first) {
        let rel = bit - first;
        if rel >= data.len() * 8 {
            break;
        }
        if *p {
            data[rel / 8] |= 1 << (rel % 8);
        }
    }
    true
}

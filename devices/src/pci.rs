//! PCI bus 0 through configuration mechanism #1: port 0xCF8 latches
//! CONFIG_ADDRESS (enable bit 31, bus 23:16, device 15:11, function 10:8,
//! register 7:2), ports 0xCFC-0xCFF read and write the addressed dword's
//! bytes. On the bus sits a host bridge at 00:00.0 that says it is an
//! i440FX (8086:1237, class 06:00:00), the one firmware such as OVMF
//! looks for; virtio-pci functions are to join it.
//!
//! Driven by whichever vCPU thread exits on the ports; never blocks. A
//! guest access that makes no sense (a size other than 1, 2 or 4 bytes, a
//! data access that crosses its dword) reads all ones, writes nothing and
//! is counted; an absent function reads all ones, as on real hardware.
//! Only the bytes a function declares writable change; a saved state
//! restores those bytes and nothing else, so a snapshot file cannot change
//! what a function says it is.

use migration::devices::{PciFunctionState, PciState};

use crate::bus::BusDevice;

/// The first port of configuration mechanism #1.
pub const PCI_CONFIG_PORT: u64 = 0xcf8;
/// CONFIG_ADDRESS and CONFIG_DATA.
pub const PCI_CONFIG_PORTS: u64 = 8;
/// Bytes of a function's (conventional) configuration space.
pub const CONFIG_BYTES: usize = 256;

const ENABLE: u32 = 1 << 31;
/// Bits of CONFIG_ADDRESS that hold something: enable, bus, device,
/// function, register (bits 30:24 and 1:0 read as zero).
const ADDRESS_BITS: u32 = ENABLE | 0x00ff_fffc;
const SLOTS: usize = 32;

/// A saved bus state that is not one of this bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PciStateError {
    /// Other slots hold functions.
    #[error("PCI functions in slots {theirs:?}, this bus has {ours:?}")]
    Slots {
        /// The saved state's slots.
        theirs: Vec<u8>,
        /// This bus's.
        ours: Vec<u8>,
    },
    /// A configuration space of another size than 256 bytes.
    #[error("PCI slot {slot}: {len} bytes of configuration space, not {CONFIG_BYTES}")]
    ConfigSize {
        /// The function's slot.
        slot: u8,
        /// Its saved bytes.
        len: usize,
    },
}

/// A PCI function's configuration space: its bytes and which bits of each
/// the guest may write.
#[derive(Clone)]
pub struct ConfigSpace {
    bytes: [u8; CONFIG_BYTES],
    writable: [u8; CONFIG_BYTES],
}

impl ConfigSpace {
    /// A type-0 header with these IDs and class (class, subclass,
    /// programming interface), the command register writable.
    pub fn new(vendor: u16, device: u16, revision: u8, class: [u8; 3]) -> ConfigSpace {
        let mut c = ConfigSpace {
            bytes: [0; CONFIG_BYTES],
            writable: [0; CONFIG_BYTES],
        };
        c.bytes[0..2].copy_from_slice(&vendor.to_le_bytes());
        c.bytes[2..4].copy_from_slice(&device.to_le_bytes());
        c.bytes[0x08] = revision;
        c.bytes[0x09] = class[2];
        c.bytes[0x0a] = class[1];
        c.bytes[0x0b] = class[0];
        // Command: I/O, memory, bus master, parity, SERR, INTx disable.
        c.writable[0x04] = 0x47;
        c.writable[0x05] = 0x05;
        // Latency timer.
        c.writable[0x0d] = 0xff;
        c
    }

    fn read(&self, at: usize, data: &mut [u8]) {
        data.copy_from_slice(&self.bytes[at..at + data.len()]);
    }

    fn write(&mut self, at: usize, data: &[u8]) {
        for (i, &v) in data.iter().enumerate() {
            let m = self.writable[at + i];
            let b = &mut self.bytes[at + i];
            *b = (*b & !m) | (v & m);
        }
    }

    /// Takes the writable bits of `saved` (256 bytes), keeping the rest.
    fn restore(&mut self, saved: &[u8; CONFIG_BYTES]) {
        for (at, &v) in saved.iter().enumerate() {
            self.write(at, &[v]);
        }
    }
}

/// The i440FX host bridge's configuration space.
pub fn host_bridge() -> ConfigSpace {
    ConfigSpace::new(0x8086, 0x1237, 0x02, [0x06, 0x00, 0x00])
}

/// Bus 0 and the two ports that reach it.
pub struct PciBus {
    address: u32,
    slots: Vec<Option<ConfigSpace>>,
    bad_accesses: u64,
}

impl Default for PciBus {
    fn default() -> Self {
        Self::new()
    }
}

impl PciBus {
    /// Bus 0 with the host bridge at 00:00.0.
    pub fn new() -> PciBus {
        let mut slots = vec![None; SLOTS];
        slots[0] = Some(host_bridge());
        PciBus {
            address: 0,
            slots,
            bad_accesses: 0,
        }
    }

    /// Guest accesses that made no sense (answered with all ones, or
    /// dropped).
    pub fn bad_accesses(&self) -> u64 {
        self.bad_accesses
    }

    /// The bus's state, for a snapshot.
    pub fn state(&self) -> PciState {
        PciState {
            address: self.address,
            functions: self
                .slots
                .iter()
                .enumerate()
                .filter_map(|(slot, c)| {
                    c.as_ref().map(|c| PciFunctionState {
                        slot: slot as u8,
                        config: c.bytes.to_vec(),
                    })
                })
                .collect(),
        }
    }

    /// Checks that `s` is a state of this bus (the same functions, each
    /// with a whole configuration space) without changing anything.
    pub fn check_state(&self, s: &PciState) -> Result<(), PciStateError> {
        let ours: Vec<u8> = self.state().functions.iter().map(|f| f.slot).collect();
        let theirs: Vec<u8> = s.functions.iter().map(|f| f.slot).collect();
        if ours != theirs {
            return Err(PciStateError::Slots { theirs, ours });
        }
        match s.functions.iter().find(|f| f.config.len() != CONFIG_BYTES) {
            Some(f) => Err(PciStateError::ConfigSize {
                slot: f.slot,
                len: f.config.len(),
            }),
            None => Ok(()),
        }
    }

    /// Puts the bus in a saved state (see [`Self::check_state`]): the
    /// address latch, and each function's writable bits.
    pub fn restore(&mut self, s: &PciState) -> Result<(), PciStateError> {
        self.check_state(s)?;
        for f in &s.functions {
            let saved = <&[u8; CONFIG_BYTES]>::try_from(f.config.as_slice()).map_err(|_| {
                PciStateError::ConfigSize {
                    slot: f.slot,
                    len: f.config.len(),
                }
            })?;
            if let Some(Some(c)) = self.slots.get_mut(usize::from(f.slot)) {
                c.restore(saved);
            }
        }
        self.address = s.address & ADDRESS_BITS;
        Ok(())
    }

    /// The function CONFIG_ADDRESS names, and the register's offset.
    fn addressed(&mut self) -> Option<(&mut ConfigSpace, usize)> {
        let a = self.address;
        let (bus, slot, function) = ((a >> 16) & 0xff, (a >> 11) & 0x1f, (a >> 8) & 7);
        if a & ENABLE == 0 || bus != 0 || function != 0 {
            return None;
        }
        let c = self.slots.get_mut(slot as usize)?.as_mut()?;
        Some((c, (a & 0xfc) as usize))
    }

    /// The function and the byte of its configuration space that a
    /// data-port access of `len` bytes at port offset `offset` (4 to 7)
    /// reaches: `None` for an absent function, or for a senseless access
    /// (counted).
    fn data_target(&mut self, offset: u64, len: usize) -> Option<(&mut ConfigSpace, usize)> {
        let byte = usize::try_from(offset.checked_sub(4)?).ok()?;
        if !matches!(len, 1 | 2 | 4) || byte + len > 4 {
            self.bad_accesses += 1;
            return None;
        }
        let (c, reg) = self.addressed()?;
        Some((c, reg + byte))
    }
}

impl BusDevice for PciBus {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0xff);
        if offset == 0 && data.len() == 4 {
            data.copy_from_slice(&self.address.to_le_bytes());
            return;
        }
        if offset < 4 {
            // Byte and word reads of 0xCF8-0xCFB are other chipset
            // registers on real boards; none here.
            return;
        }
        if let Some((c, at)) = self.data_target(offset, data.len()) {
            c.read(at, data);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == 0 && data.len() == 4 {
            let mut v = [0u8; 4];
            v.copy_from_slice(data);
            self.address = u32::from_le_bytes(v) & ADDRESS_BITS;
            return;
        }
        if offset < 4 {
            // Linux's probe writes a byte to 0xCFB first: ignored.
            return;
        }
        if let Some((c, at)) = self.data_target(offset, data.len()) {
            c.write(at, data);
        }
    }
}

#[cfg(test)]
mod tests;

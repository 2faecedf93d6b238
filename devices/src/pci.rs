//! PCI bus 0 through configuration mechanism #1: port 0xCF8 latches
//! CONFIG_ADDRESS (enable bit 31, bus 23:16, device 15:11, function 10:8,
//! register 7:2), ports 0xCFC-0xCFF read and write the addressed dword's
//! bytes. On the bus sits a host bridge at 00:00.0 that says it is an
//! i440FX (8086:1237, class 06:00:00), the one firmware such as OVMF
//! looks for, and the virtio-pci functions ([`PciFunction`]). The memory
//! BARs of the functions are reached through [`PciWindow`], one MMIO range
//! on the VM's bus that decodes each access by where the BARs are now, so
//! a guest that sizes and moves a BAR needs no change of the bus. An ACPI
//! guest may reach the same configuration spaces through ECAM
//! ([`PciEcam`]).
//!
//! Driven by whichever vCPU thread exits on the ports or the window; never
//! blocks (the bus's lock, then a function's, for one access). A
//! guest access that makes no sense (a size other than 1, 2 or 4 bytes, a
//! data access that crosses its dword) reads all ones, writes nothing and
//! is counted; an absent function reads all ones, as on real hardware.
//! Only the bytes a function declares writable change; a saved state
//! restores those bytes and nothing else, so a snapshot file cannot change
//! what a function says it is.

use std::sync::{Arc, Mutex};

use migration::devices::{PciFunctionState, PciState};

use crate::bus::BusDevice;
use crate::sync::lock;

mod ecam;
pub use ecam::{PciEcam, ECAM_BUS_BYTES};

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
const FUNCTIONS: usize = 8;
/// Where the chipset's power-management function sits (PIIX4's 00:01.3):
/// a saved bus without it (from before it existed) still restores.
pub const PM_FUNCTION: (u8, u8) = (1, 3);

/// A saved bus state that is not one of this bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PciStateError {
    /// Other slots hold functions.
    #[error("PCI functions (slot, function) {theirs:?}, this bus has {ours:?}")]
    Slots {
        /// The saved state's functions.
        theirs: Vec<(u8, u8)>,
        /// This bus's.
        ours: Vec<(u8, u8)>,
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

    /// Its bytes as the guest reads them.
    pub fn bytes(&self) -> &[u8; CONFIG_BYTES] {
        &self.bytes
    }

    /// Reads `data.len()` bytes at `at` (the caller checks the range).
    pub fn read(&self, at: usize, data: &mut [u8]) {
        if let Some(src) = self.bytes.get(at..at + data.len()) {
            data.copy_from_slice(src);
        }
    }

    /// The dword at `at`.
    pub fn dword(&self, at: usize) -> u32 {
        let mut b = [0u8; 4];
        self.read(at, &mut b);
        u32::from_le_bytes(b)
    }

    /// Sets bytes at `at` as the device (not the guest) does.
    pub fn set(&mut self, at: usize, data: &[u8]) {
        if let Some(dst) = self.bytes.get_mut(at..at + data.len()) {
            dst.copy_from_slice(data);
        }
    }

    /// Lets the guest write the bits of `mask` from `at` on.
    pub fn set_writable(&mut self, at: usize, mask: &[u8]) {
        if let Some(dst) = self.writable.get_mut(at..at + mask.len()) {
            dst.copy_from_slice(mask);
        }
    }

    /// Sets subsystem vendor and subsystem IDs.
    pub fn set_subsystem(&mut self, vendor: u16, id: u16) {
        self.set(0x2c, &vendor.to_le_bytes());
        self.set(0x2e, &id.to_le_bytes());
    }

    /// Makes BAR `index` a 32-bit, non-prefetchable memory BAR of `size`
    /// bytes (a power of two of at least 16) at `base`: the guest sizes it
    /// by writing all ones and moves it by writing an address.
    pub fn set_memory_bar(&mut self, index: usize, base: u32, size: u32) {
        let at = 0x10 + 4 * index;
        let mask = !(size.max(16) - 1);
        self.set(at, &(base & mask).to_le_bytes());
        self.set_writable(at, &mask.to_le_bytes());
    }

    /// Where memory BAR `index` is now (its address bits).
    pub fn memory_bar(&self, index: usize) -> u32 {
        self.dword(0x10 + 4 * index) & !0xf
    }

    /// Whether the command register lets the function decode memory.
    pub fn memory_enabled(&self) -> bool {
        self.bytes[0x04] & 0x02 != 0
    }

    /// Appends a capability (`body`: its ID, a byte for the next pointer,
    /// then the rest) to the list, at `at` (dword-aligned, above the
    /// header); returns `at`.
    pub fn add_capability(&mut self, at: usize, body: &[u8]) -> usize {
        // Find the end of the list.
        let mut link = 0x34;
        let mut guard = 0;
        while self.bytes[link] != 0 && guard < 48 {
            link = usize::from(self.bytes[link]) + 1;
            guard += 1;
        }
        self.set(at, body);
        self.bytes[at + 1] = 0;
        self.bytes[link] = at as u8;
        // Status: capabilities list.
        self.bytes[0x06] |= 0x10;
        at
    }

    /// A guest write of `data` at `at`: only the writable bits change.
    pub fn write(&mut self, at: usize, data: &[u8]) {
        for (i, &v) in data.iter().enumerate() {
            let (Some(&m), Some(b)) = (self.writable.get(at + i), self.bytes.get_mut(at + i))
            else {
                return;
            };
            *b = (*b & !m) | (v & m);
        }
    }

    /// Takes the writable bits of `saved` (256 bytes), keeping the rest.
    pub fn restore(&mut self, saved: &[u8; CONFIG_BYTES]) {
        for (at, &v) in saved.iter().enumerate() {
            self.write(at, &[v]);
        }
    }
}

/// A function on bus 0, as the bus reaches it. Accesses come from the
/// guest: a function takes any offset and size the bus passes (config
/// accesses are inside its 256 bytes and dword; BAR accesses inside the
/// BAR) and never panics.
pub trait PciFunction: Send {
    /// Its configuration space.
    fn config(&self) -> &ConfigSpace;
    /// A guest read of its configuration space: most functions just give
    /// their bytes; one may act on the read (virtio's PCI configuration
    /// access capability reads its BAR).
    fn read_config(&mut self, at: usize, data: &mut [u8]) {
        self.config().read(at, data);
    }
    /// A guest write to its configuration space.
    fn write_config(&mut self, at: usize, data: &[u8]);
    /// Puts back the writable bits of a saved configuration space.
    fn restore_config(&mut self, saved: &[u8; CONFIG_BYTES]);
    /// The memory range it decodes now (base, length): its BAR, while
    /// memory decoding is on.
    fn decoded_bar(&self) -> Option<(u64, u64)> {
        None
    }
    /// A guest read at `offset` in its BAR.
    fn read_bar(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }
    /// A guest write at `offset` in its BAR.
    fn write_bar(&mut self, _offset: u64, _data: &[u8]) {}
}

/// A function on the bus, shared with whoever else holds it (the VMM
/// keeps the virtio ones for their state).
pub type SharedFunction = Arc<Mutex<dyn PciFunction>>;

/// The i440FX host bridge.
pub struct HostBridge(ConfigSpace);

impl PciFunction for HostBridge {
    fn config(&self) -> &ConfigSpace {
        &self.0
    }
    fn write_config(&mut self, at: usize, data: &[u8]) {
        self.0.write(at, data);
    }
    fn restore_config(&mut self, saved: &[u8; CONFIG_BYTES]) {
        self.0.restore(saved);
    }
}

/// The i440FX host bridge's configuration space.
pub fn host_bridge() -> ConfigSpace {
    ConfigSpace::new(0x8086, 0x1237, 0x02, [0x06, 0x00, 0x00])
}

/// A bus error of the VMM's making (not the guest's).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PciBusError {
    /// The slot is taken or out of range.
    #[error("PCI slot {0} is taken or does not exist")]
    SlotTaken(u8),
}

/// Bus 0 and the two ports that reach it.
pub struct PciBus {
    address: u32,
    /// By device and function number (`slot * 8 + function`).
    functions: Vec<Option<SharedFunction>>,
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
        let mut functions: Vec<Option<SharedFunction>> = vec![None; SLOTS * FUNCTIONS];
        functions[0] = Some(Arc::new(Mutex::new(HostBridge(host_bridge()))));
        PciBus {
            address: 0,
            functions,
            bad_accesses: 0,
        }
    }

    /// Puts `function` in `slot` (1 to 31; 0 is the host bridge's) as its
    /// function 0.
    pub fn add(&mut self, slot: u8, function: SharedFunction) -> Result<(), PciBusError> {
        self.add_function(slot, 0, function)
    }

    /// Puts `f` at `slot`.`function`. A function other than 0 in a slot
    /// whose function 0 is absent is reached by its address only: bus
    /// scans (firmware's, Linux's) skip the slot, as on a real board.
    pub fn add_function(
        &mut self,
        slot: u8,
        function: u8,
        f: SharedFunction,
    ) -> Result<(), PciBusError> {
        let at = usize::from(slot) * FUNCTIONS + usize::from(function);
        match self.functions.get_mut(at) {
            Some(s @ None) if usize::from(function) < FUNCTIONS => {
                *s = Some(f);
                Ok(())
            }
            _ => Err(PciBusError::SlotTaken(slot)),
        }
    }

    /// The first slot with no function in it.
    pub fn free_slot(&self) -> Option<u8> {
        self.functions
            .chunks(FUNCTIONS)
            .position(|s| s.iter().all(Option::is_none))
            .map(|s| s as u8)
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
                .functions
                .iter()
                .enumerate()
                .filter_map(|(at, f)| {
                    f.as_ref().map(|f| PciFunctionState {
                        slot: (at / FUNCTIONS) as u8,
                        function: (at % FUNCTIONS) as u8,
                        config: lock(f).config().bytes().to_vec(),
                    })
                })
                .collect(),
            // The PM block is not on the bus: its owner fills it in.
            pm1_enable: 0,
        }
    }

    /// Checks that `s` is a state of this bus (the same functions, each
    /// with a whole configuration space) without changing anything.
    pub fn check_state(&self, s: &PciState) -> Result<(), PciStateError> {
        let ours: Vec<(u8, u8)> = self
            .state()
            .functions
            .iter()
            .map(|f| (f.slot, f.function))
            .collect();
        Self::check_shape(s, &ours)
    }

    /// Checks that `s` holds the functions `ours` (slot, function; in
    /// order), each with a whole configuration space: a bus's shape,
    /// without the bus. A state without [`PM_FUNCTION`] is one of a bus
    /// from before it, and fits.
    pub fn check_shape(s: &PciState, ours: &[(u8, u8)]) -> Result<(), PciStateError> {
        let ours = ours.to_vec();
        let theirs: Vec<(u8, u8)> = s.functions.iter().map(|f| (f.slot, f.function)).collect();
        let ours_before_pm: Vec<(u8, u8)> =
            ours.iter().copied().filter(|&f| f != PM_FUNCTION).collect();
        if ours != theirs && ours_before_pm != theirs {
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
            let at = usize::from(f.slot) * FUNCTIONS + usize::from(f.function);
            if let Some(Some(function)) = self.functions.get(at) {
                lock(function).restore_config(saved);
            }
        }
        self.address = s.address & ADDRESS_BITS;
        Ok(())
    }

    /// The function CONFIG_ADDRESS names, and the register's offset.
    fn addressed(&self) -> Option<(SharedFunction, usize)> {
        let a = self.address;
        let (bus, slot, function) = ((a >> 16) & 0xff, (a >> 11) & 0x1f, (a >> 8) & 7);
        if a & ENABLE == 0 || bus != 0 {
            return None;
        }
        let at = (slot * FUNCTIONS as u32 + function) as usize;
        let f = self.functions.get(at)?.as_ref()?.clone();
        Some((f, (a & 0xfc) as usize))
    }

    /// The function and the byte of its configuration space that a
    /// data-port access of `len` bytes at port offset `offset` (4 to 7)
    /// reaches: `None` for an absent function, or for a senseless access
    /// (counted).
    fn data_target(&mut self, offset: u64, len: usize) -> Option<(SharedFunction, usize)> {
        let byte = usize::try_from(offset.checked_sub(4)?).ok()?;
        if !matches!(len, 1 | 2 | 4) || byte + len > 4 {
            self.bad_accesses += 1;
            return None;
        }
        let (f, reg) = self.addressed()?;
        Some((f, reg + byte))
    }

    /// The function whose BAR holds guest-physical `addr`, and the offset
    /// in the BAR.
    fn bar_target(&self, addr: u64, len: usize) -> Option<(SharedFunction, u64)> {
        self.functions.iter().flatten().find_map(|f| {
            let (base, size) = lock(f).decoded_bar()?;
            let off = addr.checked_sub(base)?;
            (off.checked_add(len as u64)? <= size).then(|| (f.clone(), off))
        })
    }
}

/// The MMIO range where the functions' BARs live (they may move inside
/// it): every access is decoded by where the BARs are at that moment; one
/// that hits no BAR reads all ones and is counted.
pub struct PciWindow {
    bus: Arc<Mutex<PciBus>>,
    base: u64,
}

impl PciWindow {
    /// The window of `bus` starting at guest-physical `base`.
    pub fn new(bus: Arc<Mutex<PciBus>>, base: u64) -> PciWindow {
        PciWindow { bus, base }
    }

    fn target(&self, offset: u64, len: usize) -> Option<(SharedFunction, u64)> {
        let mut bus = lock(&self.bus);
        let t = bus.bar_target(self.base.checked_add(offset)?, len);
        if t.is_none() {
            bus.bad_accesses += 1;
        }
        t
    }
}

impl BusDevice for PciWindow {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match self.target(offset, data.len()) {
            Some((f, at)) => lock(&f).read_bar(at, data),
            None => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Some((f, at)) = self.target(offset, data.len()) {
            lock(&f).write_bar(at, data);
        }
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
        if let Some((f, at)) = self.data_target(offset, data.len()) {
            lock(&f).read_config(at, data);
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
        if let Some((f, at)) = self.data_target(offset, data.len()) {
            lock(&f).write_config(at, data);
        }
    }
}

#[cfg(test)]
mod tests;

//! QEMU's firmware configuration interface (fw_cfg) in its traditional
//! I/O-port form, the one UEFI firmware (OVMF) and Linux's `qemu_fw_cfg`
//! driver read: a 16-bit write to port 0x510 selects an item, reads of
//! port 0x511 return its bytes one after another (a string read, `rep
//! insb`, returns as many), and zeros past its end.
//!
//! Items: the signature `QEMU`, the interface ID (1: no DMA), RAM size,
//! CPU count, and the file directory with `etc/e820` (the memory map) and
//! `bootorder` (empty: the firmware's default order); with a kernel for
//! the firmware to boot ([`KernelBlobs`]), QEMU's kernel, setup, initrd
//! and command-line items, which OVMF's kernel loader reads. Everything is
//! read-only and fixed when the VM is built; the guest's place in a read
//! (item and offset) is state, saved in snapshots.
//!
//! Driven by whichever vCPU thread exits on the ports; never blocks and
//! never panics. A write of another size than 16 bits to the selector, a
//! write to the data port (the legacy write path QEMU dropped) and a read
//! of the selector are ignored (reads give all ones) and counted.

use std::collections::BTreeMap;

use migration::devices::FwCfgState;

use crate::bus::BusDevice;

/// The selector port; the data port follows it.
pub const FW_CFG_PORT: u64 = 0x510;
/// Selector and data.
pub const FW_CFG_PORTS: u64 = 2;

const SIGNATURE: u16 = 0x0000;
const ID: u16 = 0x0001;
const RAM_SIZE: u16 = 0x0003;
const NB_CPUS: u16 = 0x0005;
const MAX_CPUS: u16 = 0x000f;
const KERNEL_SIZE: u16 = 0x0008;
const INITRD_SIZE: u16 = 0x000b;
const KERNEL_DATA: u16 = 0x0011;
const INITRD_DATA: u16 = 0x0012;
const CMDLINE_SIZE: u16 = 0x0014;
const CMDLINE_DATA: u16 = 0x0015;
const SETUP_SIZE: u16 = 0x0017;
const SETUP_DATA: u16 = 0x0018;
const FILE_DIR: u16 = 0x0019;
const FILE_FIRST: u16 = 0x0020;
/// A file name's room in a directory entry, its NUL included.
const FILE_NAME: usize = 56;
/// `etc/e820`'s entry type for RAM.
pub const E820_RAM: u32 = 1;

/// A kernel for the firmware to load, split as QEMU splits a bzImage:
/// its real-mode setup and the rest.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KernelBlobs {
    pub setup: Vec<u8>,
    pub kernel: Vec<u8>,
    pub initrd: Vec<u8>,
    /// Without its NUL (added here).
    pub cmdline: Vec<u8>,
}

/// The fw_cfg device and its items.
pub struct FwCfg {
    items: BTreeMap<u16, Vec<u8>>,
    selected: u16,
    offset: usize,
    bad_accesses: u64,
}

impl FwCfg {
    /// The items of a VM with `cpus` vCPUs whose RAM lies at `ram` (guest
    /// address and length of each range).
    pub fn new(ram: &[(u64, u64)], cpus: u16) -> FwCfg {
        let mut items = BTreeMap::new();
        items.insert(SIGNATURE, b"QEMU".to_vec());
        items.insert(ID, 1u32.to_le_bytes().to_vec());
        let total: u64 = ram.iter().map(|r| r.1).sum();
        items.insert(RAM_SIZE, total.to_le_bytes().to_vec());
        items.insert(NB_CPUS, cpus.to_le_bytes().to_vec());
        items.insert(MAX_CPUS, cpus.to_le_bytes().to_vec());
        let mut e820 = Vec::with_capacity(ram.len() * 20);
        for &(base, len) in ram {
            e820.extend_from_slice(&base.to_le_bytes());
            e820.extend_from_slice(&len.to_le_bytes());
            e820.extend_from_slice(&E820_RAM.to_le_bytes());
        }
        let files: [(&str, Vec<u8>); 2] = [("bootorder", Vec::new()), ("etc/e820", e820)];
        let mut dir = (files.len() as u32).to_be_bytes().to_vec();
        for (i, (name, data)) in files.into_iter().enumerate() {
            let select = FILE_FIRST + i as u16;
            dir.extend_from_slice(&(data.len() as u32).to_be_bytes());
            dir.extend_from_slice(&select.to_be_bytes());
            dir.extend_from_slice(&[0, 0]);
            let mut n = [0u8; FILE_NAME];
            n[..name.len()].copy_from_slice(name.as_bytes());
            dir.extend_from_slice(&n);
            items.insert(select, data);
        }
        items.insert(FILE_DIR, dir);
        FwCfg {
            items,
            selected: SIGNATURE,
            offset: 0,
            bad_accesses: 0,
        }
    }

    /// Offers `k` to the firmware: each part as a size item (32-bit) and a
    /// data item. Parts larger than 4 GiB cannot be described and are not
    /// offered.
    pub fn set_kernel(&mut self, k: KernelBlobs) {
        let mut cmdline = k.cmdline;
        cmdline.push(0);
        for (size, data, bytes) in [
            (SETUP_SIZE, SETUP_DATA, k.setup),
            (KERNEL_SIZE, KERNEL_DATA, k.kernel),
            (INITRD_SIZE, INITRD_DATA, k.initrd),
            (CMDLINE_SIZE, CMDLINE_DATA, cmdline),
        ] {
            let Ok(len) = u32::try_from(bytes.len()) else {
                continue;
            };
            self.items.insert(size, len.to_le_bytes().to_vec());
            self.items.insert(data, bytes);
        }
    }

    /// Guest accesses that made no sense (ignored).
    pub fn bad_accesses(&self) -> u64 {
        self.bad_accesses
    }

    /// Where the guest is in its read, for a snapshot.
    pub fn state(&self) -> FwCfgState {
        FwCfgState {
            selected: self.selected,
            offset: self.offset as u64,
        }
    }

    /// Puts the guest back where it was in its read (an offset past the
    /// item's end reads zeros, as it would have).
    pub fn restore(&mut self, s: &FwCfgState) {
        self.selected = s.selected;
        self.offset = usize::try_from(s.offset).unwrap_or(usize::MAX);
    }
}

impl BusDevice for FwCfg {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset != 1 {
            data.fill(0xff);
            self.bad_accesses += 1;
            return;
        }
        let item = self
            .items
            .get(&self.selected)
            .map_or(&[][..], Vec::as_slice);
        for b in data.iter_mut() {
            *b = item.get(self.offset).copied().unwrap_or(0);
            self.offset = self.offset.saturating_add(1);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match (offset, data) {
            (0, &[lo, hi]) => {
                self.selected = u16::from_le_bytes([lo, hi]);
                self.offset = 0;
            }
            _ => self.bad_accesses += 1,
        }
    }
}

#[cfg(test)]
mod tests;

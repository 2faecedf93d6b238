//! Guest-physical memory layout for an x86_64 Linux boot.
//!
//! ```text
//! 0x0000_0500  GDT               0x0000_0520  IDT (empty)
//! 0x0000_6000  setup_data (RNG seed)
//! 0x0000_7000  boot_params       0x0000_8ff0  boot stack (top)
//! 0x0000_9000  PML4, PDPT, PD    0x0002_0000  kernel command line
//! 0x0009_fc00  MP table (EBDA)   0x000e_0000  ACPI tables (a PCI machine's)
//! 0x0010_0000  kernel (high memory)
//! 0xd000_0000  MMIO gap: devices, up to 4 GiB; RAM beyond continues at 4 GiB
//! 0xe000_0000  PCI BARs (256 MiB, a PCI machine's)
//! 0xf000_0000  ECAM of PCI bus 0 (1 MiB, a PCI machine's)
//! 0xfec0_0000  IOAPIC            0xfee0_0000  local APIC
//! 0xfeff_d000  KVM's TSS         0xff00_0000  firmware, up to 4 GiB (--firmware)
//! ```

pub const GDT_START: u64 = 0x500;
pub const IDT_START: u64 = 0x520;
/// The boot protocol's `setup_data` list (one entry: the RNG seed).
pub const SETUP_DATA_START: u64 = 0x6000;
pub const ZERO_PAGE_START: u64 = 0x7000;
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
pub const PML4_START: u64 = 0x9000;
pub const PDPTE_START: u64 = 0xa000;
pub const PDE_START: u64 = 0xb000;
pub const CMDLINE_START: u64 = 0x2_0000;
/// x86 Linux's COMMAND_LINE_SIZE, including the terminating NUL.
pub const CMDLINE_MAX_SIZE: usize = 2048;
pub const MPTABLE_START: u64 = 0x9_fc00;
/// End of the low RAM range (start of the EBDA).
pub const EBDA_START: u64 = 0x9_fc00;
/// Where a PCI machine's ACPI tables go: the RSDP first (a guest scans
/// 0xE0000-0xFFFFF for it), then the others, all below 1 MiB.
pub const ACPI_START: u64 = 0xe_0000;
pub const ACPI_END: u64 = 0x10_0000;
pub const HIMEM_START: u64 = 0x10_0000;
pub const MMIO_GAP_START: u64 = 0xd000_0000;
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// Where the BARs of PCI functions live (a PCI machine's): inside the gap,
/// above the virtio-mmio windows, below the IOAPIC.
pub const PCI_MMIO_START: u64 = 0xe000_0000;
pub const PCI_MMIO_SIZE: u64 = 0x1000_0000;
/// Where else a guest may move them: UEFI firmware for an i440FX board
/// (OVMF) puts its PCI aperture at 2 GiB (3 GiB with more RAM) up to the
/// gap; what of it is not RAM decodes BARs too (RAM always wins there).
pub const PCI_LOW_MMIO_START: u64 = 0x8000_0000;
pub const PCI_LOW_MMIO_SIZE: u64 = MMIO_GAP_START - PCI_LOW_MMIO_START;
/// ECAM (memory-mapped configuration space) of a PCI machine's bus 0.
pub const PCI_ECAM_START: u64 = 0xf000_0000;
/// Where the in-kernel IOAPIC and local APICs live.
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
pub const APIC_ADDR: u32 = 0xfee0_0000;
/// KVM's TSS (three pages, used only to emulate real mode on hosts without
/// unrestricted guests): QEMU's place, just below the 16 MiB a firmware
/// image may take under 4 GiB (`boot::firmware`).
pub const KVM_TSS_ADDRESS: usize = 0xfeff_d000;

/// The guest RAM ranges for `mem_size` bytes: below the MMIO gap, then above 4 GiB.
pub fn ram_ranges(mem_size: u64) -> Vec<(u64, u64)> {
    if mem_size <= MMIO_GAP_START {
        vec![(0, mem_size)]
    } else {
        vec![
            (0, MMIO_GAP_START),
            (MMIO_GAP_END, mem_size - MMIO_GAP_START),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_skip_the_mmio_gap() {
        assert_eq!(ram_ranges(128 << 20), vec![(0, 128 << 20)]);
        assert_eq!(ram_ranges(MMIO_GAP_START), vec![(0, MMIO_GAP_START)]);
        assert_eq!(
            ram_ranges(4 << 30),
            vec![
                (0, MMIO_GAP_START),
                (MMIO_GAP_END, (4 << 30) - MMIO_GAP_START)
            ]
        );
    }
}

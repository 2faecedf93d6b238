//! The ACPI tables of a PCI machine, written once into guest memory before
//! any vCPU runs (rust-vmm's `acpi_tables` crate builds them):
//!
//! - RSDP at 0xE0000 (where a guest scans for it; boot_params names it
//!   too), pointing at the XSDT;
//! - FACS: the global lock's home (a full FADT needs one);
//! - FADT: a PC's ACPI (not hardware-reduced: the 8259s, the ISA
//!   interrupts and the timers stay as the MP table has them), with the
//!   PM1a event and control blocks at ports 0x600-0x605 (tandem's
//!   [`devices::acpi_pm`]), the SCI on IRQ 9 (never raised), no SMI
//!   command port (always in ACPI mode), no PM timer and no GPE blocks,
//!   no fixed buttons, the reset register at the i8042's command port
//!   (0xFE, the reset tandem already handles), the RTC's century register;
//! - MADT: one local APIC per vCPU and the IOAPIC (the same IDs as the MP
//!   table, which stays for guests booted with `acpi=off`), PC/AT 8259s;
//! - DSDT: the PCI root bridge (PNP0A08, bus 0, its configuration ports,
//!   all port space for I/O and tandem's BAR window for memory), the
//!   motherboard resource that reserves ECAM, the CMOS RTC (PNP0B00),
//!   fw_cfg (QEMU0002), and `\_S5_`;
//! - MCFG: ECAM for bus 0.
//!
//! ISA interrupts (COM1 on 4, virtio-mmio devices from 5) keep the default
//! identity mapping to IOAPIC pins, edge-triggered, active high, as under
//! the MP table; the PCI functions use MSI-X, so no `_PRT` is needed.

use acpi_tables::{aml, facs, fadt, gas, madt, mcfg::MCFG, rsdp::Rsdp, sdt::Sdt, xsdt::XSDT, Aml};
use devices::acpi_pm::{ACPI_PM_PORT, PM1_CNT_LEN, PM1_EVT_LEN, S5_SLEEP_TYPE};
use devices::fw_cfg::{FW_CFG_PORT, FW_CFG_PORTS};
use devices::pci::{ECAM_BUS_BYTES, PCI_CONFIG_PORT, PCI_CONFIG_PORTS};
use devices::rtc::{RTC_PORT, RTC_PORTS};
use devices::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

use super::layout::{
    ACPI_END, ACPI_START, APIC_ADDR, IOAPIC_ADDR, PCI_ECAM_START, PCI_MMIO_SIZE, PCI_MMIO_START,
};

const OEM_ID: [u8; 6] = *b"TANDEM";
const OEM_REVISION: u32 = 1;
/// The i8042's command port and its pulse-reset command.
const RESET_PORT: u64 = 0x64;
const RESET_VALUE: u8 = 0xfe;
/// The SCI's interrupt (ISA IRQ 9, as on PCs); nothing raises it: no
/// fixed or general-purpose event ever happens.
pub const SCI_IRQ: u16 = 9;
/// The CMOS RTC's century register.
const RTC_CENTURY: u8 = 0x32;
/// IA-PC boot architecture flags: no VGA.
const IAPC_VGA_NOT_PRESENT: u16 = 1 << 2;
/// The FACS (the global lock, the waking vector) is 64-byte aligned.
const FACS_ALIGN: u64 = 64;
/// Where a table's checksum is, and the MADT's flags.
const CHECKSUM: usize = 9;
const MADT_FLAGS: usize = 40;
const MADT_PCAT_COMPAT: u32 = 1;

/// Errors from writing the tables.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    #[error("the ACPI tables ({0} bytes) do not fit below 1 MiB")]
    TooBig(u64),
    #[error("cannot write the ACPI tables to guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
}

/// Writes the tables for `num_cpus` vCPUs; returns the RSDP's address.
pub fn write(mem: &GuestMemoryMmap, num_cpus: u8) -> Result<u64, AcpiError> {
    let mut w = Writer {
        mem,
        next: ACPI_START + Rsdp::len() as u64,
    };
    let facs = w.put_aligned(&bytes(&facs::FACS::new()), FACS_ALIGN)?;
    let dsdt = w.put(&dsdt())?;
    let fadt = w.put(&fadt(dsdt, facs))?;
    let madt = w.put_bytes(&madt_bytes(num_cpus))?;
    let mcfg = w.put(&mcfg())?;
    let mut xsdt = XSDT::new(OEM_ID, *b"TANDXSDT", OEM_REVISION);
    for table in [fadt, madt, mcfg] {
        xsdt.add_entry(table);
    }
    let xsdt = w.put(&xsdt)?;
    mem.write_slice(&bytes(&Rsdp::new(OEM_ID, xsdt)), GuestAddress(ACPI_START))?;
    Ok(ACPI_START)
}

/// Places tables one after another, 8-byte aligned, below [`ACPI_END`].
struct Writer<'a> {
    mem: &'a GuestMemoryMmap,
    next: u64,
}

impl Writer<'_> {
    fn put(&mut self, table: &dyn Aml) -> Result<u64, AcpiError> {
        self.put_bytes(&bytes(table))
    }

    fn put_bytes(&mut self, b: &[u8]) -> Result<u64, AcpiError> {
        self.put_aligned(b, 8)
    }

    fn put_aligned(&mut self, b: &[u8], align: u64) -> Result<u64, AcpiError> {
        let at = self.next.next_multiple_of(align);
        let end = at + b.len() as u64;
        if end > ACPI_END {
            return Err(AcpiError::TooBig(end - ACPI_START));
        }
        self.mem.write_slice(b, GuestAddress(at))?;
        self.next = end;
        Ok(at)
    }
}

fn bytes(table: &dyn Aml) -> Vec<u8> {
    let mut b = Vec::new();
    table.to_aml_bytes(&mut b);
    b
}

fn fadt(dsdt: u64, facs: u64) -> fadt::FADT {
    let port = |addr: u64, bytes: u8| {
        let size = match bytes {
            1 => gas::AccessSize::ByteAccess,
            2 => gas::AccessSize::WordAccess,
            _ => gas::AccessSize::DwordAccess,
        };
        gas::GAS::new(gas::AddressSpace::SystemIo, bytes * 8, 0, size, addr)
    };
    let cnt = ACPI_PM_PORT + u64::from(PM1_EVT_LEN);
    let mut f = fadt::FADTBuilder::new(OEM_ID, *b"TANDFACP", OEM_REVISION)
        .dsdt_64(dsdt)
        .firmware_ctrl_64(facs)
        .flag(fadt::Flags::ResetRegSup)
        .flag(fadt::Flags::PwrButton)
        .flag(fadt::Flags::SlpButton);
    f.sci_int = SCI_IRQ.into();
    f.pm1a_evt_blk = (ACPI_PM_PORT as u32).into();
    f.pm1_evt_len = PM1_EVT_LEN;
    f.x_pm1a_evt_blk = port(ACPI_PM_PORT, PM1_EVT_LEN);
    f.pm1a_cnt_blk = (cnt as u32).into();
    f.pm1_cnt_len = PM1_CNT_LEN;
    f.x_pm1a_cnt_blk = port(cnt, PM1_CNT_LEN);
    f.reset_reg = port(RESET_PORT, 1);
    f.reset_value = RESET_VALUE;
    f.century = RTC_CENTURY;
    f.iapc_boot_arch = IAPC_VGA_NOT_PRESENT.into();
    f.finalize()
}

fn madt(num_cpus: u8) -> madt::MADT {
    let mut m = madt::MADT::new(
        OEM_ID,
        *b"TANDAPIC",
        OEM_REVISION,
        madt::LocalInterruptController::Address(APIC_ADDR),
    );
    for cpu in 0..num_cpus {
        m.add_structure(madt::ProcessorLocalApic::new(
            cpu,
            cpu,
            madt::EnabledStatus::Enabled,
        ));
    }
    // The MP table's IOAPIC ID, so both descriptions agree.
    m.add_structure(madt::IoApic::new(num_cpus + 1, IOAPIC_ADDR, 0));
    m
}

/// The MADT's bytes with PCAT_COMPAT set: the machine has the two 8259s
/// (KVM's), which the crate's builder does not say.
fn madt_bytes(num_cpus: u8) -> Vec<u8> {
    let mut b = bytes(&madt(num_cpus));
    b[MADT_FLAGS..MADT_FLAGS + 4].copy_from_slice(&MADT_PCAT_COMPAT.to_le_bytes());
    b[CHECKSUM] = 0;
    b[CHECKSUM] = 0u8.wrapping_sub(b.iter().fold(0u8, |a, x| a.wrapping_add(*x)));
    b
}

fn mcfg() -> MCFG {
    let mut m = MCFG::new(OEM_ID, *b"TANDMCFG", OEM_REVISION);
    m.add_ecam(PCI_ECAM_START, 0, 0, 0);
    m
}

/// The PCI host bridge (bus 0, the configuration ports, the MMIO
/// aperture), into `sdt`.
fn add_pci_host_bridge(sdt: &mut Sdt) {
    let mmio_end = (PCI_MMIO_START + PCI_MMIO_SIZE - 1) as u32;
    let (cf8, ports) = (PCI_CONFIG_PORT as u16, PCI_CONFIG_PORTS as u16);
    aml::Device::new(
        "_SB_.PCI0".into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0A08")),
            &aml::Name::new("_CID".into(), &aml::EISAName::new("PNP0A03")),
            &aml::Name::new("_ADR".into(), &aml::ZERO),
            &aml::Name::new("_SEG".into(), &aml::ZERO),
            &aml::Name::new("_UID".into(), &aml::ZERO),
            &aml::Name::new("_BBN".into(), &aml::ZERO),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![
                    &aml::AddressSpace::new_bus_number(0u16, 0u16),
                    &aml::IO::new(cf8, cf8, 1, ports as u8),
                    &aml::AddressSpace::new_io(0u16, cf8 - 1, None),
                    &aml::AddressSpace::new_io(cf8 + ports, 0xffff, None),
                    &aml::AddressSpace::new_memory(
                        aml::AddressSpaceCacheable::NotCacheable,
                        true,
                        PCI_MMIO_START as u32,
                        mmio_end,
                        None,
                    ),
                ]),
            ),
        ],
    )
    .to_aml_bytes(sdt);
}

fn dsdt() -> Sdt {
    let mut sdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, *b"TANDDSDT", OEM_REVISION);
    // Each part is built and emitted in one statement: the builders borrow
    // their children.
    add_pci_host_bridge(&mut sdt);
    // ECAM, reserved as a motherboard resource.
    aml::Device::new(
        "_SB_.MBRD".into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0C02")),
            &aml::Name::new("_UID".into(), &aml::ZERO),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![&aml::Memory32Fixed::new(
                    false,
                    PCI_ECAM_START as u32,
                    ECAM_BUS_BYTES as u32,
                )]),
            ),
        ],
    )
    .to_aml_bytes(&mut sdt);
    // The CMOS RTC (Windows looks for it here; its interrupt is not
    // emulated, so none is named).
    let rtc = RTC_PORT as u16;
    aml::Device::new(
        "_SB_.RTC_".into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0B00")),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![&aml::IO::new(rtc, rtc, 1, RTC_PORTS as u8)]),
            ),
        ],
    )
    .to_aml_bytes(&mut sdt);
    // QEMU's fw_cfg (ports 0x510/0x511, no DMA), where Linux's and
    // firmware's drivers look for it.
    let fw_cfg = FW_CFG_PORT as u16;
    aml::Device::new(
        "_SB_.FWCF".into(),
        vec![
            &aml::Name::new("_HID".into(), &"QEMU0002"),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![&aml::IO::new(
                    fw_cfg,
                    fw_cfg,
                    1,
                    FW_CFG_PORTS as u8,
                )]),
            ),
        ],
    )
    .to_aml_bytes(&mut sdt);
    aml::Name::new("_S5_".into(), &aml::Package::new(vec![&S5_SLEEP_TYPE])).to_aml_bytes(&mut sdt);
    sdt
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestAddress;

    fn checksum_ok(b: &[u8]) -> bool {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x)) == 0
    }

    fn table(mem: &GuestMemoryMmap, at: u64) -> Vec<u8> {
        let mut head = [0u8; 8];
        mem.read_slice(&mut head, GuestAddress(at)).unwrap();
        let len = u32::from_le_bytes(head[4..8].try_into().unwrap()) as usize;
        let mut b = vec![0u8; len];
        mem.read_slice(&mut b, GuestAddress(at)).unwrap();
        b
    }

    #[test]
    fn tables_are_linked_and_checksummed() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
        let rsdp = write(&mem, 2).unwrap();
        let mut r = [0u8; 36];
        mem.read_slice(&mut r, GuestAddress(rsdp)).unwrap();
        assert_eq!(&r[..8], b"RSD PTR ");
        assert!(checksum_ok(&r[..20]) && checksum_ok(&r));
        let xsdt = table(&mem, u64::from_le_bytes(r[24..32].try_into().unwrap()));
        assert_eq!(&xsdt[..4], b"XSDT");
        assert!(checksum_ok(&xsdt));
        let mut seen = Vec::new();
        for e in xsdt[36..].chunks(8) {
            let t = table(&mem, u64::from_le_bytes(e.try_into().unwrap()));
            assert!(checksum_ok(&t), "{:?}", &t[..4]);
            assert!(t.len() as u64 + rsdp < ACPI_END);
            seen.push(String::from_utf8_lossy(&t[..4]).to_string());
            if &t[..4] == b"FACP" {
                let dsdt = table(&mem, u64::from_le_bytes(t[140..148].try_into().unwrap()));
                assert_eq!(&dsdt[..4], b"DSDT");
                assert!(checksum_ok(&dsdt));
                // Flags: not hardware-reduced, reset register; the SCI
                // and the PM1a blocks.
                let flags = u32::from_le_bytes(t[112..116].try_into().unwrap());
                assert_eq!(flags & (1 << 20), 0);
                assert_ne!(flags & (1 << 10), 0);
                assert_eq!(u16::from_le_bytes([t[46], t[47]]), SCI_IRQ);
                let dword = |at: usize| u32::from_le_bytes(t[at..at + 4].try_into().unwrap());
                assert_eq!((dword(56), dword(64)), (0x600, 0x604));
            }
            if &t[..4] == b"APIC" {
                // Header (44) + 2 local APICs (8 each) + IOAPIC (12).
                assert_eq!(t.len(), 44 + 16 + 12);
                assert_eq!(t[40], 1, "PCAT_COMPAT");
            }
        }
        assert_eq!(seen, ["FACP", "APIC", "MCFG"]);
    }

    #[test]
    fn many_cpus_still_fit() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
        assert!(write(&mem, super::super::mptable::MAX_CPUS).is_ok());
    }
}

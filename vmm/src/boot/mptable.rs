//! The Intel MultiProcessor Specification 1.4 table: how a guest without ACPI
//! learns its CPUs, its IOAPIC and how ISA interrupts are wired. Written once
//! at boot at the start of the EBDA, where Linux scans for it.

use devices::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

use super::layout::{APIC_ADDR, IOAPIC_ADDR, MPTABLE_START};

/// IOAPIC pins described to the guest (one per ISA/legacy line).
pub const IOAPIC_PINS: u8 = 24;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const EBDA_END: u64 = 0xa_0000;

/// The most vCPUs whose entries fit in the EBDA next to the rest of the table.
pub const MAX_CPUS: u8 = 32;

/// Errors from writing the table.
#[derive(Debug, thiserror::Error)]
pub enum MptableError {
    #[error("{0} vCPUs do not fit in the MP table (at most {MAX_CPUS})")]
    TooManyCpus(u8),
    #[error("cannot write the MP table to guest memory: {0}")]
    Write(#[from] vm_memory::GuestMemoryError),
}

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// Builds the table (floating pointer, then configuration table) as bytes.
pub fn build(num_cpus: u8) -> Result<Vec<u8>, MptableError> {
    if num_cpus == 0 || num_cpus > MAX_CPUS {
        return Err(MptableError::TooManyCpus(num_cpus));
    }
    let ioapic_id = num_cpus + 1;
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for cpu in 0..num_cpus {
        // Processor: type 0, APIC id, version, flags (enabled, BSP), signature, features.
        let flags = 1 | if cpu == 0 { 2 } else { 0 };
        entries.extend_from_slice(&[0, cpu, APIC_VERSION, flags]);
        entries.extend_from_slice(&0x600u32.to_le_bytes()); // family 6
        entries.extend_from_slice(&0x201u32.to_le_bytes()); // FPU, APIC
        entries.extend_from_slice(&[0; 8]);
        count += 1;
    }
    // Bus 0: ISA.
    entries.extend_from_slice(&[1, 0]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    // The IOAPIC.
    entries.extend_from_slice(&[2, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&IOAPIC_ADDR.to_le_bytes());
    count += 1;
    // ISA IRQ n -> IOAPIC pin n, default polarity and trigger.
    for irq in 0..IOAPIC_PINS {
        entries.extend_from_slice(&[3, 0, 0, 0, 0, irq, ioapic_id, irq]);
        count += 1;
    }
    // LINT0: ExtINT to every local APIC; LINT1: NMI.
    entries.extend_from_slice(&[4, 3, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, 1, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let config_addr = MPTABLE_START + 16;
    let mut config: Vec<u8> = Vec::with_capacity(44 + entries.len());
    config.extend_from_slice(b"PCMP");
    let len = u16::try_from(44 + entries.len()).map_err(|_| MptableError::TooManyCpus(num_cpus))?;
    config.extend_from_slice(&len.to_le_bytes());
    config.push(4); // spec revision 1.4
    config.push(0); // checksum, below
    config.extend_from_slice(b"TANDEM  ");
    config.extend_from_slice(b"TANDEM VMM  ");
    config.extend_from_slice(&[0; 4]); // OEM table pointer
    config.extend_from_slice(&[0; 2]); // OEM table size
    config.extend_from_slice(&count.to_le_bytes());
    config.extend_from_slice(&APIC_ADDR.to_le_bytes());
    config.extend_from_slice(&[0; 4]); // extended length, checksum, reserved
    config.extend_from_slice(&entries);
    config[7] = checksum(&config);

    let mut fp: Vec<u8> = Vec::with_capacity(16);
    fp.extend_from_slice(b"_MP_");
    fp.extend_from_slice(&(config_addr as u32).to_le_bytes());
    fp.extend_from_slice(&[1, 4, 0, 0, 0, 0, 0, 0]); // length 1, rev 1.4, checksum, features
    fp[10] = checksum(&fp);

    fp.extend_from_slice(&config);
    if MPTABLE_START + fp.len() as u64 > EBDA_END {
        return Err(MptableError::TooManyCpus(num_cpus));
    }
    Ok(fp)
}

/// Writes the table for `num_cpus` vCPUs into guest memory.
pub fn write(mem: &GuestMemoryMmap, num_cpus: u8) -> Result<(), MptableError> {
    let table = build(num_cpus)?;
    mem.write_slice(&table, GuestAddress(MPTABLE_START))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_and_counts_are_right() {
        for n in [1u8, 2, 8, MAX_CPUS] {
            let t = build(n).unwrap();
            assert_eq!(&t[0..4], b"_MP_");
            assert_eq!(t[..16].iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
            let cfg = &t[16..];
            assert_eq!(&cfg[0..4], b"PCMP");
            let len = u16::from_le_bytes([cfg[4], cfg[5]]) as usize;
            assert_eq!(len, cfg.len());
            assert_eq!(cfg.iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
            let count = u16::from_le_bytes([cfg[34], cfg[35]]);
            assert_eq!(count as usize, n as usize + 2 + IOAPIC_PINS as usize + 2);
            assert!(MPTABLE_START + t.len() as u64 <= EBDA_END);
        }
        assert!(build(0).is_err());
        assert!(build(MAX_CPUS + 1).is_err());
    }
}

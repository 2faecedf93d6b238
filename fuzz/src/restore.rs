//! The restore path of a snapshot file short of KVM, for the
//! `snapshot_reader` target: the vmm's own loader, then what the restore
//! branch of `vmm::builder` does with devices before its first KVM call.
//!
//! 1. `SnapshotReader::open` (the whole file verified), then every section
//!    it indexes is read back (it must lie where the index says);
//! 2. `vmm::snapshot::load_image`: the manifest checked against itself (a
//!    restore without options), vCPU count and memory size, `vm` and each
//!    `vcpu.N` converted to the KVM structures, the serial console's state,
//!    each virtio device's `dev.<id>` of the kind the manifest lists with
//!    its queues' shape, and the memory image validated against the layout;
//! 3. (builder.rs) devices built on guest memory of that layout, every
//!    transport state checked, the memory image read into guest memory,
//!    each transport restored, the serial console rebuilt from its state.
//!
//! No check of the vmm is copied here. Invariants of the code under test
//! are asserted (a panic is a finding): a manifest with unique ids is
//! compatible with itself; a state `check_state` accepts is restored and
//! saves back the same; the image hands out only pages inside the layout,
//! in order, and accounts for its whole body.

use std::io::{self, Cursor};

use devices::serial::Serial;
use devices::virtio::mmio::MmioTransport;
use devices::GuestMemoryMmap;
use migration::format::{FormatError, SectionInfo, SectionKind};
use migration::memory::PAGE_SIZE;
use migration::MemoryError;
use migration::{
    check_compatible, DeviceConfig, Manifest, SnapshotReader, SnapshotWriter, Snapshottable,
};
use vm_memory::{Bytes, GuestAddress};
use vmm::boot::layout::ram_ranges;
use vmm::vstate::vm_state::VmState;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::fixtures;

/// The fuzz harness's own limit (not a check of the vmm's, which allows
/// what the host has): guest memory it builds for a restore, so that the
/// target behaves the same on every machine.
pub const MAX_MEM: u64 = 8 << 30;

/// What a restore that went through got back.
#[derive(Debug)]
pub struct Restored {
    /// The snapshot's manifest.
    pub manifest: Manifest,
    /// Virtio devices restored.
    pub devices: usize,
    /// Guest pages the image filled.
    pub pages: u64,
}

fn refused(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Runs the whole restore path on `bytes`; `Err` is a refusal (with the
/// reason), which is fine for hostile input.
pub fn restore(bytes: &[u8]) -> Result<Restored, String> {
    let mut reader = SnapshotReader::open(Cursor::new(bytes)).map_err(refused)?;
    let version = reader.version();
    check_index(reader.sections(), bytes.len() as u64);
    read_all(&mut reader)?;
    self_compatible(&mut reader);

    let mut image = vmm::snapshot::load_image(Cursor::new(bytes), "fuzz").map_err(refused)?;
    let saved = image.state.manifest.clone();
    if saved.mem_bytes > MAX_MEM {
        return Err(format!(
            "{} MiB: over the harness's limit",
            saved.mem_bytes >> 20
        ));
    }
    let layout = ram_ranges(saved.mem_bytes);

    // builder.rs, Start::Restore: the devices on the new VM's memory.
    let mem = GuestMemoryMmap::from_ranges(
        &layout
            .iter()
            .map(|&(gpa, len)| (GuestAddress(gpa), len as usize))
            .collect::<Vec<_>>(),
    )
    .map_err(refused)?;
    let configs = saved.devices.iter().filter(|d| d.is_virtio());
    let mut built = Vec::with_capacity(image.state.devices.len());
    for (config, (_, state)) in configs.zip(&image.state.devices) {
        // The registers every transport has go through the virtio-mmio
        // transport (the same code as virtio-pci's); virtio-pci's own part
        // (vectors, MSI-X table) is not exercised here.
        let (transport, _pci) =
            VmState::transport(state).expect("the loader checked the device's kind");
        let t = device_for(config, &mem);
        t.check_state(transport).map_err(refused)?;
        built.push((t, transport.clone()));
    }
    let pages = fill_memory(&mut image, &layout, &mem, version)?;
    for (t, state) in &mut built {
        if let Err(e) = t.restore(state) {
            panic!("restore refused a state check_state accepted: {e}\n{state:#x?}");
        }
        let again = t.save().expect("save a restored transport");
        assert_eq!(
            &again, state,
            "a restored transport saves what it was given"
        );
    }
    let irq = EventFd::new(EFD_NONBLOCK).expect("an eventfd");
    Serial::from_state(irq, io::sink(), &image.state.serial).map_err(refused)?;
    Ok(Restored {
        manifest: saved,
        devices: built.len(),
        pages,
    })
}

/// A manifest whose device ids are unique is compatible with itself (the
/// loader refuses it otherwise, which would hide every later check).
fn self_compatible(reader: &mut SnapshotReader<Cursor<&[u8]>>) {
    let Ok(saved) = reader.read_state::<Manifest>(migration::section::MANIFEST) else {
        return;
    };
    let ids_unique = saved
        .devices
        .iter()
        .enumerate()
        .all(|(i, d)| saved.devices[..i].iter().all(|e| e.id() != d.id()));
    if let Err(e) = check_compatible(&saved, &saved) {
        assert!(!ids_unique, "a manifest is not compatible with itself: {e}");
    }
}

/// The index `open` built: sections inside the file, in order, disjoint,
/// names unique.
fn check_index(sections: &[SectionInfo], file_len: u64) {
    let mut end = 16;
    for (i, s) in sections.iter().enumerate() {
        assert!(
            s.offset >= end,
            "section {} overlaps the one before",
            s.name
        );
        end = s.offset.checked_add(s.len).expect("section end overflows");
        assert!(end <= file_len, "section {} ends past the file", s.name);
        assert!(
            sections[..i].iter().all(|o| o.name != s.name),
            "two sections {}",
            s.name
        );
    }
}

/// Reads every indexed section: each yields exactly its indexed length.
fn read_all(reader: &mut SnapshotReader<Cursor<&[u8]>>) -> Result<(), String> {
    for s in reader.sections().to_vec() {
        let got = match s.kind {
            SectionKind::State => reader.read_state_bytes(&s.name).map_err(refused)?.len() as u64,
            kind @ (SectionKind::Memory | SectionKind::Pages) => {
                if kind == SectionKind::Pages {
                    assert_eq!(s.offset % 4096, 0, "pages section {} unaligned", s.name);
                }
                let (len, mut body) = reader.section_reader(&s.name, kind).map_err(refused)?;
                assert_eq!(len, s.len, "section {} length", s.name);
                io::copy(&mut body, &mut io::sink()).map_err(refused)?
            }
        };
        assert_eq!(got, s.len, "bytes read from section {}", s.name);
    }
    Ok(())
}

/// A fresh transport for the device `config` describes, on `mem`.
fn device_for(config: &DeviceConfig, mem: &GuestMemoryMmap) -> MmioTransport {
    match config {
        DeviceConfig::Net { mac, rsc, .. } => fixtures::net(mem, *mac, *rsc).0,
        DeviceConfig::Blk {
            readonly, serial, ..
        } => fixtures::block(mem, serial, *readonly).0,
        DeviceConfig::Serial { .. } | DeviceConfig::PciHost { .. } => {
            unreachable!("only virtio devices have a transport")
        }
    }
}

/// Reads the (validated) image into `mem`: every chunk lies inside the
/// layout, after the previous one; the image accounts for its whole body.
/// The one refusal left after validation is a version 3 image whose pages
/// do not match their CRC (checked only as they are read).
fn fill_memory(
    image: &mut vmm::snapshot::Restore<Cursor<&[u8]>>,
    layout: &[(u64, u64)],
    mem: &GuestMemoryMmap,
    version: u32,
) -> Result<u64, String> {
    let mut next = 0u64;
    let stats = image.read_memory(|gpa, bytes| {
        let end = gpa + bytes.len() as u64;
        assert!(gpa >= next, "chunk at {gpa:#x} before {next:#x}");
        assert!(
            layout.iter().any(|&(r, l)| gpa >= r && end <= r + l),
            "chunk {gpa:#x}..{end:#x} outside the layout"
        );
        next = end;
        mem.write_slice(bytes, GuestAddress(gpa))
    });
    // A validated image cannot be refused any more, but for its pages'
    // CRC: its runs are inside guest memory and its sections are as long
    // as the table says.
    let stats = match stats {
        Ok(s) => s,
        Err(e @ vmm::snapshot::SnapshotError::Memory {
            err: MemoryError::PagesCrc { .. },
            ..
        }) if version >= 3 => return Err(refused(e)),
        Err(e) => panic!("validated memory image failed to load: {e}"),
    };
    let body = if version >= 3 {
        16 + 12 * stats.runs
    } else {
        8 + 12 * stats.runs + stats.pages * PAGE_SIZE
    };
    assert_eq!(stats.body_len, body, "image body accounted for");
    Ok(stats.pages)
}

/// `bytes` with the trailer's total length and the CRC made right (the
/// CRC the format's own [`migration::format::expected_crc`] gives, which
/// leaves out pages bodies; over every byte when the structure does not
/// walk), when they end in a trailer (its tag 17 bytes from the end) and
/// were not right already.
pub fn resealed(bytes: &[u8]) -> Option<Vec<u8>> {
    let len = bytes.len();
    if len < 16 + 17 || bytes[len - 17] != b'E' {
        return None;
    }
    let mut fixed = bytes.to_vec();
    fixed[len - 12..len - 4].copy_from_slice(&(len as u64).to_le_bytes());
    let crc = migration::format::expected_crc(&mut Cursor::new(&fixed[..]))
        .ok()
        .flatten()
        .unwrap_or_else(|| crc32fast::hash(&fixed[..len - 4]));
    fixed[len - 4..].copy_from_slice(&crc.to_le_bytes());
    (fixed != bytes).then_some(fixed)
}

/// A snapshot file written with `SnapshotWriter` from `records`: each is a
/// kind byte (its low two bits: 1 memory table, 2 pages, else state), a name length `n`, `n` name
/// bytes, a body length (u16, little-endian) and the body, the last one
/// cut where the input ends. Records the writer refuses (a bad or
/// duplicate name) are left out. So the fuzzer can change a section's
/// length, which in a file breaks the structure around it.
pub fn assemble(mut records: &[u8]) -> Vec<u8> {
    let Ok(mut w) = SnapshotWriter::new(Vec::new()) else {
        return Vec::new();
    };
    while let Some((&[kind, n], rest)) = records.split_first_chunk::<2>() {
        let (name, rest) = rest.split_at(usize::from(n).min(rest.len()));
        let Some((len, rest)) = rest.split_first_chunk::<2>() else {
            break;
        };
        let (body, rest) = rest.split_at(usize::from(u16::from_le_bytes(*len)).min(rest.len()));
        records = rest;
        let kind = match kind & 3 {
            1 => SectionKind::Memory,
            2 => SectionKind::Pages,
            _ => SectionKind::State,
        };
        if kind == SectionKind::Pages && !body.len().is_multiple_of(4096) {
            continue;
        }
        match std::str::from_utf8(name) {
            Ok(name) => match w.write_section(name, kind, body) {
                Ok(()) | Err(FormatError::BadName(_) | FormatError::DuplicateName(_)) => {}
                Err(e) => panic!("writing a section to memory failed: {e}"),
            },
            Err(_) => continue,
        }
    }
    w.finish().expect("finish a snapshot in memory")
}

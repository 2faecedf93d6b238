//! The restore path of a snapshot file short of KVM, for the
//! `snapshot_reader` target: everything `vmm::snapshot::load` and the
//! restore branch of `vmm::vm` do before their first KVM call, in their
//! order, with the migration and devices crates only.
//!
//! 1. `SnapshotReader::open` (the whole file verified), then every section
//!    it indexes is read back (it must lie where the index says);
//! 2. the manifest; its compatibility with itself (the configuration a
//!    restore without options asks for); vCPU count and memory size;
//! 3. `vm` and each `vcpu.N`, decoded and converted to the KVM structures;
//! 4. the serial console's state, then each virtio device's `dev.<id>`
//!    of the kind the manifest lists;
//! 5. the memory image validated against the VM's layout;
//! 6. (builder.rs) devices built on guest memory of that layout, every
//!    transport state checked, the memory image read into guest memory,
//!    each transport restored, the serial console rebuilt from its state.
//!
//! Checks that live only in the vmm are copied here and marked "vmm:".
//! Invariants of the code under test are asserted (a panic is a finding):
//! a state `check_state` accepts is restored and saves back the same; the
//! image hands out only pages inside the layout, in order, and accounts
//! for its whole body.

use std::io::{self, Cursor};

use devices::serial::Serial;
use devices::virtio::mmio::MmioTransport;
use devices::GuestMemoryMmap;
use migration::devices::{DeviceState, MmioTransportState};
use migration::format::{FormatError, SectionInfo, SectionKind};
use migration::memory::PAGE_SIZE;
use migration::vcpu::VcpuState;
use migration::vm::VmState;
use migration::{
    check_compatible, section, DeviceConfig, Manifest, SnapshotReader, SnapshotWriter,
    Snapshottable,
};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::fixtures;

/// vmm: `config::max_cpus()` (the MP table's limit).
pub const MAX_VCPUS: u32 = 32;
/// vmm: `config::check_mem_fits` refuses more than the host has; here a
/// fixed cap, so that the target behaves the same on every machine.
pub const MAX_MEM: u64 = 8 << 30;
/// vmm: the smallest guest `load` takes.
pub const MIN_MEM: u64 = 16 << 20;
/// vmm: the UART's receive FIFO (`snapshot::UART_FIFO`).
const UART_FIFO: usize = 64;
/// vmm: `boot::layout::MMIO_GAP_START` / `MMIO_GAP_END`.
const MMIO_GAP_START: u64 = 0xd000_0000;
const MMIO_GAP_END: u64 = 0x1_0000_0000;

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

/// vmm: `boot::layout::ram_ranges`: below the MMIO gap, then above 4 GiB.
pub fn ram_ranges(mem: u64) -> Vec<(u64, u64)> {
    if mem <= MMIO_GAP_START {
        vec![(0, mem)]
    } else {
        vec![(0, MMIO_GAP_START), (MMIO_GAP_END, mem - MMIO_GAP_START)]
    }
}

fn refused(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Runs the whole restore path on `bytes`; `Err` is a refusal (with the
/// reason), which is fine for hostile input.
pub fn restore(bytes: &[u8]) -> Result<Restored, String> {
    let mut reader = SnapshotReader::open(Cursor::new(bytes)).map_err(refused)?;
    check_index(reader.sections(), bytes.len() as u64);
    read_all(&mut reader)?;

    let saved: Manifest = reader.read_state(section::MANIFEST).map_err(refused)?;
    let ids_unique = saved
        .devices
        .iter()
        .enumerate()
        .all(|(i, d)| saved.devices[..i].iter().all(|e| e.id() != d.id()));
    match check_compatible(&saved, &saved) {
        Ok(_) => {}
        Err(e) if ids_unique => panic!("a manifest is not compatible with itself: {e}"),
        Err(e) => return Err(refused(e)),
    }
    if saved.vcpus == 0 || saved.vcpus > MAX_VCPUS {
        return Err(format!("{} vCPUs", saved.vcpus));
    }
    if saved.mem_bytes < MIN_MEM
        || saved.mem_bytes > MAX_MEM
        || !saved.mem_bytes.is_multiple_of(PAGE_SIZE)
    {
        return Err(format!("memory size {} bytes", saved.mem_bytes));
    }

    read_kvm_state(&mut reader, None)?;
    for id in 0..saved.vcpus {
        read_kvm_state(&mut reader, Some(id))?;
    }
    let serial = read_serial(&mut reader)?;
    let transports = read_transports(&mut reader, &saved)?;
    let layout = ram_ranges(saved.mem_bytes);
    migration::validate_memory(&mut reader, section::MEMORY, &layout).map_err(refused)?;

    // builder.rs, Start::Restore: the devices on the new VM's memory.
    let mem = GuestMemoryMmap::from_ranges(
        &layout
            .iter()
            .map(|&(gpa, len)| (GuestAddress(gpa), len as usize))
            .collect::<Vec<_>>(),
    )
    .map_err(refused)?;
    let mut built = Vec::with_capacity(transports.len());
    for (config, state) in &transports {
        let t = device_for(config, &mem);
        t.check_state(state).map_err(refused)?;
        built.push(t);
    }
    let pages = fill_memory(&mut reader, &layout, &mem);
    for (t, (_, state)) in built.iter_mut().zip(&transports) {
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
    Serial::from_state(irq, io::sink(), &serial).map_err(refused)?;
    Ok(Restored {
        manifest: saved,
        devices: built.len(),
        pages,
    })
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
            SectionKind::Memory => {
                let (len, mut body) = reader
                    .section_reader(&s.name, SectionKind::Memory)
                    .map_err(refused)?;
                assert_eq!(len, s.len, "section {} length", s.name);
                io::copy(&mut body, &mut io::sink()).map_err(refused)?
            }
        };
        assert_eq!(got, s.len, "bytes read from section {}", s.name);
    }
    Ok(())
}

/// The one place that knows the vCPU and VM state types: reads the `vm`
/// section (`vcpu` None) or vCPU `id`'s section, and converts it to the
/// KVM structures as the vmm does before its ioctls.
fn read_kvm_state(
    reader: &mut SnapshotReader<Cursor<&[u8]>>,
    vcpu: Option<u32>,
) -> Result<(), String> {
    match vcpu {
        None => {
            let vm: VmState = reader.read_state(section::VM).map_err(refused)?;
            vm.to_kvm().map(drop).map_err(refused)
        }
        Some(id) => {
            let name = section::vcpu(id);
            let v: VcpuState = reader.read_state(&name).map_err(refused)?;
            if v.id != id {
                // vmm: each section holds the vCPU it is named after.
                return Err(format!("section {name} holds vCPU {}", v.id));
            }
            v.to_kvm().map(drop).map_err(refused)
        }
    }
}

/// The serial console's state (vmm: a serial port, FIFO not over 64 bytes).
fn read_serial(
    reader: &mut SnapshotReader<Cursor<&[u8]>>,
) -> Result<vm_superio::serial::SerialState, String> {
    let dev = section::device("com1");
    match reader.read_state::<DeviceState>(&dev).map_err(refused)? {
        DeviceState::Serial(s) if s.in_buffer.len() <= UART_FIFO => {
            Ok(vm_superio::serial::SerialState::from(&s))
        }
        DeviceState::Serial(s) => Err(format!("{} bytes in the FIFO", s.in_buffer.len())),
        _ => Err(format!("section {dev} is not a serial port")),
    }
}

/// Each virtio device's transport state, of the kind the manifest lists,
/// in manifest order.
fn read_transports(
    reader: &mut SnapshotReader<Cursor<&[u8]>>,
    saved: &Manifest,
) -> Result<Vec<(DeviceConfig, MmioTransportState)>, String> {
    let mut out = Vec::new();
    for d in &saved.devices {
        let net = match d {
            DeviceConfig::Serial { .. } => continue,
            DeviceConfig::Net { .. } => true,
            DeviceConfig::Blk { .. } => false,
        };
        let name = section::device(d.id());
        let transport = match reader.read_state::<DeviceState>(&name).map_err(refused)? {
            DeviceState::VirtioNet { transport, .. } if net => transport,
            DeviceState::VirtioBlk { transport, .. } if !net => transport,
            _ => return Err(format!("section {name} is not the {}", d.describe())),
        };
        check_queues(&transport, if net { 2 } else { 1 })?;
        out.push((d.clone(), transport));
    }
    Ok(out)
}

/// vmm: `snapshot::check_queues` (queue count, each queue's registers).
fn check_queues(t: &MmioTransportState, count: usize) -> Result<(), String> {
    if t.queues.len() != count {
        return Err(format!("{} queues, the device has {count}", t.queues.len()));
    }
    for (i, q) in t.queues.iter().enumerate() {
        virtio_queue::Queue::try_from(virtio_queue::QueueState::from(q))
            .map_err(|e| format!("queue {i}: {e:?}"))?;
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
        DeviceConfig::Serial { .. } => unreachable!("serial consoles have no transport"),
    }
}

/// Reads the (validated) image into `mem`: every chunk lies inside the
/// layout, after the previous one; the image accounts for its whole body.
fn fill_memory(
    reader: &mut SnapshotReader<Cursor<&[u8]>>,
    layout: &[(u64, u64)],
    mem: &GuestMemoryMmap,
) -> u64 {
    let mut next = 0u64;
    let stats = migration::read_memory(reader, section::MEMORY, layout, |gpa, bytes| {
        let end = gpa + bytes.len() as u64;
        assert!(gpa >= next, "chunk at {gpa:#x} before {next:#x}");
        assert!(
            layout.iter().any(|&(r, l)| gpa >= r && end <= r + l),
            "chunk {gpa:#x}..{end:#x} outside the layout"
        );
        next = end;
        mem.write_slice(bytes, GuestAddress(gpa))
    });
    // A validated image cannot be refused any more: its runs are inside
    // guest memory and its body is as long as the table says.
    let stats = match stats {
        Ok(s) => s,
        Err(e) => panic!("validated memory image failed to load: {e}"),
    };
    assert_eq!(
        stats.body_len,
        8 + 12 * stats.runs + stats.pages * PAGE_SIZE,
        "image body accounted for"
    );
    stats.pages
}

/// `bytes` with the trailer's total length and the CRC made right, when
/// they end in a trailer (its tag 17 bytes from the end) and were not
/// right already.
pub fn resealed(bytes: &[u8]) -> Option<Vec<u8>> {
    let len = bytes.len();
    if len < 16 + 17 || bytes[len - 17] != b'E' {
        return None;
    }
    let mut fixed = bytes.to_vec();
    fixed[len - 12..len - 4].copy_from_slice(&(len as u64).to_le_bytes());
    let crc = crc32fast::hash(&fixed[..len - 4]);
    fixed[len - 4..].copy_from_slice(&crc.to_le_bytes());
    (fixed != bytes).then_some(fixed)
}

/// A snapshot file written with `SnapshotWriter` from `records`: each is a
/// kind byte (bit 0: memory, else state), a name length `n`, `n` name
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
        let kind = if kind & 1 != 0 {
            SectionKind::Memory
        } else {
            SectionKind::State
        };
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

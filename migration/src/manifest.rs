//! The snapshot manifest: what VM a snapshot is of, and whether a requested VM matches it.
//!
//! This module owns the `manifest` state section (written first, read first) and the
//! compatibility check a restore runs before it applies anything: the same memory size,
//! vCPU count, guest-visible devices (kind, id, MAC, read-only flag, MMIO slot or PCI
//! device, the PCI host bridge of `--machine pci`) and firmware image (size and
//! SHA-256). A difference in a backend only (another tap, another path to the disk
//! image or to the same firmware bytes) is allowed and reported back as a note, since
//! moving a VM to another host renames those. An incoming migration (and a COLO
//! secondary's initial sync) runs the same check on the source's manifest
//! ([`check_source`]), its messages naming the source. Every difference is named at
//! once, never only the first.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::hex::mac;

/// The section name of the manifest.
pub const MANIFEST_SECTION: &str = "manifest";

/// What a snapshot is of: also the shape of a requested configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The tandem version that wrote the snapshot (informational).
    #[serde(default)]
    pub tandem_version: String,
    /// Guest memory in bytes.
    pub mem_bytes: u64,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Devices, in the order they were attached.
    pub devices: Vec<DeviceConfig>,
    /// The firmware image it booted from (`tandem run --firmware`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<FirmwareId>,
}

/// Which firmware image a VM booted from. The image itself is not part of
/// the state (it is read-only, and a file on the host): a restore or an
/// incoming migration is given it again (`--firmware`), and it must be the
/// same bytes, checked by size and SHA-256, since the guest's state (its
/// stack, its saved return addresses) points into that image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FirmwareId {
    /// The file it was read from (informational: another path is allowed).
    pub path: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// SHA-256 of its bytes, in hex.
    pub sha256: String,
}

impl FirmwareId {
    /// "/usr/share/ovmf/OVMF.fd (2 MiB, SHA-256 5b0a9c1e...)".
    fn describe(&self) -> String {
        let short: String = self.sha256.chars().take(16).collect();
        // Images are whole 4 KiB pages.
        let kib = if self.bytes.is_multiple_of(1 << 20) {
            size(self.bytes)
        } else {
            format!("{} KiB", self.bytes >> 10)
        };
        format!("{} ({kib}, SHA-256 {short}...)", self.path)
    }
}

/// Where a virtio-mmio device sits on the guest's bus.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MmioSlot {
    /// Base address of its register window.
    pub base: u64,
    /// Its interrupt line.
    pub irq: u32,
}

impl fmt::Display for MmioSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MMIO {:#x} irq {}", self.base, self.irq)
    }
}

/// One device's key configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum DeviceConfig {
    /// The serial console.
    Serial {
        /// Device id.
        id: String,
    },
    /// PCI bus 0 with its host bridge (`tandem run --machine pci`).
    PciHost {
        /// Device id (`pci0`).
        id: String,
    },
    /// A virtio-net NIC.
    Net {
        /// Device id (e.g. `net0`).
        id: String,
        /// The host tap.
        tap: String,
        /// The guest-visible MAC.
        #[serde(with = "mac")]
        mac: [u8; 6],
        /// Receive segment coalescing (changes the features offered).
        #[serde(default)]
        rsc: bool,
        /// Where the guest finds it on virtio-mmio (kept, unused, when it
        /// is on PCI).
        slot: MmioSlot,
        /// Its device number on PCI bus 0, when it is a virtio-pci
        /// function (`transport=pci`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pci: Option<u8>,
    },
    /// A virtio-blk disk.
    Blk {
        /// Device id (e.g. `blk0`).
        id: String,
        /// The host disk image.
        path: String,
        /// Whether the guest sees it read-only.
        readonly: bool,
        /// Its size in bytes, as the guest sees it (whole sectors).
        #[serde(default)]
        bytes: u64,
        /// The id the guest reads (`/sys/block/vdX/serial`).
        #[serde(default)]
        serial: String,
        /// Where the guest finds it on virtio-mmio (kept, unused, when it
        /// is on PCI).
        slot: MmioSlot,
        /// Its device number on PCI bus 0, when it is a virtio-pci
        /// function (`transport=pci`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pci: Option<u8>,
    },
}

impl DeviceConfig {
    /// The device's id.
    pub fn id(&self) -> &str {
        match self {
            DeviceConfig::Serial { id }
            | DeviceConfig::PciHost { id }
            | DeviceConfig::Net { id, .. } => id,
            DeviceConfig::Blk { id, .. } => id,
        }
    }

    /// Where a virtio-mmio device sits (`None` for the serial console, the
    /// host bridge and a virtio-pci device).
    pub fn slot(&self) -> Option<MmioSlot> {
        match self {
            DeviceConfig::Serial { .. } | DeviceConfig::PciHost { .. } => None,
            DeviceConfig::Net { slot, pci, .. } | DeviceConfig::Blk { slot, pci, .. } => {
                pci.is_none().then_some(*slot)
            }
        }
    }

    /// The PCI device number of a virtio-pci device.
    pub fn pci_slot(&self) -> Option<u8> {
        match self {
            DeviceConfig::Net { pci, .. } | DeviceConfig::Blk { pci, .. } => *pci,
            _ => None,
        }
    }

    /// Whether it is a virtio device (on either transport).
    pub fn is_virtio(&self) -> bool {
        matches!(self, DeviceConfig::Net { .. } | DeviceConfig::Blk { .. })
    }

    /// A short human description: "NIC net0 on tap0".
    pub fn describe(&self) -> String {
        match self {
            DeviceConfig::Serial { id } => format!("serial console {id}"),
            DeviceConfig::PciHost { id } => format!("PCI host bridge {id} (--machine pci)"),
            DeviceConfig::Net { id, tap, .. } => format!("NIC {id} on {tap}"),
            DeviceConfig::Blk { id, path, .. } => format!("disk {id} on {path}"),
        }
    }
}

/// Compatibility check failed: every difference that forbids the restore.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CompatError {
    /// The requested VM is not the one in the snapshot.
    #[error("the snapshot does not fit this VM: {}", .0.join("; "))]
    Mismatch(Vec<String>),
    /// The VM here is not the migration source's (or the COLO primary's).
    #[error("the source's VM does not fit this one: {}", .0.join("; "))]
    Source(Vec<String>),
}

/// Whose manifest is compared with this VM's, as the messages name it.
#[derive(Clone, Copy)]
enum Theirs {
    Snapshot,
    Source,
}

impl Theirs {
    /// Who has something: "snapshot has 1 vCPU".
    fn has(self) -> &'static str {
        match self {
            Theirs::Snapshot => "snapshot",
            Theirs::Source => "the source",
        }
    }

    /// "which the snapshot does not have".
    fn the(self) -> &'static str {
        match self {
            Theirs::Snapshot => "the snapshot",
            Theirs::Source => "the source",
        }
    }

    /// "snapshot's VM booted without firmware".
    fn its(self) -> &'static str {
        match self {
            Theirs::Snapshot => "snapshot's",
            Theirs::Source => "the source's",
        }
    }
}

fn size(bytes: u64) -> String {
    const MIB: u64 = 1 << 20;
    if bytes.is_multiple_of(MIB) {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{bytes} bytes")
    }
}

fn plural(n: u32, one: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {one}s")
    }
}

/// Compares a snapshot's manifest with the configuration a restore asks for.
///
/// Returns the allowed differences (backends renamed) as notes for the log, or every
/// forbidding difference at once.
pub fn check_compatible(
    snapshot: &Manifest,
    requested: &Manifest,
) -> Result<Vec<String>, CompatError> {
    differences(snapshot, requested, Theirs::Snapshot).map_err(CompatError::Mismatch)
}

/// [`check_compatible`] for a migration's destination (or a COLO
/// secondary): the source's manifest `theirs` against this VM's `ours`,
/// the messages naming the source.
pub fn check_source(theirs: &Manifest, ours: &Manifest) -> Result<Vec<String>, CompatError> {
    differences(theirs, ours, Theirs::Source).map_err(CompatError::Source)
}

/// The notes, or every forbidding difference.
fn differences(
    saved: &Manifest,
    requested: &Manifest,
    who: Theirs,
) -> Result<Vec<String>, Vec<String>> {
    let mut errors = Vec::new();
    let mut notes = Vec::new();
    let has = who.has();
    if saved.mem_bytes != requested.mem_bytes {
        errors.push(format!(
            "{has} has {} of memory, this VM asks for {}",
            size(saved.mem_bytes),
            size(requested.mem_bytes)
        ));
    }
    if saved.vcpus != requested.vcpus {
        errors.push(format!(
            "{has} has {}, this VM asks for {}",
            plural(saved.vcpus, "vCPU"),
            requested.vcpus
        ));
    }
    for theirs in &saved.devices {
        let Some(asked) = requested.devices.iter().find(|d| d.id() == theirs.id()) else {
            errors.push(format!("{has} has {}; none given", theirs.describe()));
            continue;
        };
        compare_device(theirs, asked, who, &mut errors, &mut notes);
    }
    for asked in &requested.devices {
        if !saved.devices.iter().any(|d| d.id() == asked.id()) {
            errors.push(format!(
                "this VM asks for {}, which {} does not have",
                asked.describe(),
                who.the()
            ));
        }
    }
    compare_firmware(
        saved.firmware.as_ref(),
        requested.firmware.as_ref(),
        who,
        &mut errors,
        &mut notes,
    );
    if errors.is_empty() {
        Ok(notes)
    } else {
        Err(errors)
    }
}

/// The same firmware image, or none on both sides; another path to the
/// same bytes is a note.
fn compare_firmware(
    saved: Option<&FirmwareId>,
    asked: Option<&FirmwareId>,
    who: Theirs,
    errors: &mut Vec<String>,
    notes: &mut Vec<String>,
) {
    let its = who.its();
    match (saved, asked) {
        (None, None) => {}
        (Some(s), None) => errors.push(format!(
            "{its} VM booted from firmware {}: give --firmware with that image",
            s.describe()
        )),
        (None, Some(a)) => errors.push(format!(
            "this VM asks for --firmware {}, {its} VM booted without firmware",
            a.path
        )),
        (Some(s), Some(a)) if s.bytes != a.bytes || s.sha256 != a.sha256 => errors.push(format!(
            "{its} VM booted from firmware {}, this VM's --firmware is {}: \
                 another image",
            s.describe(),
            a.describe()
        )),
        (Some(s), Some(a)) => {
            if s.path != a.path {
                notes.push(format!(
                    "firmware: {its} was {}, now {} (the same bytes)",
                    s.path, a.path
                ));
            }
        }
    }
}

fn compare_device(
    saved: &DeviceConfig,
    asked: &DeviceConfig,
    who: Theirs,
    errors: &mut Vec<String>,
    notes: &mut Vec<String>,
) {
    use DeviceConfig::*;
    let id = saved.id();
    let has = who.has();
    let where_ = |p: Option<u8>| match p {
        Some(n) => format!("on PCI at 00:{n:02x}.0 (transport=pci)"),
        None => "on virtio-mmio (transport=mmio)".to_string(),
    };
    if saved.pci_slot() != asked.pci_slot() {
        errors.push(format!(
            "device {id}: {has} has it {}, this VM puts it {}",
            where_(saved.pci_slot()),
            where_(asked.pci_slot())
        ));
    }
    match (saved, asked) {
        (Serial { .. }, Serial { .. }) | (PciHost { .. }, PciHost { .. }) => {}
        (Net { .. }, Net { .. }) => compare_net(saved, asked, who, errors, notes),
        (Blk { .. }, Blk { .. }) => compare_blk(saved, asked, who, errors, notes),
        _ => errors.push(format!(
            "{has} has {}, this VM asks for {}",
            saved.describe(),
            asked.describe()
        )),
    }
}

/// A device's virtio-mmio slot must not move: the guest found it there.
fn compare_slot(
    errors: &mut Vec<String>,
    who: Theirs,
    (what, id): (&str, &str),
    s: &MmioSlot,
    a: &MmioSlot,
) {
    if s != a {
        errors.push(format!(
            "{what} {id}: {} has it at {s}, this VM puts it at {a}",
            who.has()
        ));
    }
}

/// [`compare_device`] for two NICs (anything else compares as equal).
fn compare_net(
    saved: &DeviceConfig,
    asked: &DeviceConfig,
    who: Theirs,
    errors: &mut Vec<String>,
    notes: &mut Vec<String>,
) {
    let (
        DeviceConfig::Net {
            id,
            tap: st,
            mac: sm,
            rsc: sr,
            slot: ss,
            ..
        },
        DeviceConfig::Net {
            tap: at,
            mac: am,
            rsc: ar,
            slot: asl,
            ..
        },
    ) = (saved, asked)
    else {
        return;
    };
    let has = who.has();
    if sr != ar {
        let on = |r: &bool| if *r { "on" } else { "off" };
        errors.push(format!(
            "NIC {id}: {has} has rsc={}, this VM asks for rsc={}",
            on(sr),
            on(ar)
        ));
    }
    if sm != am {
        errors.push(format!(
            "NIC {id}: {has} has MAC {}, this VM asks for {}",
            mac::format(sm),
            mac::format(am)
        ));
    }
    compare_slot(errors, who, ("NIC", id), ss, asl);
    if st != at {
        notes.push(format!("NIC {id}: {has} was on {st}, now on {at}"));
    }
}

/// [`compare_device`] for two disks (anything else compares as equal).
fn compare_blk(
    saved: &DeviceConfig,
    asked: &DeviceConfig,
    who: Theirs,
    errors: &mut Vec<String>,
    notes: &mut Vec<String>,
) {
    let (
        DeviceConfig::Blk {
            id,
            path: sp,
            readonly: sr,
            bytes: sb,
            serial: sserial,
            slot: ss,
            ..
        },
        DeviceConfig::Blk {
            path: ap,
            readonly: ar,
            bytes: ab,
            serial: aserial,
            slot: asl,
            ..
        },
    ) = (saved, asked)
    else {
        return;
    };
    let has = who.has();
    if sb != ab {
        errors.push(format!(
            "disk {id}: {has} has a disk of {}, {ap} is {}",
            size(*sb),
            size(*ab)
        ));
    }
    if sserial != aserial {
        errors.push(format!(
            "disk {id}: {has} has id {sserial:?}, this VM asks for {aserial:?}"
        ));
    }
    if sr != ar {
        let ro = |r: &bool| if *r { "read-only" } else { "read-write" };
        errors.push(format!(
            "disk {id}: {has} has it {}, this VM asks for {}",
            ro(sr),
            ro(ar)
        ));
    }
    compare_slot(errors, who, ("disk", id), ss, asl);
    if sp != ap {
        notes.push(format!("disk {id}: {has} was on {sp}, now on {ap}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(firmware: Option<FirmwareId>) -> Manifest {
        Manifest {
            mem_bytes: 64 << 20,
            vcpus: 1,
            firmware,
            ..Manifest::default()
        }
    }

    fn fw(path: &str, sha: &str) -> Option<FirmwareId> {
        Some(FirmwareId {
            path: path.into(),
            bytes: 2 << 20,
            sha256: sha.repeat(64),
        })
    }

    fn errors(saved: &Manifest, asked: &Manifest) -> String {
        check_compatible(saved, asked).unwrap_err().to_string()
    }

    #[test]
    fn the_same_firmware_bytes_or_none_are_asked_for() {
        assert_eq!(check_compatible(&vm(None), &vm(None)), Ok(vec![]));
        let a = vm(fw("/usr/share/ovmf/OVMF.fd", "a"));
        assert_eq!(check_compatible(&a, &a), Ok(vec![]));
        let notes = check_compatible(&a, &vm(fw("/tmp/OVMF.fd", "a"))).unwrap();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("/tmp/OVMF.fd"), "{notes:?}");

        let e = errors(&a, &vm(None));
        assert!(e.contains("give --firmware"), "{e}");
        assert!(
            e.contains("/usr/share/ovmf/OVMF.fd (2 MiB, SHA-256 aaaa"),
            "{e}"
        );
        let e = errors(&vm(None), &a);
        assert!(e.contains("booted without firmware"), "{e}");
        let e = errors(&a, &vm(fw("/usr/share/ovmf/OVMF.fd", "b")));
        assert!(e.contains("another image"), "{e}");
        let mut smaller = vm(fw("/usr/share/ovmf/OVMF.fd", "a"));
        if let Some(f) = smaller.firmware.as_mut() {
            f.bytes = 1 << 20;
        }
        assert!(errors(&a, &smaller).contains("1 MiB"));
    }

    /// A destination's check names the source, and every difference.
    #[test]
    fn a_source_of_another_shape_is_named_with_every_difference() {
        let a = vm(fw("/a.fd", "a"));
        let mut b = vm(fw("/b.fd", "b"));
        b.vcpus = 2;
        b.devices.push(DeviceConfig::PciHost { id: "pci0".into() });
        let e = check_source(&a, &b).unwrap_err();
        let CompatError::Source(p) = &e else {
            panic!("{e:?}")
        };
        assert_eq!(p.len(), 3, "{p:?}");
        let e = e.to_string();
        for part in [
            "the source's VM does not fit this one: the source has 1 vCPU, this VM asks for 2",
            "this VM asks for PCI host bridge pci0 (--machine pci), which the source does not have",
            "the source's VM booted from firmware /a.fd (2 MiB, SHA-256 aaaa",
            "another image",
        ] {
            assert!(e.contains(part), "{part:?} not in {e}");
        }
        let e = check_source(&a, &vm(None)).unwrap_err().to_string();
        assert!(e.contains("give --firmware with that image"), "{e}");
        let e = check_source(&vm(None), &a).unwrap_err().to_string();
        assert!(e.contains("the source's VM booted without firmware"), "{e}");
    }

    #[test]
    fn a_manifest_without_firmware_reads_and_writes_as_before() {
        let text = r#"{"mem_bytes":1048576,"vcpus":1,"devices":[]}"#;
        let m: Manifest = serde_json::from_str(text).unwrap();
        assert_eq!(m.firmware, None);
        let back = serde_json::to_string(&m).unwrap();
        assert!(!back.contains("firmware"), "{back}");
    }
}

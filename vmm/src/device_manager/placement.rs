//! Where each device goes: the manifest's device list, each virtio
//! device's virtio-mmio window and IRQ or PCI slot, and the checks on
//! them (an ACPI machine's ISA IRQs).
//!
//! Pure placement from the configuration, run on the VMM thread before the
//! VM is built (and by `--restore`/`--incoming` to check a manifest); it
//! never touches KVM or a device.

use migration::manifest::MmioSlot;
use migration::{DeviceConfig, Manifest};

use super::{DeviceError, PCI_ID, SERIAL_ID, VIRTIO_IRQ_BASE, VIRTIO_IRQ_LAST};
use crate::boot::layout;
use crate::config::{self, DiskSpec, Machine, NetSpec, VirtioTransport};
use devices::virtio::mmio::MMIO_WINDOW;
use devices::virtio::pci::BAR_SIZE;

/// The machine a manifest describes.
pub fn machine_of(m: &Manifest) -> Machine {
    if m.devices
        .iter()
        .any(|d| matches!(d, DeviceConfig::PciHost { .. }))
    {
        Machine::Pci
    } else {
        Machine::Legacy
    }
}

/// Where virtio device `index` (NICs first, then disks) sits: its MMIO
/// window and IRQ.
pub fn virtio_slot(index: usize) -> Result<MmioSlot, DeviceError> {
    let max = VIRTIO_IRQ_LAST - VIRTIO_IRQ_BASE + 1;
    match u32::try_from(index) {
        Ok(i) if i < max => Ok(MmioSlot {
            base: layout::MMIO_GAP_START + u64::from(i) * MMIO_WINDOW,
            irq: VIRTIO_IRQ_BASE + i,
        }),
        _ => Err(DeviceError::TooMany(max)),
    }
}

/// The PCI device numbers of virtio-pci devices: 1, 2, ... in bus order
/// (0 is the host bridge).
struct PciSlots {
    machine: Machine,
    next: u8,
}

impl PciSlots {
    /// Where device `id` asking for `transport` goes: `None` for
    /// virtio-mmio.
    fn take(&mut self, id: &str, t: Option<VirtioTransport>) -> Result<Option<u8>, DeviceError> {
        match VirtioTransport::resolve(t, self.machine) {
            VirtioTransport::Mmio => Ok(None),
            VirtioTransport::Pci if self.machine != Machine::Pci => {
                Err(DeviceError::PciWithoutMachine(id.to_string()))
            }
            VirtioTransport::Pci if self.next >= 32 => Err(DeviceError::PciFull(id.to_string())),
            VirtioTransport::Pci => {
                self.next += 1;
                Ok(Some(self.next - 1))
            }
        }
    }
}

/// Where virtio-pci function `slot` puts its BAR until the guest moves it.
pub(super) fn pci_bar(slot: u8) -> u32 {
    (layout::PCI_MMIO_START + u64::from(slot) * u64::from(BAR_SIZE)) as u32
}

/// The manifest's entries (guest-visible facts) of the virtio devices
/// `nets` and `disks` would give on `machine`, in bus order (each disk's
/// size is read from its file).
pub fn virtio_configs(
    nets: &[NetSpec],
    disks: &[DiskSpec],
    machine: Machine,
) -> Result<Vec<DeviceConfig>, DeviceError> {
    let mut out = Vec::with_capacity(nets.len() + disks.len());
    let mut pci = PciSlots { machine, next: 1 };
    for (i, n) in nets.iter().enumerate() {
        let id = format!("net{i}");
        out.push(DeviceConfig::Net {
            pci: pci.take(&id, n.transport)?,
            id,
            tap: n.tap.clone(),
            mac: n.mac.unwrap_or_else(|| config::default_mac(i)),
            rsc: n.rsc,
            slot: virtio_slot(i)?,
        });
    }
    for (j, d) in disks.iter().enumerate() {
        let path = d.path.display().to_string();
        let len = std::fs::metadata(&d.path)
            .map_err(|source| DeviceError::DiskSize {
                path: path.clone(),
                source,
            })?
            .len();
        let id = format!("blk{j}");
        out.push(DeviceConfig::Blk {
            pci: pci.take(&id, d.transport)?,
            id,
            path,
            readonly: d.readonly,
            bytes: len / 512 * 512,
            serial: d
                .id
                .clone()
                .unwrap_or_else(|| config::default_disk_id(&d.path)),
            slot: virtio_slot(nets.len() + j)?,
        });
    }
    if machine == Machine::Pci {
        check_acpi_irqs(&out)?;
    }
    Ok(out)
}

/// On a PCI machine (ACPI) the guest maps ISA IRQs 0-15 only, and 9 is
/// the SCI: a virtio-mmio device must have one of the others.
fn check_acpi_irqs(configs: &[DeviceConfig]) -> Result<(), DeviceError> {
    for (index, c) in configs.iter().enumerate() {
        if let Some(slot) = c.slot() {
            if slot.irq > 15 || slot.irq == u32::from(crate::boot::acpi::SCI_IRQ) {
                return Err(DeviceError::MmioIrqOnAcpi {
                    id: c.id().to_string(),
                    irq: slot.irq,
                    number: index + 1,
                });
            }
        }
    }
    Ok(())
}

/// The manifest of a VM: the serial console, the PCI host bridge of a PCI
/// machine, then `virtio` (see [`virtio_configs`]).
pub fn manifest(
    mem_bytes: u64,
    cpus: u32,
    machine: Machine,
    virtio: Vec<DeviceConfig>,
) -> Manifest {
    let mut devices = vec![DeviceConfig::Serial {
        id: SERIAL_ID.to_string(),
    }];
    if machine == Machine::Pci {
        devices.push(DeviceConfig::PciHost {
            id: PCI_ID.to_string(),
        });
    }
    devices.extend(virtio);
    Manifest {
        tandem_version: env!("CARGO_PKG_VERSION").to_string(),
        mem_bytes,
        vcpus: cpus,
        firmware: None,
        devices,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_mmio_gap_and_irq_range() {
        let s = virtio_slot(0).unwrap();
        assert_eq!((s.base, s.irq), (layout::MMIO_GAP_START, VIRTIO_IRQ_BASE));
        let s = virtio_slot(2).unwrap();
        assert_eq!(s.base, layout::MMIO_GAP_START + 2 * MMIO_WINDOW);
        let max = (VIRTIO_IRQ_LAST - VIRTIO_IRQ_BASE + 1) as usize;
        assert!(virtio_slot(max - 1).is_ok());
        assert!(matches!(virtio_slot(max), Err(DeviceError::TooMany(_))));
    }

    #[test]
    fn configs_name_nics_then_disks_in_order() {
        let disk = std::env::temp_dir().join(format!("tandem-dm-{}", std::process::id()));
        std::fs::write(&disk, vec![0u8; 4096 + 100]).unwrap();
        let nets = [
            config::parse_net("tap=t0").unwrap(),
            config::parse_net("tap=t1").unwrap(),
        ];
        let disks = [config::parse_disk(&format!("path={}", disk.display())).unwrap()];
        let c = virtio_configs(&nets, &disks, Machine::Legacy).unwrap();
        let ids: Vec<&str> = c.iter().map(|d| d.id()).collect();
        assert_eq!(ids, ["net0", "net1", "blk0"]);
        assert!(matches!(c[2], DeviceConfig::Blk { bytes: 4096, .. }));
        assert_eq!(c[2].slot().unwrap().irq, VIRTIO_IRQ_BASE + 2);
        // A PCI machine: PCI functions 1, 2, ... unless transport=mmio.
        let mut disks = disks;
        let c = virtio_configs(&nets, &disks, Machine::Pci).unwrap();
        let pci: Vec<Option<u8>> = c.iter().map(DeviceConfig::pci_slot).collect();
        assert_eq!(pci, [Some(1), Some(2), Some(3)]);
        assert!(c[0].slot().is_none(), "no virtio-mmio window");
        disks[0].transport = Some(VirtioTransport::Mmio);
        let c = virtio_configs(&nets, &disks, Machine::Pci).unwrap();
        assert_eq!(c[2].pci_slot(), None);
        assert!(c[2].slot().is_some());
        disks[0].transport = Some(VirtioTransport::Pci);
        let e = virtio_configs(&nets, &disks, Machine::Legacy).unwrap_err();
        assert_eq!(
            e.to_string(),
            "blk0: transport=pci needs a PCI machine (--machine pci)"
        );
        // On a PCI machine, a virtio-mmio device that would get IRQ 9 (the
        // SCI): the fifth device.
        let nets: Vec<_> = (0..4)
            .map(|i| config::parse_net(&format!("tap=t{i}")).unwrap())
            .collect();
        disks[0].transport = Some(VirtioTransport::Mmio);
        let e = virtio_configs(&nets, &disks, Machine::Pci).unwrap_err();
        assert!(e.to_string().starts_with("blk0: on a PCI machine"), "{e}");
        assert!(e.to_string().contains("IRQ 9 (it is device 5 of"), "{e}");
        assert!(virtio_configs(&nets, &disks, Machine::Legacy).is_ok());
        std::fs::remove_file(&disk).unwrap();
    }
}

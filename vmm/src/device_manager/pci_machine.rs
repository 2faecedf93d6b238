//! What a PCI machine adds to the buses: PCI bus 0 (ports 0xCF8/0xCFC,
//! the BAR windows (0xE000_0000 up, where tandem places BARs and its ACPI
//! tables say they are; 2 GiB up to the gap, where OVMF places them) and
//! ECAM on the MMIO bus), the ACPI PM1a block, and
//! PIIX4's power-management function at 00:01.3 (its I/O block, with the
//! PM timer, wherever the guest puts it).
//!
//! Run once on the VMM thread while [`super::DeviceManager`] builds the
//! buses; it must never run on a legacy machine (its guest has no ACPI
//! tables naming these).

use std::sync::{Arc, Mutex};

use devices::acpi_pm::{AcpiPm, ACPI_PM_PORT, ACPI_PM_PORTS};
use devices::pci::{
    PciBus, PciEcam, PciWindow, ECAM_BUS_BYTES, PCI_CONFIG_PORT, PCI_CONFIG_PORTS, PM_FUNCTION,
};
use devices::piix4_pm::Piix4Pm;
use devices::Bus;

use super::{AcpiPmPort, DeviceError, PciPort};
use crate::boot::layout;
use crate::vstate::exit::{ExitSignal, VmExit};

/// Adds a PCI machine's PCI bus 0 (at 0xCF8, its BAR window and ECAM)
/// and ACPI PM1a block to the buses. The PM1a block's S5 write powers the
/// VM off, so the console's power-off line becomes a fallback.
pub(super) fn attach(
    pio: &mut Bus,
    mmio: &mut Bus,
    exit: &Arc<ExitSignal>,
) -> Result<(PciPort, AcpiPmPort), DeviceError> {
    let bus = Arc::new(Mutex::new(PciBus::new()));
    pio.insert(bus.clone(), PCI_CONFIG_PORT, PCI_CONFIG_PORTS)?;
    exit.expect_acpi_power_off();
    let on_power_off = exit.clone();
    let pm = Arc::new(Mutex::new(AcpiPm::new(Box::new(move || {
        log::info!("the guest powered off through ACPI (S5)");
        on_power_off.signal(VmExit::PowerOff);
    }))));
    pio.insert(pm.clone(), ACPI_PM_PORT, ACPI_PM_PORTS)?;
    let pm_function = Arc::new(Mutex::new(Piix4Pm::new(pm.clone())));
    let (slot, function) = PM_FUNCTION;
    devices::sync::lock(&bus)
        .add_function(slot, function, pm_function.clone())
        .map_err(|source| DeviceError::PciSlot {
            id: "PIIX4 PM (00:01.3)".into(),
            source,
        })?;
    pio.insert_movable(pm_function);
    for (start, size) in [
        (layout::PCI_MMIO_START, layout::PCI_MMIO_SIZE),
        (layout::PCI_LOW_MMIO_START, layout::PCI_LOW_MMIO_SIZE),
    ] {
        let window = PciWindow::new(bus.clone(), start);
        mmio.insert(Arc::new(Mutex::new(window)), start, size)?;
    }
    mmio.insert(
        Arc::new(Mutex::new(PciEcam::new(bus.clone()))),
        layout::PCI_ECAM_START,
        ECAM_BUS_BYTES,
    )?;
    Ok((bus, pm))
}

//! What a VM's state is, memory aside ([`VmState`]: what a snapshot holds
//! and what migration and COLO carry), and the VM-wide part of it read
//! from and written to KVM (PICs, IOAPIC, PIT, guest clock).
//!
//! Runs on whichever thread drives the `Vm` (the VMM thread for the control
//! API). Never touches a vCPU: per-vCPU state is read and written on each
//! vCPU's own thread (`vcpus.rs`); this module only holds it.

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::VmFd;
use migration::devices::{
    DeviceState, FwCfgState, MmioTransportState, PciState, RtcState, VirtioPciState,
};
use migration::kvm::{KvmVcpuState, KvmVmState};
use migration::Manifest;

use crate::kvm_util::{kvm_op, KvmOp};

/// Everything a VM's state holds besides guest memory.
#[derive(Clone)]
pub struct VmState {
    /// What the VM is (memory size, vCPUs, devices).
    pub manifest: Manifest,
    /// The VM-wide KVM state; its clock is the guest clock at the pause.
    pub vm: KvmVmState,
    /// One per vCPU, in id order.
    pub vcpus: Vec<KvmVcpuState>,
    /// The serial UART.
    pub serial: vm_superio::serial::SerialState,
    /// The CMOS RTC (`None` in a snapshot written before tandem had one:
    /// the RTC then starts afresh on the host's clock).
    pub rtc: Option<RtcState>,
    /// PCI bus 0 (a PCI machine's only).
    pub pci: Option<PciState>,
    /// fw_cfg (`None` in a snapshot from before tandem had it: a fresh
    /// one, its signature selected).
    pub fw_cfg: Option<FwCfgState>,
    /// The virtio devices' states, by id, in manifest (bus) order.
    pub devices: Vec<(String, DeviceState)>,
}

impl VmState {
    /// The virtio transport a device state holds, and virtio-pci's part of
    /// it (`None` for a device without one).
    pub fn transport(
        state: &DeviceState,
    ) -> Option<(&MmioTransportState, Option<&VirtioPciState>)> {
        match state {
            DeviceState::VirtioNet { transport, pci, .. }
            | DeviceState::VirtioBlk { transport, pci, .. } => Some((transport, pci.as_ref())),
            DeviceState::Serial(_)
            | DeviceState::Rtc(_)
            | DeviceState::Pci(_)
            | DeviceState::FwCfg(_) => None,
        }
    }
}

/// Reads the VM-wide state; `clock` is the guest clock to record.
pub fn read_vm_wide(vm: &VmFd, clock: kvm_clock_data) -> Result<KvmVmState, KvmOp> {
    let chip = |id: u32| -> Result<kvm_irqchip, KvmOp> {
        let mut c = kvm_irqchip {
            chip_id: id,
            ..Default::default()
        };
        vm.get_irqchip(&mut c).map_err(kvm_op("read an irqchip"))?;
        Ok(c)
    };
    Ok(KvmVmState {
        pic_master: chip(KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: chip(KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: chip(KVM_IRQCHIP_IOAPIC)?,
        pit: vm.get_pit2().map_err(kvm_op("read the PIT"))?,
        clock,
    })
}

/// Sets the VM-wide state, in the order `migration::kvm` gives (PIT, guest
/// clock, PIC master, PIC slave, IOAPIC), before any vCPU runs on it.
pub fn apply_vm_wide(vm: &VmFd, s: &KvmVmState) -> Result<(), KvmOp> {
    vm.set_pit2(&s.pit).map_err(kvm_op("set the PIT"))?;
    vm.set_clock(&clock_to_set(&s.clock))
        .map_err(kvm_op("set the guest clock"))?;
    for chip in [&s.pic_master, &s.pic_slave, &s.ioapic] {
        vm.set_irqchip(chip).map_err(kvm_op("set an irqchip"))?;
    }
    Ok(())
}

/// The clock to give `KVM_SET_CLOCK` for a saved one: only its value (the
/// flags and host time of the read mean nothing to the set).
pub fn clock_to_set(saved: &kvm_clock_data) -> kvm_clock_data {
    kvm_clock_data {
        clock: saved.clock,
        ..Default::default()
    }
}

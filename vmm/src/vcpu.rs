//! vCPU threads: one per vCPU, each a `KVM_RUN` loop that sends port I/O to
//! the bus and reports how the VM ended. A vCPU thread never blocks on
//! anything but KVM_RUN and the lock of the device it is accessing.

use std::sync::Arc;

use devices::Bus;
use kvm_bindings::{kvm_msr_entry, Msrs};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::GuestMemoryMmap;

use crate::emulation;
use crate::exit::{ExitSignal, VmExit};
use crate::pause::Gate;

const KVM_SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const KVM_SYSTEM_EVENT_RESET: u32 = 2;
const MSR_IA32_TSC: u32 = 0x10;

/// A configured vCPU, ready to run on its own thread.
pub struct Vcpu {
    pub fd: VcpuFd,
    pub id: u8,
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub mem: GuestMemoryMmap,
    pub exit: Arc<ExitSignal>,
    /// Where this vCPU parks while the VM is paused.
    pub gate: Arc<Gate>,
}

impl Vcpu {
    /// Starts the vCPU's thread.
    pub fn spawn(self) -> std::io::Result<std::thread::JoinHandle<()>> {
        std::thread::Builder::new()
            .name(format!("vcpu{}", self.id))
            .spawn(move || {
                let exit = self.exit.clone();
                exit.signal(self.run());
            })
    }

    /// Parks at the gate with the guest's TSC held: it is read before and
    /// written back after, so a guest that keeps time with the TSC (Linux
    /// prefers it to kvmclock when the TSC is invariant) does not see the
    /// pause, just as kvmclock users do not (the clock is set back on resume).
    fn park(&mut self) {
        let tsc = self.read_tsc();
        self.gate.park_if_paused();
        if let Some(value) = tsc {
            let entry = kvm_msr_entry {
                index: MSR_IA32_TSC,
                data: value,
                ..Default::default()
            };
            match Msrs::from_entries(&[entry]) {
                Ok(msrs) => {
                    if !matches!(self.fd.set_msrs(&msrs), Ok(1)) {
                        log::warn!("vcpu{}: cannot set the TSC back after a pause", self.id);
                    }
                }
                Err(e) => log::warn!("vcpu{}: {e:?}", self.id),
            }
        }
    }

    fn read_tsc(&self) -> Option<u64> {
        let entry = kvm_msr_entry {
            index: MSR_IA32_TSC,
            ..Default::default()
        };
        let mut msrs = Msrs::from_entries(&[entry]).ok()?;
        match self.fd.get_msrs(&mut msrs) {
            Ok(1) => msrs.as_slice().first().map(|e| e.data),
            _ => {
                log::warn!("vcpu{}: cannot read the TSC before a pause", self.id);
                None
            }
        }
    }

    fn run(mut self) -> VmExit {
        loop {
            // A clean point: the last exit is fully handled. A pause kicks
            // KVM_RUN with a signal (EINTR) and the vCPU parks here.
            if self.gate.pause_requested() {
                self.park();
            }
            match self.fd.run() {
                Ok(VcpuExit::IoIn(port, data)) => {
                    if !self.pio.read(u64::from(port), data) {
                        data.fill(0xff);
                    }
                }
                Ok(VcpuExit::IoOut(port, data)) => {
                    self.pio.write(u64::from(port), data);
                }
                Ok(VcpuExit::MmioRead(addr, data)) => {
                    if !self.mmio.read(addr, data) {
                        log::debug!("vcpu{}: read of unclaimed MMIO {addr:#x}", self.id);
                        data.fill(0xff);
                    }
                }
                Ok(VcpuExit::MmioWrite(addr, data)) => {
                    if !self.mmio.write(addr, data) {
                        log::debug!("vcpu{}: write to unclaimed MMIO {addr:#x}", self.id);
                    }
                }
                Ok(VcpuExit::Hlt) | Ok(VcpuExit::Intr) | Ok(VcpuExit::IrqWindowOpen) => {}
                Ok(VcpuExit::Shutdown) => {
                    log::info!("vcpu{}: guest triple fault or shutdown: reset", self.id);
                    return VmExit::Reboot;
                }
                Ok(VcpuExit::SystemEvent(kind, _)) => match kind {
                    KVM_SYSTEM_EVENT_SHUTDOWN => return VmExit::PowerOff,
                    KVM_SYSTEM_EVENT_RESET => return VmExit::Reboot,
                    other => {
                        return VmExit::Fatal(format!(
                            "vCPU {}: unexpected system event {other}",
                            self.id
                        ))
                    }
                },
                Ok(VcpuExit::InternalError) => {
                    if let Err(e) = emulation::handle_internal_error(&mut self.fd, &self.mem) {
                        return VmExit::Fatal(format!("vCPU {}: {e}", self.id));
                    }
                }
                Ok(VcpuExit::FailEntry(reason, cpu)) => {
                    return VmExit::Fatal(format!(
                        "vCPU {}: KVM could not enter the guest (hardware reason {reason:#x} on host CPU {cpu})",
                        self.id
                    ))
                }
                Ok(other) => {
                    return VmExit::Fatal(format!(
                        "vCPU {}: unexpected exit from KVM: {other:?}",
                        self.id
                    ))
                }
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
                Err(e) => return VmExit::Fatal(format!("vCPU {}: KVM_RUN failed: {e}", self.id)),
            }
        }
    }
}

//! vCPU threads: one per vCPU, each a `KVM_RUN` loop that sends port I/O to
//! the bus and reports how the VM ended. A vCPU thread never blocks on
//! anything but KVM_RUN and the lock of the device it is accessing.

use std::sync::Arc;

use devices::Bus;
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::GuestMemoryMmap;

use crate::emulation;
use crate::exit::{ExitSignal, VmExit};
use crate::pause::Gate;

const KVM_SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const KVM_SYSTEM_EVENT_RESET: u32 = 2;

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

    fn run(mut self) -> VmExit {
        loop {
            // A clean point: the last exit is fully handled. A pause kicks
            // KVM_RUN with a signal (EINTR) and the vCPU parks here.
            self.gate.park_if_paused();
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

//! vCPU threads: one per vCPU, each a `KVM_RUN` loop that sends port I/O to
//! the bus and reports how the VM ended. A vCPU thread never blocks on
//! anything but KVM_RUN and the lock of the device it is accessing.
//!
//! At each clean point (the last exit fully handled, outside `KVM_RUN`) the
//! thread clears `immediate_exit`, parks if a pause is asked for, and takes
//! a profiler sample if one is wanted; every exit is counted by kind.

use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

use devices::Bus;
use devices::GuestMemoryMmap;
use kvm_ioctls::{VcpuExit, VcpuFd};
use migration::kvm::KvmVcpuState;

use crate::emulation;
use crate::exit::{ExitSignal, VmExit};
use crate::exit_counts::{ExitCounts, Kind};
use crate::pause::{self, Gate, ThreadKick};
use crate::profile::Profiler;
use crate::vcpu_state;

/// Work a parked vCPU thread does for the VMM thread (only it owns its fd).
pub enum VcpuRequest {
    /// Read the vCPU's whole state (MSRs from this index list) and send it back.
    Save {
        msr_indices: Arc<Vec<u32>>,
        reply: Sender<Result<KvmVcpuState, String>>,
    },
}

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
    /// Requests served while parked (see [`VcpuRequest`]).
    pub requests: Receiver<VcpuRequest>,
    /// How other threads kick this one out of `KVM_RUN`.
    pub kick: Arc<ThreadKick>,
    pub profiler: Arc<Profiler>,
    pub exits: Arc<ExitCounts>,
}

impl Vcpu {
    /// Starts the vCPU's thread.
    pub fn spawn(mut self) -> std::io::Result<std::thread::JoinHandle<()>> {
        std::thread::Builder::new()
            .name(format!("vcpu{}", self.id))
            .spawn(move || {
                let exit = self.exit.clone();
                let kick = self.kick.clone();
                kick.register_current();
                pause::set_thread_kvm_run(self.fd.get_kvm_run());
                let why = self.run();
                kick.unregister();
                pause::set_thread_kvm_run(std::ptr::null_mut());
                exit.signal(why);
            })
    }

    /// Serves what the VMM thread asked for; called parked, at the gate.
    fn serve(&mut self) {
        while let Ok(req) = self.requests.try_recv() {
            match req {
                VcpuRequest::Save { msr_indices, reply } => {
                    vcpu_state::complete_pending_exit(&mut self.fd);
                    let state = vcpu_state::capture(&self.fd, &msr_indices)
                        .map_err(|e| format!("vCPU {}: {e}", self.id));
                    let _ = reply.send(state);
                }
            }
        }
    }

    fn run(&mut self) -> VmExit {
        let gate = self.gate.clone();
        let (profiler, exits) = (self.profiler.clone(), self.exits.clone());
        let id = usize::from(self.id);
        loop {
            // A clean point: the last exit is fully handled. A kick (pause,
            // profiler) sets immediate_exit and makes KVM_RUN return EINTR;
            // it is cleared before the flags it was sent for are read, so
            // a kick sent after this point is never lost.
            self.fd.set_kvm_immediate_exit(0);
            gate.park_serving(|| self.serve());
            profiler.on_vcpu_exit(id, &self.fd, &self.mem);
            match self.fd.run() {
                Ok(VcpuExit::IoIn(port, data)) => {
                    exits.count_port(Kind::IoIn, port);
                    if !self.pio.read(u64::from(port), data) {
                        data.fill(0xff);
                    }
                }
                Ok(VcpuExit::IoOut(port, data)) => {
                    exits.count_port(Kind::IoOut, port);
                    self.pio.write(u64::from(port), data);
                }
                Ok(VcpuExit::MmioRead(addr, data)) => {
                    exits.count(Kind::MmioRead);
                    if !self.mmio.read(addr, data) {
                        log::debug!("vcpu{}: read of unclaimed MMIO {addr:#x}", self.id);
                        data.fill(0xff);
                    }
                }
                Ok(VcpuExit::MmioWrite(addr, data)) => {
                    exits.count(Kind::MmioWrite);
                    if !self.mmio.write(addr, data) {
                        log::debug!("vcpu{}: write to unclaimed MMIO {addr:#x}", self.id);
                    }
                }
                Ok(VcpuExit::Hlt) | Ok(VcpuExit::Intr) | Ok(VcpuExit::IrqWindowOpen) => {
                    exits.count(Kind::Other);
                }
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
                    exits.count(Kind::InternalError);
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
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    exits.count(Kind::Interrupted);
                }
                Err(e) => return VmExit::Fatal(format!("vCPU {}: KVM_RUN failed: {e}", self.id)),
            }
        }
    }
}

//! Builds a VM from a [`VmConfig`] and runs it until it ends: KVM VM with the
//! in-kernel irqchip and PIT, guest memory, the legacy devices, the loaded
//! kernel, and one thread per vCPU. The calling thread waits for the end.

use std::io;
use std::sync::{Arc, Mutex};

use devices::i8042::I8042;
use devices::serial::{Serial, COM1_IRQ, COM1_PORT, UART_PORTS};
use devices::Bus;
use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{Address, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::boot::{self, cpu, layout};
use crate::config::VmConfig;
use crate::console::{self, ConsoleOut};
use crate::cpuid;
use crate::exit::{ExitSignal, VmExit};
use crate::host::HostKind;
use crate::vcpu::Vcpu;

const I8042_PORT: u64 = 0x60;
const I8042_PORTS: u64 = 5;

/// Errors before the guest runs.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("cannot open /dev/kvm: {0}")]
    KvmOpen(String),
    #[error("KVM: cannot {what}: {err}")]
    Kvm {
        what: &'static str,
        err: kvm_ioctls::Error,
    },
    #[error("cannot allocate {0} MiB of guest memory: {1}")]
    Memory(u64, String),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error(transparent)]
    Cpu(#[from] cpu::CpuError),
    #[error(transparent)]
    Cpuid(#[from] cpuid::CpuidError),
    #[error("cannot set up devices: {0}")]
    Devices(String),
    #[error("cannot start a thread or eventfd: {0}")]
    Io(#[from] io::Error),
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |err| VmError::Kvm { what, err }
}

/// Opens /dev/kvm with a message that says what to do.
pub fn open_kvm() -> Result<Kvm, VmError> {
    Kvm::new().map_err(|e| {
        VmError::KvmOpen(match e.errno() {
            libc::ENOENT => {
                "no such device: this host has no KVM (load kvm_intel, kvm_amd or kvm_pvm)".into()
            }
            libc::EACCES | libc::EPERM => {
                "permission denied: run as root or add your user to the 'kvm' group".into()
            }
            _ => e.to_string(),
        })
    })
}

fn create_memory(vm: &VmFd, size: u64) -> Result<GuestMemoryMmap, VmError> {
    let ranges: Vec<(GuestAddress, usize)> = layout::ram_ranges(size)
        .into_iter()
        .map(|(b, l)| (GuestAddress(b), l as usize))
        .collect();
    let mem = GuestMemoryMmap::from_ranges(&ranges)
        .map_err(|e| VmError::Memory(size >> 20, e.to_string()))?;
    for (slot, region) in mem.iter().enumerate() {
        let host = mem
            .get_host_address(region.start_addr())
            .map_err(|e| VmError::Memory(size >> 20, e.to_string()))?;
        let r = kvm_userspace_memory_region {
            slot: slot as u32,
            flags: 0,
            guest_phys_addr: region.start_addr().raw_value(),
            memory_size: region.len(),
            userspace_addr: host as u64,
        };
        // SAFETY: the region is a live mapping owned by `mem`, which outlives
        // the VM (both live until the process exits), and it is not aliased
        // by another slot.
        unsafe { vm.set_user_memory_region(r) }.map_err(kvm_err("register guest memory"))?;
    }
    Ok(mem)
}

/// The command line the guest gets: the user's, then each parameter the
/// host needs that the user's line does not already have.
pub fn effective_cmdline(user: &str, host: HostKind) -> String {
    let have: Vec<&str> = user.split_whitespace().collect();
    let mut out: Vec<&str> = have.clone();
    for p in host.guest_params().split_whitespace() {
        if !have.contains(&p) {
            out.push(p);
        }
    }
    out.join(" ")
}

/// Runs the VM until it ends. Errors are for what fails before it runs.
/// The vCPU threads are not joined: the caller exits the process, which
/// ends them (they hold their own references to the VM and its memory).
pub fn run(cfg: &VmConfig) -> Result<VmExit, VmError> {
    let host = HostKind::detect();
    let kvm = open_kvm()?;
    let vm = kvm.create_vm().map_err(kvm_err("create a VM"))?;
    vm.set_tss_address(layout::KVM_TSS_ADDRESS)
        .map_err(kvm_err("set the TSS address"))?;
    vm.create_irq_chip()
        .map_err(kvm_err("create the in-kernel irqchip"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit)
        .map_err(kvm_err("create the in-kernel PIT"))?;

    let mem = create_memory(&vm, cfg.mem_bytes)?;
    let cmdline = effective_cmdline(&cfg.cmdline, host);
    log::info!("host: {host:?}; kernel command line: {cmdline}");
    let info = boot::load(
        &mem,
        &boot::BootSpec {
            kernel: &cfg.kernel,
            initrd: cfg.initrd.as_deref(),
            cmdline: &cmdline,
            num_cpus: cfg.cpus,
        },
    )?;

    let exit = Arc::new(ExitSignal::new()?);
    let serial_irq = EventFd::new(libc::EFD_NONBLOCK)?;
    vm.register_irqfd(&serial_irq, COM1_IRQ)
        .map_err(kvm_err("register the serial interrupt"))?;
    let serial = Arc::new(Mutex::new(Serial::new(
        serial_irq,
        ConsoleOut::new(io::stdout(), exit.clone()),
    )));
    let mut pio = Bus::new();
    pio.insert(serial.clone(), COM1_PORT, UART_PORTS)
        .map_err(|e| VmError::Devices(e.to_string()))?;
    pio.insert(
        Arc::new(Mutex::new(I8042::new(exit.reset_evt()?))),
        I8042_PORT,
        I8042_PORTS,
    )
    .map_err(|e| VmError::Devices(e.to_string()))?;
    let pio = Arc::new(pio);

    let base_cpuid = cpuid::supported(&kvm)?;
    let mut vcpus = Vec::with_capacity(cfg.cpus as usize);
    for id in 0..cfg.cpus {
        let fd = vm
            .create_vcpu(u64::from(id))
            .map_err(kvm_err("create a vCPU"))?;
        fd.set_cpuid2(&cpuid::for_vcpu(&base_cpuid, id, cfg.cpus, host))
            .map_err(kvm_err("set CPUID"))?;
        cpu::setup_msrs(&fd)?;
        if id == 0 {
            cpu::setup_boot_vcpu(&fd, &mem, info.entry)?;
        }
        cpu::setup_lapic(&fd)?;
        vcpus.push(Vcpu {
            fd,
            id,
            pio: pio.clone(),
            mem: mem.clone(),
            exit: exit.clone(),
        });
    }

    let raw = console::enter_raw_mode();
    console::spawn_input(serial, exit.clone(), raw)?;
    for v in vcpus {
        v.spawn()?;
    }
    let why = exit.wait();
    console::restore_terminal();
    log::info!("{}", crate::emulation::summary());
    Ok(why)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_params_are_appended_only_on_emulated_hosts() {
        assert_eq!(
            effective_cmdline(" console=ttyS0 ", HostKind::Hardware),
            "console=ttyS0"
        );
        let e = effective_cmdline("console=ttyS0", HostKind::Emulated);
        assert!(e.starts_with("console=ttyS0 noxsave"), "{e}");
        assert!(e.contains("tandem_syscall_fixup"));
        assert_eq!(
            effective_cmdline(&e, HostKind::Emulated),
            e,
            "nothing appended twice"
        );
    }
}

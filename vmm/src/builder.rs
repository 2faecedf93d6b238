//! Builds a [`Vm`] from a [`VmConfig`]: the KVM VM with the in-kernel
//! irqchip and PIT, guest memory, the devices (`device_manager`), the
//! kernel (on a boot), one thread per vCPU and the device thread, and the
//! control socket. Every thread starts stopped; [`Vm::run`] lets them go.
//!
//! A VM starts one of three ways ([`Start`]): booted (kernel loaded, boot
//! vCPU set up for the kernel's entry), restored from a snapshot already
//! verified by [`snapshot::load`] (its state applied to the new, paused VM
//! through the same [`VmHandle::apply_state`] a running VM takes), or
//! incoming (built paused and left so: its memory and state arrive later).
//!
//! Runs on the calling thread (the VMM thread); nothing here waits on the
//! guest.

use std::sync::Arc;

use devices::GuestMemoryMmap;
use kvm_bindings::{kvm_pit_config, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VmFd};

use crate::api::ApiServer;
use crate::boot::{self, cpu, layout};
use crate::config::{Machine, VmConfig};
use crate::device_manager::{self, DeviceManager, Devices};
use crate::device_thread::DeviceThread;
use crate::host_emu::cpuid;
use crate::host_emu::HostKind;
use crate::kvm_util::kvm_op;
use crate::pause::{self, ThreadKick};
use crate::profile::Profiler;
use crate::snapshot::{PageCheck, Restore};
use crate::vm::{Core, CoreParts, VmHandle};
use crate::vm_loop::{Vm, VmError};
use crate::vstate::exit::{ExitSignal, VmExit};
use crate::vstate::exit_counts::ExitCounts;
use crate::vstate::memory::GuestRam;
use crate::vstate::vcpu::Vcpu;
use crate::vstate::vcpu_state;
use crate::vstate::vcpus::Vcpus;

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

/// What a kernel that tandem boots directly on the legacy machine is told
/// of that machine, after the host's parameters: it has no ACPI tables
/// (its CPUs and IOAPIC are in the MP table) and no PCI (its virtio
/// devices are on virtio-mmio, announced on the command line), so the
/// kernel does not look for them. Looking, it logs errors: "ACPI BIOS
/// Error (bug): A valid RSDP was not found" and "PCI: Fatal: No config
/// space access function found" (the guest kernel's patch
/// `resources/kernel/0004-*` makes the latter an info line under
/// `pci=off`). A firmware boot gets none (the firmware writes its own
/// tables), nor does the PCI machine; a user's own `acpi=` or `pci=` wins.
/// Only new boots get them: a restored or migrated guest keeps the command
/// line it booted with.
fn machine_params(user: &str, machine: Machine) -> String {
    if machine != Machine::Legacy {
        return String::new();
    }
    ["acpi=off", "pci=off"]
        .iter()
        .filter(|p| {
            let key = p.split('=').next().unwrap_or(p);
            !user
                .split_whitespace()
                .any(|u| u.split('=').next() == Some(key))
        })
        .map(|p| format!(" {p}"))
        .collect()
}

/// How the guest starts.
pub enum Start {
    /// Load the kernel and boot it.
    Boot,
    /// Continue a saved VM (verified and converted by [`snapshot::load`]).
    Restore(Box<Restore>),
    /// Stay paused: memory and state arrive later (a migration's target).
    Incoming,
    /// As `Incoming`, for a COLO secondary: its NICs start detached from
    /// their taps (attached at failover).
    Secondary,
}

impl Start {
    /// Whether the VM waits, paused and empty, for a guest to arrive.
    fn waits(&self) -> bool {
        matches!(self, Start::Incoming | Start::Secondary)
    }
}

/// Boots the VM of `cfg` and runs it until it ends.
pub fn run(cfg: &VmConfig) -> Result<crate::vstate::exit::VmExit, VmError> {
    build(cfg, Start::Boot)?.run()
}

/// Builds the VM of `cfg`, every thread started and stopped. On a restore,
/// `cfg.kernel`, `initrd` and `cmdline` are not used, and the devices must
/// be the snapshot's (checked by [`snapshot::load`]).
pub fn build(cfg: &VmConfig, start: Start) -> Result<Vm, VmError> {
    // A bad TLS file is refused now, not at the first migration.
    let transport = crate::streams::Transport::from_config(&cfg.streams).map_err(VmError::Tls)?;
    let host = HostKind::detect();
    let kvm = open_kvm()?;
    let msr_indices = Arc::new(vcpu_state::msr_index_list(&kvm).map_err(VmError::SaveSetup)?);
    if !matches!(start, Start::Boot) {
        vcpu_state::check_xsave_size(&kvm).map_err(VmError::SaveSetup)?;
    }
    let fd = create_vm(&kvm)?;
    let ram = Arc::new(GuestRam::new(fd.clone(), cfg.mem_bytes)?);
    let exit = Arc::new(ExitSignal::new()?);
    // The devices: legacy ports, then the virtio devices (NICs, then disks:
    // the guest probes them in command-line order, so the first --disk is
    // vda), each announced on the command line.
    let virtio_configs = device_manager::virtio_configs(&cfg.nets, &cfg.disks, cfg.machine)?;
    let mut manifest = device_manager::manifest(
        cfg.mem_bytes,
        u32::from(cfg.cpus),
        cfg.machine,
        virtio_configs.clone(),
    );
    let mut dm = DeviceManager::new(fd.clone(), ram.mem().clone(), cfg.machine, cfg.cpus, &exit)?;
    dm.defer_disk_locks = start.waits();
    dm.secondary = matches!(start, Start::Secondary);
    if dm.secondary {
        dm.wrap_disk = Some(crate::colo::replica::wrap);
    }
    dm.add_all(&cfg.nets, &cfg.disks, virtio_configs)?;
    let announce = dm.announcement();
    let (devices, subscribers) = dm.finish();
    let boot = boot_vcpu(cfg, &start, host, &fd, &announce, &ram, &devices)?;
    manifest.firmware = boot.rom.as_ref().map(|f| f.id().clone());
    let firmware = boot.rom.clone();
    let (vcpus, profiler, exits) = spawn_vcpus(&kvm, &fd, cfg, host, boot, &devices, &exit)?;
    let device_thread = DeviceThread::spawn(subscribers)?;
    device_thread.pause().map_err(VmError::DevicePause)?;
    // Bound before the guest starts, so a bad path is a start-up error.
    let api = match &cfg.api_sock {
        Some(path) => Some(ApiServer::bind(path, Box::new(crate::control::NoControl))?),
        None => None,
    };
    let handle = VmHandle(Arc::new(Core::paused(CoreParts {
        fd,
        ram,
        vcpus,
        devices,
        device_thread,
        exit,
        exits,
        profiler,
        msr_indices,
        manifest,
        firmware,
    })));
    let vm = Vm {
        handle,
        api,
        metrics: cfg.metrics.clone(),
        profile: cfg.profile.clone(),
        start_paused: start.waits(),
        transport: Arc::new(transport),
        colo: crate::colo::Slot::default(),
    };
    match start {
        Start::Restore(r) => restore(&vm.handle, *r)?,
        Start::Incoming | Start::Secondary => vm
            .handle
            .0
            .empty
            .store(true, std::sync::atomic::Ordering::SeqCst),
        Start::Boot => {}
    }
    Ok(vm)
}

/// The firmware image mapped (a restored or incoming VM maps the one its
/// state was saved with) and, on a boot, the kernel loaded or offered to
/// the firmware: where the boot vCPU starts.
fn boot_vcpu(
    cfg: &VmConfig,
    start: &Start,
    host: HostKind,
    fd: &Arc<VmFd>,
    announce: &str,
    ram: &GuestRam,
    devices: &Devices,
) -> Result<BootVcpu, VmError> {
    // A restored or incoming VM maps the image its state was saved with
    // (the manifests' check compares them).
    let firmware = match &cfg.firmware {
        Some(path) => Some(Arc::new(boot::firmware::load(fd, path)?)),
        None => None,
    };
    // A firmware boot given a kernel offers it through fw_cfg, as QEMU's
    // -kernel does for its firmware.
    if matches!(start, Start::Boot) && firmware.is_some() && !cfg.kernel.as_os_str().is_empty() {
        let cmdline = format!("{}{announce}", effective_cmdline(&cfg.cmdline, host));
        log::info!(
            "kernel for the firmware to load: {}; command line: {cmdline}",
            cfg.kernel.display()
        );
        let blobs = boot::fw_kernel::blobs(&cfg.kernel, cfg.initrd.as_deref(), &cmdline)?;
        devices::sync::lock(&devices.fw_cfg).set_kernel(blobs);
    }
    // A firmware boot leaves the boot vCPU at the reset vector.
    let entry = match start {
        Start::Boot if firmware.is_none() => Some(load_kernel(cfg, host, announce, ram.mem())?),
        _ => None,
    };
    Ok(BootVcpu {
        entry,
        rom: firmware,
    })
}

/// The KVM VM with its TSS, in-kernel irqchip and PIT.
fn create_vm(kvm: &Kvm) -> Result<Arc<VmFd>, VmError> {
    let vm = kvm.create_vm().map_err(kvm_op("create a VM"))?;
    vm.set_tss_address(layout::KVM_TSS_ADDRESS)
        .map_err(kvm_op("set the TSS address"))?;
    vm.create_irq_chip()
        .map_err(kvm_op("create the in-kernel irqchip"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit)
        .map_err(kvm_op("create the in-kernel PIT"))?;
    Ok(Arc::new(vm))
}

/// Loads the kernel (and initrd) with the effective command line and the
/// devices' announcement; returns the kernel's entry point.
fn load_kernel(
    cfg: &VmConfig,
    host: HostKind,
    announce: &str,
    mem: &GuestMemoryMmap,
) -> Result<u64, VmError> {
    let cmdline = format!(
        "{}{}{announce}",
        effective_cmdline(&cfg.cmdline, host),
        machine_params(&cfg.cmdline, cfg.machine)
    );
    log::info!("host: {host:?}; kernel command line: {cmdline}");
    let info = boot::load(
        mem,
        &boot::BootSpec {
            kernel: &cfg.kernel,
            initrd: cfg.initrd.as_deref(),
            cmdline: &cmdline,
            num_cpus: cfg.cpus,
            acpi: cfg.machine == Machine::Pci,
        },
    )?;
    Ok(info.entry)
}

/// Where the vCPUs start: the kernel's entry point (a kernel boot), or
/// KVM's reset state with the firmware image to read instructions from.
struct BootVcpu {
    entry: Option<u64>,
    rom: Option<Arc<boot::firmware::Firmware>>,
}

/// Creates and sets up every vCPU (CPUID, MSRs, LAPIC; the boot vCPU at
/// `boot.entry` on a kernel boot) and starts its thread, stopped.
fn spawn_vcpus(
    kvm: &Kvm,
    vm: &VmFd,
    cfg: &VmConfig,
    host: HostKind,
    boot: BootVcpu,
    devices: &Devices,
    exit: &Arc<ExitSignal>,
) -> Result<(Vcpus, Arc<Profiler>, Arc<ExitCounts>), VmError> {
    let base_cpuid = cpuid::supported(kvm)?;
    let kicks: Vec<Arc<ThreadKick>> = (0..cfg.cpus).map(|_| Arc::default()).collect();
    let profiler = Arc::new(Profiler::new(kicks.clone()));
    let exits = Arc::new(ExitCounts::default());
    pause::install_kick_handler().map_err(VmError::Kick)?;
    // The emulator's gate checks the host itself, not TANDEM_HOST_KIND.
    let emulator_host = HostKind::probe();
    let mut handles = Vec::with_capacity(usize::from(cfg.cpus));
    for (id, kick) in (0..cfg.cpus).zip(kicks) {
        let fd = vm
            .create_vcpu(u64::from(id))
            .map_err(kvm_op("create a vCPU"))?;
        fd.set_cpuid2(&cpuid::for_vcpu(&base_cpuid, id, cfg.cpus, host))
            .map_err(kvm_op("set CPUID"))?;
        cpu::setup_msrs(&fd)?;
        if let (0, Some(entry)) = (id, boot.entry) {
            cpu::setup_boot_vcpu(&fd, &devices.mem, entry)?;
        }
        cpu::setup_lapic(&fd)?;
        let vcpu = Vcpu {
            fd,
            id,
            pio: devices.pio.clone(),
            mmio: devices.mmio.clone(),
            mem: devices.mem.clone(),
            rom: boot.rom.clone(),
            host: emulator_host,
            exit: exit.clone(),
            kick,
            profiler: profiler.clone(),
            exits: exits.clone(),
        };
        handles.push(vcpu.spawn()?);
    }
    Ok((Vcpus::new(handles), profiler, exits))
}

/// Puts a verified snapshot into the new, paused VM: every device state is
/// checked before memory is filled (a refused file starts nothing), then
/// the state is applied as to any paused VM. Pages mapped from the file
/// have their CRC checked by a thread of their own while the guest runs; a
/// damaged file stops the VM.
fn restore(vm: &VmHandle, mut r: Restore) -> Result<(), VmError> {
    vm.check_state(&r.state).map_err(VmError::Restore)?;
    let t = std::time::Instant::now();
    let (stats, placed) = r.place_memory(vm.memory())?;
    let how = match placed {
        crate::snapshot::Placed::Mapped => "mapped from the file",
        crate::snapshot::Placed::Copied => "copied",
    };
    log::info!(
        "restore: {} pages of guest memory in {} runs, {how} in {:.1} ms",
        stats.pages,
        stats.runs,
        t.elapsed().as_secs_f64() * 1000.0
    );
    vm.apply_state(&r.state).map_err(VmError::Restore)?;
    if placed == crate::snapshot::Placed::Mapped {
        spawn_page_check(r.page_check(), vm.exit().clone())?;
    }
    Ok(())
}

/// Checks the mapped pages' CRC on a thread of its own; a mismatch ends
/// the VM (the guest has run on memory that is not the snapshot's).
fn spawn_page_check(check: PageCheck, exit: Arc<ExitSignal>) -> Result<(), VmError> {
    std::thread::Builder::new()
        .name("snapshot-check".into())
        .spawn(move || {
            crate::sandbox::confine(crate::sandbox::Kind::Helper);
            let path = check.path().to_string();
            match check.run() {
                Ok(ms) => log::info!("restore: the pages of {path} match their CRC ({ms:.0} ms)"),
                Err(e) => exit.signal(VmExit::Fatal(format!(
                    "{e}: the guest ran on memory that is not the snapshot's \
                     (--restore-memory copy checks before the guest runs)"
                ))),
            }
        })?;
    Ok(())
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

    #[test]
    fn the_legacy_machine_tells_its_kernel_it_has_no_acpi_and_no_pci() {
        let user = "console=ttyS0 quiet";
        assert_eq!(machine_params(user, Machine::Legacy), " acpi=off pci=off");
        assert_eq!(machine_params(user, Machine::Pci), "");
        // The user's own choice stays the only one.
        assert_eq!(
            machine_params("console=ttyS0 acpi=force", Machine::Legacy),
            " pci=off"
        );
        assert_eq!(machine_params("pci=conf1 acpi=off", Machine::Legacy), "");
    }
}

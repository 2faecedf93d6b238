//! Builds a VM from a [`VmConfig`] and runs it until it ends: KVM VM with the
//! in-kernel irqchip and PIT, guest memory, the legacy devices, the loaded
//! kernel, and one thread per vCPU. The calling thread waits for the end.
//!
//! A VM starts one of two ways ([`Start`]): booted (kernel loaded, boot vCPU
//! set up for the kernel's entry) or restored from a snapshot already
//! verified by [`snapshot::load`] (memory, VM state, vCPU and serial state
//! from the file); everything else is built the same way.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use kvm_bindings::{kvm_pit_config, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::Kvm;
use vmm_sys_util::eventfd::EventFd;

use crate::api::ApiServer;
use crate::boot::{self, cpu, layout};
use crate::config::VmConfig;
use crate::console;
use crate::control::{ProfileParts, SnapshotParts, VmControl};
use crate::cpuid;
use crate::device_manager::{self, metrics_json, DeviceManager, Devices};
use crate::exit::{ExitSignal, VmExit};
use crate::exit_counts::ExitCounts;
use crate::host::HostKind;
use crate::kvm_util::{kvm_op, KvmOp};
use crate::memory::{GuestRam, MemoryError};
use crate::pause::{self, Gate, ThreadKick};
use crate::profile::{ProfileError, Profiler};
use crate::snapshot::{self, Restore};
use crate::vcpu::{Vcpu, VcpuError};
use crate::vcpu_state::{self, VcpuStateError};
use crate::vcpus::Vcpus;

const METRICS_PERIOD: Duration = Duration::from_secs(1);
/// How long each vCPU thread may take to end once the VM has ended.
const VCPU_FINISH_TIMEOUT: Duration = Duration::from_secs(1);
/// How often the device thread looks at its pause gate when idle.
const DEVICE_TICK_MS: i32 = 100;

type Subscribers = EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>;

/// Errors before the guest runs.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("cannot open /dev/kvm: {0}")]
    KvmOpen(String),
    #[error(transparent)]
    Kvm(#[from] KvmOp),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Device(#[from] device_manager::DeviceError),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error(transparent)]
    Cpu(#[from] cpu::CpuError),
    #[error(transparent)]
    Cpuid(#[from] cpuid::CpuidError),
    #[error("cannot set up devices: {0}")]
    Devices(String),
    #[error(transparent)]
    Api(#[from] crate::api::ApiError),
    #[error("--net tap={tap}: {err}")]
    Net { tap: String, err: String },
    #[error("--disk: {0}")]
    Disk(String),
    #[error("too many devices: at most {0} virtio devices")]
    TooManyDevices(u32),
    #[error("cannot write metrics to {path}: {err}")]
    Metrics { path: String, err: String },
    #[error("cannot start a thread or eventfd: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Snapshot(#[from] snapshot::SnapshotError),
    #[error("restoring vCPU {id}: {err}")]
    VcpuState { id: u8, err: VcpuStateError },
    #[error(transparent)]
    SaveSetup(VcpuStateError),
    #[error("restoring the serial port: {0}")]
    Serial(io::Error),
    #[error("restoring device {id}: {err}")]
    DeviceState { id: String, err: String },
    #[error("--guest-profile: {0}")]
    Profile(#[from] ProfileError),
}

/// How the guest starts.
pub enum Start {
    /// Load the kernel and boot it.
    Boot,
    /// Continue a saved VM (verified and converted by [`snapshot::load`]).
    Restore(Box<Restore>),
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

/// Boots the VM and runs it until it ends.
pub fn run(cfg: &VmConfig) -> Result<VmExit, VmError> {
    run_from(cfg, Start::Boot)
}

/// Runs the VM from `start` until it ends. Errors are for what fails before
/// it runs. The vCPU threads are not joined: the caller exits the process,
/// which ends them (they hold their own references to the VM and its memory).
/// On a restore, `cfg.kernel`, `initrd` and `cmdline` are not used, and
/// the devices must be the snapshot's (checked by [`snapshot::load`]).
pub fn run_from(cfg: &VmConfig, mut start: Start) -> Result<VmExit, VmError> {
    let host = HostKind::detect();
    let kvm = open_kvm()?;
    let msr_indices = Arc::new(vcpu_state::msr_index_list(&kvm).map_err(VmError::SaveSetup)?);
    if matches!(start, Start::Restore(_)) {
        vcpu_state::check_xsave_size(&kvm).map_err(VmError::SaveSetup)?;
    }
    let vm = Arc::new(kvm.create_vm().map_err(kvm_op("create a VM"))?);
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

    let ram = Arc::new(GuestRam::new(vm.clone(), cfg.mem_bytes)?);
    let mem = ram.mem().clone();
    let exit = Arc::new(ExitSignal::new()?);
    // The devices: legacy ports, then the virtio devices (NICs, then disks:
    // the guest probes them in command-line order, so the first --disk is
    // vda), each announced on the command line. Their handlers run on the
    // device thread's event loop; the calling thread keeps the control API,
    // metrics and the end of the VM.
    let virtio_configs = device_manager::virtio_configs(&cfg.nets, &cfg.disks)?;
    let manifest = snapshot::manifest(cfg.mem_bytes, u32::from(cfg.cpus), virtio_configs.clone());
    let mut dm = DeviceManager::new(vm.clone(), mem.clone(), &exit)?;
    dm.add_all(&cfg.nets, &cfg.disks, virtio_configs)?;
    let announce = dm.announcement();
    let devs = dm.finish();

    let entry = match &mut start {
        Start::Boot => {
            let cmdline = format!("{}{announce}", effective_cmdline(&cfg.cmdline, host));
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
            Some(info.entry)
        }
        Start::Restore(r) => {
            // Every device state is checked before memory is filled: a
            // refused file starts nothing.
            for (slot, state) in devs.virtio.iter().zip(&r.transports) {
                slot.check_transport(state)?;
            }
            let stats = r.fill_memory(&mem)?;
            log::info!("restore: {} pages of guest memory", stats.pages);
            r.apply_vm_state(&vm)?;
            // Each transport as it was: a running device restarts on its
            // queues (the tap's offloads set again), before any vCPU runs.
            for (slot, state) in devs.virtio.iter().zip(&r.transports) {
                slot.restore_transport(state)?;
            }
            devs.restore_serial(&r.serial)?;
            None
        }
    };
    let Devices {
        pio,
        mmio,
        subscribers: mut em,
        virtio,
        serial,
        ..
    } = devs;

    let base_cpuid = cpuid::supported(&kvm)?;
    let mut vcpus = Vec::with_capacity(cfg.cpus as usize);
    let kicks: Vec<Arc<ThreadKick>> = (0..cfg.cpus).map(|_| Arc::default()).collect();
    let profiler = Arc::new(Profiler::new(kicks.clone()));
    let exits = Arc::new(ExitCounts::default());
    for id in 0..cfg.cpus {
        let fd = vm
            .create_vcpu(u64::from(id))
            .map_err(kvm_op("create a vCPU"))?;
        fd.set_cpuid2(&cpuid::for_vcpu(&base_cpuid, id, cfg.cpus, host))
            .map_err(kvm_op("set CPUID"))?;
        cpu::setup_msrs(&fd)?;
        if let (0, Some(entry)) = (id, entry) {
            cpu::setup_boot_vcpu(&fd, &mem, entry)?;
        }
        cpu::setup_lapic(&fd)?;
        if let Start::Restore(r) = &start {
            if let Some(saved) = r.vcpus.get(usize::from(id)) {
                vcpu_state::apply(&fd, saved).map_err(|err| VmError::VcpuState { id, err })?;
            }
        }
        vcpus.push(Vcpu {
            fd,
            id,
            pio: pio.clone(),
            mmio: mmio.clone(),
            mem: mem.clone(),
            exit: exit.clone(),
            kick: kicks[usize::from(id)].clone(),
            profiler: profiler.clone(),
            exits: exits.clone(),
        });
    }

    let ended = Arc::new(AtomicBool::new(false));
    let mut main_em =
        Subscribers::new().map_err(|e| VmError::Devices(format!("event loop: {e:?}")))?;
    main_em.add_subscriber(Arc::new(Mutex::new(ExitWatcher {
        fd: exit.as_raw_fd(),
        ended: ended.clone(),
    })));
    let metrics = cfg.metrics.as_deref();
    if let Some(path) = metrics {
        write_metrics(path, &metrics_json(&virtio, &exits))?;
    }
    // Bound before the guest starts, so a bad path is a start-up error.
    let api = match &cfg.api_sock {
        Some(path) => Some(ApiServer::bind(path, Box::new(NoControl))?),
        None => None,
    };

    let device_gate = Arc::new(Gate::default());
    let device_kick = EventFd::new(libc::EFD_NONBLOCK)?;
    em.add_subscriber(Arc::new(Mutex::new(Kick(device_kick.try_clone()?))));
    spawn_device_thread(em, device_gate.clone(), ended.clone())?;

    pause::install_kick_handler().map_err(|e| VmError::Devices(e.to_string()))?;
    let raw = console::enter_raw_mode();
    let serial_for_api = serial.clone();
    console::spawn_input(serial, exit.clone(), raw)?;
    if cfg.profile.file.is_some() {
        profiler.start(cfg.profile.hz)?;
    }
    // Each thread starts paused; all run once every one has started.
    let handles = vcpus
        .into_iter()
        .map(Vcpu::spawn)
        .collect::<Result<Vec<_>, _>>()?;
    let vcpus = Arc::new(Mutex::new(Vcpus::new(handles)));
    devices::bus::lock(&vcpus).resume()?;
    if let Some(mut api) = api {
        let (devices, exits) = (virtio.clone(), exits.clone());
        let mut control = VmControl::new(
            vm.clone(),
            vcpus.clone(),
            device_gate,
            device_kick,
            exit.clone(),
            Box::new(move || metrics_json(&devices, &exits)),
            cfg.mem_bytes,
            cfg.cpus,
        );
        let serial = serial_for_api;
        control.snapshot = Some(SnapshotParts {
            mem: mem.clone(),
            serial: Box::new(move || devices::bus::lock(&serial).state()),
            msr_indices,
            manifest,
            devices: virtio.clone(),
        });
        control.ram = Some(ram.clone());
        control.profile = Some(ProfileParts {
            profiler: profiler.clone(),
            symbols: cfg.profile.symbols.clone(),
        });
        api.set_control(Box::new(control));
        main_em.add_subscriber(Arc::new(Mutex::new(api)));
    }
    // The VMM thread: control requests and metrics until the VM ends.
    let mut last_metrics = Instant::now();
    while !ended.load(Ordering::SeqCst) {
        if let Err(e) = main_em.run_with_timeout(METRICS_PERIOD.as_millis() as i32) {
            log::error!("event loop: {e:?}");
        }
        if let Some(path) = metrics {
            if last_metrics.elapsed() >= METRICS_PERIOD {
                last_metrics = Instant::now();
                if let Err(e) = write_metrics(path, &metrics_json(&virtio, &exits)) {
                    log::warn!("{e}");
                }
            }
        }
    }
    let why = exit.reason();
    devices::bus::lock(&vcpus).finish(VCPU_FINISH_TIMEOUT);
    console::restore_terminal();
    if let Some(path) = metrics {
        if let Err(e) = write_metrics(path, &metrics_json(&virtio, &exits)) {
            log::warn!("{e}");
        }
    }
    if let Some(file) = &cfg.profile.file {
        write_profile(&profiler, file, cfg.profile.symbols.as_deref());
    }
    log::info!("{}", crate::emulation::summary());
    Ok(why)
}

fn spawn_device_thread(
    mut em: Subscribers,
    gate: Arc<Gate>,
    ended: Arc<AtomicBool>,
) -> Result<(), VmError> {
    std::thread::Builder::new()
        .name("devices".into())
        .spawn(move || {
            while !ended.load(Ordering::SeqCst) {
                gate.park_if_paused();
                if let Err(e) = em.run_with_timeout(DEVICE_TICK_MS) {
                    log::error!("device event loop: {e:?}");
                }
            }
        })?;
    Ok(())
}

/// Drains the device thread's wake-up eventfd (used to reach the gate).
struct Kick(EventFd);

impl MutEventSubscriber for Kick {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.0, EventSet::IN)) {
            log::error!("cannot watch the device thread's kick: {e:?}");
        }
    }

    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.0.read();
    }
}

/// Stands in for the VM until it runs (the API is bound before that).
struct NoControl;

impl crate::api::Control for NoControl {
    fn status(&mut self) -> serde_json::Value {
        serde_json::json!({"state": "starting"})
    }
    fn pause(&mut self) -> Result<f64, String> {
        Err("the VM is starting".into())
    }
    fn resume(&mut self) -> Result<(), String> {
        Err("the VM is starting".into())
    }
    fn metrics(&mut self) -> serde_json::Value {
        serde_json::json!({})
    }
    fn shutdown(&mut self) {}
    fn snapshot(&mut self, _: &Path) -> Result<serde_json::Value, String> {
        Err("the VM is starting".into())
    }
}

/// Ends the profile the VM ran under (`--guest-profile`): writes the
/// folded stacks and prints the table on stderr.
fn write_profile(profiler: &Profiler, file: &Path, symbols: Option<&Path>) {
    if symbols.is_none() {
        eprintln!(
            "tandem: guest profile: no symbols (the kernel is not an ELF file): \
             addresses stay hex; give --guest-symbols System.map"
        );
    }
    match profiler.stop().and_then(|p| p.write(file, symbols)) {
        Ok(summary) => eprint!("{}", summary.text()),
        Err(crate::profile::ProfileError::NotRunning) => {
            log::info!("guest profile: stopped through the API before the end");
        }
        Err(e) => eprintln!("tandem: guest profile: {e}"),
    }
}

/// The device counters as JSON.
fn write_metrics(path: &Path, doc: &serde_json::Value) -> Result<(), VmError> {
    let err = |e: String| VmError::Metrics {
        path: path.display().to_string(),
        err: e,
    };
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_string_pretty(doc).map_err(|e| err(e.to_string()))?;
    std::fs::write(&tmp, text + "\n").map_err(|e| err(e.to_string()))?;
    std::fs::rename(&tmp, path).map_err(|e| err(e.to_string()))
}

/// Ends the event loop when the VM ends.
struct ExitWatcher {
    fd: std::os::fd::RawFd,
    ended: Arc<AtomicBool>,
}

impl MutEventSubscriber for ExitWatcher {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new_raw(self.fd, EventSet::IN)) {
            log::error!("cannot watch for the end of the VM: {e:?}");
        }
    }

    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        self.ended.store(true, Ordering::SeqCst);
    }
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

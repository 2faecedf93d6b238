//! [`Vm`]: a built VM and the VMM thread's loop that runs it to its end
//! (the control API, periodic metrics, the end of the VM), then ends and
//! joins the vCPU and device threads and writes the last metrics and the
//! guest profile.
//!
//! Runs on the thread that calls [`Vm::run`]. Never blocks a vCPU: the
//! loop only waits on its own event loop.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use serde_json::Value;

use crate::api::ApiServer;
use crate::boot::{self, cpu};
use crate::config::ProfileConfig;
use crate::console;
use crate::control::VmControl;
use crate::device_manager;
use crate::host_emu::cpuid;
use crate::kvm_util::KvmOp;
use crate::pause;
use crate::profile::ProfileError;
use crate::profile::Profiler;
use crate::vm::{VmHandle, VmOpError};
use crate::vstate::exit::VmExit;
use crate::vstate::memory::MemoryError;
use crate::vstate::vcpu::VcpuError;
use crate::vstate::vcpu_state::VcpuStateError;

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
    Firmware(#[from] boot::firmware::FirmwareError),
    #[error(transparent)]
    FirmwareKernel(#[from] boot::fw_kernel::FwKernelError),
    #[error(transparent)]
    Cpu(#[from] cpu::CpuError),
    #[error(transparent)]
    Cpuid(#[from] cpuid::CpuidError),
    #[error("cannot set up the event loop: {0:?}")]
    EventLoop(event_manager::Error),
    #[error("cannot make the migration's eventfd: {0}")]
    MigrationEvent(#[source] std::io::Error),
    #[error(transparent)]
    Api(#[from] crate::api::ApiError),
    #[error("cannot write metrics to {path}: {source}")]
    Metrics {
        path: std::path::PathBuf,
        source: io::Error,
    },
    #[error("cannot start a thread or eventfd: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    #[error(transparent)]
    SaveSetup(VcpuStateError),
    #[error("cannot install the vCPU kick: {0}")]
    Kick(#[source] pause::PauseError),
    #[error("cannot stop the device thread: {0}")]
    DevicePause(#[source] pause::PauseError),
    #[error("restoring the VM: {0}")]
    Restore(#[source] VmOpError),
    #[error("starting the VM: {0}")]
    Start(#[source] VmOpError),
    #[error("TLS: {0}")]
    Tls(#[source] crate::streams::tls::TlsError),
    #[error("--guest-profile: {0}")]
    Profile(#[from] ProfileError),
}

const METRICS_PERIOD: Duration = Duration::from_secs(1);

type Subscribers = EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>;

/// A built VM: every thread started and stopped, waiting for [`Vm::run`].
pub struct Vm {
    pub(crate) handle: VmHandle,
    /// The control API, bound before the guest runs (a bad path is a
    /// start-up error); its verbs reach the VM once it runs.
    pub(crate) api: Option<ApiServer>,
    pub(crate) metrics: Option<PathBuf>,
    pub(crate) profile: ProfileConfig,
    /// Whether the VM stays paused when it starts (an incoming VM, whose
    /// memory and state arrive later).
    pub(crate) start_paused: bool,
    /// How its migration and COLO streams cross the network (loaded from
    /// the configuration when it was built).
    pub(crate) transport: Arc<crate::streams::Transport>,
    /// Its side of a COLO pair, if it is in one.
    pub(crate) colo: crate::colo::Slot,
}

impl Vm {
    /// The handle other threads drive the VM through.
    pub fn handle(&self) -> VmHandle {
        self.handle.clone()
    }

    /// How the VM's migration and COLO streams cross the network.
    pub fn transport(&self) -> Arc<crate::streams::Transport> {
        self.transport.clone()
    }

    /// Makes `side` this VM's side of a COLO pair (a secondary's, before
    /// it runs; a primary's comes through the control API).
    pub fn set_colo(&self, side: Arc<crate::colo::Side>) {
        self.colo.set(side);
    }

    /// The device and exit counters as JSON, with the COLO side's report
    /// (what `--metrics` writes).
    fn metrics(&self) -> Value {
        metrics(&self.handle, &self.colo)
    }

    /// See [`VmHandle::pause`].
    pub fn pause(&self) -> Result<Duration, VmOpError> {
        self.handle.pause()
    }

    /// See [`VmHandle::resume`].
    pub fn resume(&self) -> Result<(), VmOpError> {
        self.handle.resume()
    }

    /// See [`VmHandle::capture_state`].
    pub fn capture_state(&self) -> Result<crate::vstate::vm_state::VmState, VmOpError> {
        self.handle.capture_state()
    }

    /// See [`VmHandle::apply_state`].
    pub fn apply_state(&self, s: &crate::vstate::vm_state::VmState) -> Result<(), VmOpError> {
        self.handle.apply_state(s)
    }

    /// Guest RAM and its dirty log.
    pub fn ram(&self) -> &Arc<crate::vstate::memory::GuestRam> {
        self.handle.ram()
    }

    /// Runs the VM on this thread until it ends; every thread it started
    /// is joined before this returns. Errors are for what fails before the
    /// guest runs.
    pub fn run(mut self) -> Result<VmExit, VmError> {
        let ended = Arc::new(AtomicBool::new(false));
        let mut em = self.start(&ended)?;
        let handle = self.handle.clone();
        let metrics = self.metrics.clone();
        serve(&mut em, &ended, &handle, &self.colo, metrics.as_deref());
        let why = handle.exit().reason();
        handle.finish_threads();
        console::restore_terminal();
        if let Some(path) = &metrics {
            if let Err(e) = write_metrics(path, &self.metrics()) {
                log::warn!("{e}");
            }
        }
        if let Some(file) = &self.profile.file {
            write_profile(handle.profiler(), file, self.profile.symbols.as_deref());
        }
        log::info!("{}", crate::host_emu::emulation::summary());
        Ok(why)
    }

    /// Sets up the VMM thread's event loop and lets the guest run (unless
    /// it starts paused). On an error, `self`'s drop ends the threads.
    fn start(&mut self, ended: &Arc<AtomicBool>) -> Result<Subscribers, VmError> {
        let handle = self.handle.clone();
        let mut em = Subscribers::new().map_err(VmError::EventLoop)?;
        em.add_subscriber(Arc::new(Mutex::new(ExitWatcher {
            fd: handle.exit().as_raw_fd(),
            ended: ended.clone(),
        })));
        if let Some(mut api) = self.api.take() {
            let symbols = self.profile.symbols.clone();
            let ended = Arc::new(crate::migrate::Ended::new().map_err(VmError::MigrationEvent)?);
            em.add_subscriber(Arc::new(Mutex::new(MigrationWatcher {
                ended: ended.clone(),
                vm: handle.clone(),
            })));
            let link = crate::migrate::VmLink {
                vm: handle.clone(),
                transport: self.transport.clone(),
            };
            let colo = self.colo.clone();
            api.set_control(Box::new(VmControl::new(link, colo, symbols, ended)));
            em.add_subscriber(Arc::new(Mutex::new(api)));
        }
        if let Some(path) = &self.metrics {
            write_metrics(path, &self.metrics())?;
        }
        if self.profile.file.is_some() {
            handle.profiler().start(self.profile.hz)?;
        }
        let raw = console::enter_raw_mode();
        console::spawn_input(handle.serial().clone(), handle.exit().clone(), raw)?;
        if !self.start_paused {
            handle.resume().map_err(VmError::Start)?;
        }
        Ok(em)
    }
}

impl Drop for Vm {
    /// A VM dropped without running to its end (a start-up error) still
    /// ends and joins its threads; after [`Vm::run`] there are none left.
    fn drop(&mut self) {
        self.handle.finish_threads();
    }
}

/// The VMM thread's loop: control requests and metrics until the VM ends.
/// The VM's metrics with its COLO side's report.
fn metrics(handle: &VmHandle, colo: &crate::colo::Slot) -> Value {
    let mut m = handle.metrics();
    colo.add_report(&mut m);
    m
}

fn serve(
    em: &mut Subscribers,
    ended: &AtomicBool,
    handle: &VmHandle,
    colo: &crate::colo::Slot,
    metrics: Option<&Path>,
) {
    let mut last_metrics = Instant::now();
    while !ended.load(Ordering::SeqCst) {
        if let Err(e) = em.run_with_timeout(METRICS_PERIOD.as_millis() as i32) {
            log::error!("event loop: {e:?}");
        }
        if let Some(path) = metrics {
            if last_metrics.elapsed() >= METRICS_PERIOD {
                last_metrics = Instant::now();
                if let Err(e) = write_metrics(path, &self::metrics(handle, colo)) {
                    log::warn!("{e}");
                }
            }
        }
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

/// The device counters as JSON, written atomically (through `F.tmp`).
fn write_metrics(path: &Path, doc: &Value) -> Result<(), VmError> {
    let err = |source: std::io::Error| VmError::Metrics {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_string_pretty(doc).map_err(|e| err(e.into()))?;
    std::fs::write(&tmp, text + "\n").map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// What a migration's end means for this VMM: it ends when the guest went
/// to the destination; otherwise its terminal says the guest runs on.
struct MigrationWatcher {
    ended: Arc<crate::migrate::Ended>,
    vm: VmHandle,
}

impl MutEventSubscriber for MigrationWatcher {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new_raw(self.ended.fd(), EventSet::IN)) {
            log::error!("cannot watch for the end of migrations: {e:?}");
        }
    }

    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        use crate::migrate::Phase;
        let Some(s) = self.ended.take() else {
            return;
        };
        match s.phase {
            Phase::Completed => self.vm.exit().signal(VmExit::Migrated(s.to)),
            // After the switch to post-copy the guest ran there: it must
            // never run here again.
            _ if s.lost => self.vm.exit().signal(VmExit::Lost(format!(
                "migration to {} failed in post-copy: {}",
                s.to,
                s.error.as_deref().unwrap_or("?")
            ))),
            phase => eprintln!(
                "tandem: migration to {} {}: {}; the guest runs on here",
                s.to,
                if phase == Phase::Cancelled {
                    "cancelled"
                } else {
                    "failed"
                },
                s.error.as_deref().unwrap_or("?"),
            ),
        }
    }
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

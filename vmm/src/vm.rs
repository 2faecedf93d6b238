//! The VM core as other threads drive it: a [`VmHandle`] (cheap to
//! clone) reaches everything of a VM but its event loop (the KVM VM, guest
//! memory, devices, the vCPU and device threads), which the layer above
//! assembles (`CoreParts`) and runs on the VMM thread.
//!
//! The VMM thread, the control API's adapter, and the migration and COLO
//! threads drive a running VM through it: pause and resume
//! (vCPUs, devices and the guest clock), [`VmHandle::capture_state`] and
//! [`VmHandle::apply_state`] on a paused VM, guest memory and its dirty
//! log, throttling, metrics, snapshots. A handle never blocks a vCPU: it
//! sends each vCPU an event and waits for the answers with a deadline.
//!
//! Never does: name the layers above the core (streams, migration, COLO,
//! the API, the CLI, the builder, the VMM thread's loop); what a running
//! migration or pair needs (its streams, its COLO side, its errors) lives
//! with the code that runs it.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use devices::rtc::CMOS_BYTES;
use devices::sync::lock;
use devices::GuestMemoryMmap;
use kvm_bindings::kvm_clock_data;
use kvm_ioctls::VmFd;
use migration::Manifest;

use crate::device_manager::{metrics_json, DeviceError, Devices, SerialPort, VirtioSlot};
use crate::device_thread::DeviceThread;
use crate::kvm_util::{kvm_op, KvmOp};
use crate::pause::PauseError;
use crate::profile::{ProfileError, Profiler};
use crate::snapshot::{self, SaveReport, SnapshotError};
use crate::vstate::exit::{ExitSignal, VmExit};
use crate::vstate::exit_counts::ExitCounts;
use crate::vstate::memory::{GuestRam, MemoryError};
use crate::vstate::vcpu::VcpuError;
use crate::vstate::vcpus::Vcpus;
use crate::vstate::vm_state::{self, VmState};

/// How long each vCPU thread and the device thread may take to end once
/// the VM has ended.
const FINISH_TIMEOUT: Duration = Duration::from_secs(1);

/// Why an operation on a running VM failed; the VM goes on as it was.
#[derive(Debug, thiserror::Error)]
pub enum VmOpError {
    #[error("the VM is already paused")]
    AlreadyPaused,
    #[error("the VM is not paused")]
    NotPaused,
    #[error("cannot pause the vCPUs: {0}")]
    PauseVcpus(#[source] VcpuError),
    #[error("cannot pause the devices: {0}")]
    PauseDevices(#[source] PauseError),
    #[error("cannot resume the vCPUs: {0}")]
    ResumeVcpus(#[source] VcpuError),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    Kvm(#[from] KvmOp),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error("the state is not this VM's: {0}")]
    Foreign(String),
    #[error("the VM is starting")]
    Starting,
    #[error("{0} is not available")]
    Unavailable(&'static str),
    #[error("the dirty log is off (dirty_log start)")]
    DirtyLogOff,
    #[error("cannot encode the answer: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("migration: cannot {what} the lock of disk {disk}: {source}")]
    DiskLock {
        what: &'static str,
        disk: String,
        #[source]
        source: std::io::Error,
    },
    #[error("migration: cannot flush disk {disk}: {source}")]
    DiskFlush {
        disk: String,
        #[source]
        source: std::io::Error,
    },
    #[error("a migration is under way (migrate-cancel first)")]
    Migrating,
    #[error("the VM holds no guest yet: it waits for an incoming migration")]
    Empty,
}

/// Whether the VM is paused, and what its pause saved.
#[derive(Default)]
struct PauseState {
    /// When it was paused (`None`: running).
    since: Option<Instant>,
    /// The guest clock to set on resume, so that the guest does not see
    /// the time it spent paused (or the clock of an applied state).
    clock: Option<kvm_clock_data>,
}

/// What a `VmHandle` reaches: everything of the VM but its event loop.
pub(crate) struct Core {
    pub fd: Arc<VmFd>,
    pub ram: Arc<GuestRam>,
    pub vcpus: Mutex<Vcpus>,
    pub devices: Devices,
    pub device_thread: Mutex<DeviceThread>,
    pub exit: Arc<ExitSignal>,
    pub exits: Arc<ExitCounts>,
    pub profiler: Arc<Profiler>,
    /// The MSRs saved for each vCPU (see `vcpu_state.rs`).
    pub msr_indices: Arc<Vec<u32>>,
    pub manifest: Manifest,
    pub started: Instant,
    /// No guest yet: an incoming VM before its migrated state is applied
    /// (it must not be resumed, snapshotted or reverted).
    pub empty: std::sync::atomic::AtomicBool,
    pause: Mutex<PauseState>,
    /// The firmware image it booted from (`--firmware`), mapped while it runs.
    firmware: Option<Arc<crate::boot::firmware::Firmware>>,
}

impl Core {
    /// A VM just built: its threads exist and are all stopped.
    pub fn paused(parts: CoreParts) -> Core {
        Core {
            fd: parts.fd,
            ram: parts.ram,
            vcpus: Mutex::new(parts.vcpus),
            devices: parts.devices,
            device_thread: Mutex::new(parts.device_thread),
            exit: parts.exit,
            exits: parts.exits,
            profiler: parts.profiler,
            msr_indices: parts.msr_indices,
            manifest: parts.manifest,
            started: Instant::now(),
            empty: std::sync::atomic::AtomicBool::new(false),
            pause: Mutex::new(PauseState {
                since: Some(Instant::now()),
                clock: None,
            }),
            firmware: parts.firmware,
        }
    }
}

/// The parts [`Core::paused`] assembles (see `builder.rs`).
pub(crate) struct CoreParts {
    pub fd: Arc<VmFd>,
    pub ram: Arc<GuestRam>,
    pub vcpus: Vcpus,
    pub devices: Devices,
    pub device_thread: DeviceThread,
    pub exit: Arc<ExitSignal>,
    pub exits: Arc<ExitCounts>,
    pub profiler: Arc<Profiler>,
    pub msr_indices: Arc<Vec<u32>>,
    pub manifest: Manifest,
    pub firmware: Option<Arc<crate::boot::firmware::Firmware>>,
}

/// A running VM as another thread drives it (cheap to clone).
#[derive(Clone)]
pub struct VmHandle(pub(crate) Arc<Core>);

/// What a snapshot through [`VmHandle::snapshot`] did.
#[derive(Debug, Clone, Copy)]
pub struct SnapshotDone {
    pub report: SaveReport,
    /// Wall time, pause to resume.
    pub ms: f64,
    /// Of that, capturing the state (vCPUs, VM, devices), ms.
    pub capture_ms: f64,
    /// Whether the VM was running (and so was paused for it and resumed).
    pub was_running: bool,
}

/// What a [`VmHandle::revert`] did.
#[derive(Debug, Clone, Copy)]
pub struct RevertDone {
    /// Non-zero pages the snapshot put back.
    pub pages: u64,
    /// Wall time, file checks included.
    pub ms: f64,
    /// Whether the VM was running (and runs again).
    pub was_running: bool,
}

impl VmHandle {
    /// Whether the VM is paused.
    pub fn is_paused(&self) -> bool {
        lock(&self.0.pause).since.is_some()
    }

    /// How long the VM has been paused (`None`: it runs).
    pub fn paused_for(&self) -> Option<Duration> {
        lock(&self.0.pause).since.map(|t| t.elapsed())
    }

    /// Time since the VM was built.
    pub fn uptime(&self) -> Duration {
        self.0.started.elapsed()
    }

    /// What the VM is (memory, vCPUs, devices).
    pub fn manifest(&self) -> &Manifest {
        &self.0.manifest
    }

    /// Stops every vCPU and the device thread, and keeps the guest clock;
    /// returns how long that took. If the devices do not stop, the vCPUs
    /// run again and the VM is as it was.
    pub fn pause(&self) -> Result<Duration, VmOpError> {
        let mut p = lock(&self.0.pause);
        if p.since.is_some() {
            return Err(VmOpError::AlreadyPaused);
        }
        let start = Instant::now();
        lock(&self.0.vcpus).pause().map_err(VmOpError::PauseVcpus)?;
        if let Err(e) = lock(&self.0.device_thread).pause() {
            if let Err(r) = lock(&self.0.vcpus).resume() {
                log::error!("pause: cannot resume the vCPUs again: {r}");
            }
            return Err(VmOpError::PauseDevices(e));
        }
        // With every vCPU stopped, the guest clock is read once and set back
        // on resume.
        match self.0.fd.get_clock() {
            Ok(c) => p.clock = Some(c),
            Err(e) => log::warn!("pause: cannot read the guest clock: {e}"),
        }
        p.since = Some(Instant::now());
        Ok(start.elapsed())
    }

    /// Lets the paused VM run again, its guest clock where the pause (or
    /// an applied state) left it.
    pub fn resume(&self) -> Result<(), VmOpError> {
        let mut p = lock(&self.0.pause);
        if p.since.is_none() {
            return Err(VmOpError::NotPaused);
        }
        if let Some(saved) = p.clock.take() {
            if let Err(e) = self.0.fd.set_clock(&vm_state::clock_to_set(&saved)) {
                log::warn!("resume: cannot set the guest clock: {e}");
            }
        }
        lock(&self.0.device_thread).resume();
        lock(&self.0.vcpus)
            .resume()
            .map_err(VmOpError::ResumeVcpus)?;
        p.since = None;
        Ok(())
    }

    /// The firmware image it booted from (`--firmware`), if any.
    pub fn firmware(&self) -> Option<&std::path::Path> {
        self.0.firmware.as_ref().map(|fw| fw.path())
    }

    /// The whole state of the paused VM but its memory; the vCPUs hand
    /// theirs over in parallel.
    pub fn capture_state(&self) -> Result<VmState, VmOpError> {
        let p = lock(&self.0.pause);
        if p.since.is_none() {
            return Err(VmOpError::NotPaused);
        }
        let clock = match p.clock {
            Some(c) => c,
            None => self
                .0
                .fd
                .get_clock()
                .map_err(kvm_op("read the guest clock"))?,
        };
        let vm = vm_state::read_vm_wide(&self.0.fd, clock)?;
        let vcpus = lock(&self.0.vcpus).capture(&self.0.msr_indices)?;
        let devices = self
            .virtio()
            .iter()
            .map(|d| Ok((d.id().to_string(), d.save()?)))
            .collect::<Result<Vec<_>, VmOpError>>()?;
        Ok(VmState {
            manifest: self.0.manifest.clone(),
            vm,
            vcpus,
            serial: lock(&self.0.devices.serial).state(),
            rtc: Some(lock(&self.0.devices.rtc).state()),
            pci: self.0.devices.pci.as_ref().map(|p| {
                let mut s = lock(p).state();
                s.pm1_enable = self
                    .0
                    .devices
                    .acpi_pm
                    .as_ref()
                    .map_or(0, |a| lock(a).enable());
                s
            }),
            fw_cfg: Some(lock(&self.0.devices.fw_cfg).state()),
            devices,
        })
    }

    /// Checks that `s` is a state of this VM (vCPUs, devices by id, each
    /// transport against its device) without changing anything.
    pub fn check_state(&self, s: &VmState) -> Result<(), VmOpError> {
        let foreign = |what: String| Err(VmOpError::Foreign(what));
        if s.manifest.mem_bytes != self.0.manifest.mem_bytes {
            return foreign(format!(
                "{} MiB of memory, this VM has {} MiB",
                s.manifest.mem_bytes >> 20,
                self.0.manifest.mem_bytes >> 20
            ));
        }
        // The image mapped here, read when the VM was built, is the one
        // the state was saved with (the manifests were compared before,
        // on what the file held then).
        let image = |m: &Manifest| m.firmware.as_ref().map(|f| (f.bytes, f.sha256.clone()));
        if image(&s.manifest) != image(&self.0.manifest) {
            return foreign("another firmware image than this VM's (size or SHA-256)".into());
        }
        let vcpus = lock(&self.0.vcpus).len();
        if s.vcpus.len() != vcpus {
            return foreign(format!("{} vCPUs, this VM has {vcpus}", s.vcpus.len()));
        }
        if let Some(rtc) = s.rtc.as_ref().filter(|r| r.ram.len() != CMOS_BYTES) {
            return foreign(format!("{} bytes of CMOS RAM", rtc.ram.len()));
        }
        match (&self.0.devices.pci, &s.pci) {
            (None, None) => {}
            (Some(bus), Some(p)) => lock(bus)
                .check_state(p)
                .map_err(|e| VmOpError::Foreign(e.to_string()))?,
            (Some(_), None) => return foreign("no PCI bus, this VM has one".into()),
            (None, Some(_)) => return foreign("a PCI bus, this VM has none".into()),
        }
        let virtio = self.virtio();
        if s.devices.len() != virtio.len() {
            return foreign(format!(
                "{} virtio devices, this VM has {}",
                s.devices.len(),
                virtio.len()
            ));
        }
        for (slot, (id, d)) in virtio.iter().zip(&s.devices) {
            let Some((t, pci)) = VmState::transport(d).filter(|_| id == slot.id()) else {
                return foreign(format!("device {id} where this VM has {}", slot.id()));
            };
            slot.check_transport(t, pci)?;
        }
        Ok(())
    }

    /// Puts the paused VM in state `s` (memory is the caller's, written
    /// before; KVM's mappings derived from the old memory are dropped):
    /// VM-wide
    /// state, every vCPU (in parallel), every device (a live one restarts
    /// on the saved queues) and the serial port; the guest clock is set to
    /// `s`'s on resume. Everything is checked before anything changes.
    pub fn apply_state(&self, s: &VmState) -> Result<(), VmOpError> {
        let mut p = lock(&self.0.pause);
        if p.since.is_none() {
            return Err(VmOpError::NotPaused);
        }
        self.check_state(s)?;
        // Whatever KVM built from the memory the vCPUs ran on goes: the
        // caller has just written the state's memory. An incoming VM's
        // vCPUs have never run: nothing to forget (re-registering every
        // slot would cost the migration's downtime for nothing).
        if !self.is_empty() {
            self.0.ram.forget_mappings()?;
        }
        vm_state::apply_vm_wide(&self.0.fd, &s.vm)?;
        lock(&self.0.vcpus).apply(s.vcpus.clone())?;
        for (slot, (_, d)) in self.virtio().iter().zip(&s.devices) {
            if let Some((t, pci)) = VmState::transport(d) {
                slot.restore_transport(t, pci)?;
            }
        }
        self.0.devices.restore_serial(&s.serial)?;
        if let (Some(bus), Some(p)) = (&self.0.devices.pci, &s.pci) {
            lock(bus)
                .restore(p)
                .map_err(|e| VmOpError::Foreign(e.to_string()))?;
            if let Some(pm) = &self.0.devices.acpi_pm {
                lock(pm).set_enable(p.pm1_enable);
            }
        }
        if let Some(f) = &s.fw_cfg {
            lock(&self.0.devices.fw_cfg).restore(f);
        }
        if let Some(rtc) = &s.rtc {
            lock(&self.0.devices.rtc)
                .restore(rtc)
                .map_err(|e| VmOpError::Foreign(format!("its CMOS RTC: {e}")))?;
        }
        p.clock = Some(s.vm.clock);
        self.0.empty.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Whether the VM holds no guest yet (an incoming VM before its state).
    pub fn is_empty(&self) -> bool {
        self.0.empty.load(Ordering::SeqCst)
    }

    /// Writes a snapshot to `path`, pausing a running VM for it.
    pub fn snapshot(&self, path: &Path) -> Result<SnapshotDone, VmOpError> {
        let start = Instant::now();
        let was_running = !self.is_paused();
        if was_running {
            self.pause()?;
        }
        let captured = Instant::now();
        let state = self.capture_state();
        let capture_ms = captured.elapsed().as_secs_f64() * 1000.0;
        let saved =
            state.and_then(|s| snapshot::save(path, &s, self.memory()).map_err(VmOpError::from));
        if was_running {
            if let Err(e) = self.resume() {
                log::error!("snapshot: cannot resume the VM: {e}");
            }
        }
        Ok(SnapshotDone {
            report: saved?,
            ms: start.elapsed().as_secs_f64() * 1000.0,
            capture_ms,
            was_running,
        })
    }

    /// Takes the running VM back to snapshot `path` of itself: the file is
    /// verified whole and checked against this VM before the VM pauses;
    /// then memory is replaced, the state applied, and the VM resumed if it
    /// was running. Should replacing memory fail midway (a read error of a
    /// verified file), the VM stays paused: its memory is partly the
    /// snapshot's.
    pub fn revert(&self, path: &Path) -> Result<RevertDone, VmOpError> {
        let start = Instant::now();
        let mut r = snapshot::load_for(path, &self.0.manifest)?;
        let was_running = !self.is_paused();
        if was_running {
            self.pause()?;
        }
        if let Err(e) = self.check_state(&r.state) {
            if was_running {
                self.resume()?;
            }
            return Err(e);
        }
        let applied = r
            .fill_memory_over(self.memory())
            .map_err(VmOpError::from)
            .and_then(|stats| self.apply_state(&r.state).map(|()| stats.pages));
        let pages = match applied {
            Ok(p) => p,
            Err(e) => {
                log::error!("revert to {}: {e}; the VM stays paused", path.display());
                return Err(e);
            }
        };
        if was_running {
            self.resume()?;
        }
        Ok(RevertDone {
            pages,
            ms: start.elapsed().as_secs_f64() * 1000.0,
            was_running,
        })
    }

    /// Takes (`held`) or releases every disk image's lock, each after its
    /// completed writes are made durable: a migration's switch-over (the
    /// VM paused). Stops at the first disk that fails.
    pub fn hold_disk_locks(&self, held: bool) -> Result<(), VmOpError> {
        for slot in self.virtio().iter() {
            if let Some(Err(e)) = slot.hold_disk_lock(held) {
                let what = if held { "take" } else { "release" };
                return Err(VmOpError::DiskLock {
                    what,
                    disk: slot.id().to_string(),
                    source: e,
                });
            }
        }
        Ok(())
    }

    /// Makes every disk's completed writes durable (while the guest runs:
    /// what is left to flush at a switch-over is then small).
    pub fn flush_disks(&self) -> Result<(), VmOpError> {
        for slot in self.virtio().iter() {
            if let Some(Err(e)) = slot.flush_disk() {
                return Err(VmOpError::DiskFlush {
                    disk: slot.id().to_string(),
                    source: e,
                });
            }
        }
        Ok(())
    }

    /// Makes every vCPU run only (100 - `percent`)% of the time (0: off;
    /// see [`crate::vstate::vcpu::THROTTLE_SLICE`]).
    pub fn throttle(&self, percent: u8) -> Result<(), VmOpError> {
        Ok(lock(&self.0.vcpus).throttle(percent)?)
    }

    /// Guest RAM, its KVM slots and its dirty log.
    pub fn ram(&self) -> &Arc<GuestRam> {
        &self.0.ram
    }

    /// Guest memory (every device write marks its pages).
    pub fn memory(&self) -> &GuestMemoryMmap {
        self.0.ram.mem()
    }

    /// The virtio devices, in manifest order.
    pub fn virtio(&self) -> &Arc<[VirtioSlot]> {
        &self.0.devices.virtio
    }

    /// The serial port.
    pub fn serial(&self) -> &SerialPort {
        &self.0.devices.serial
    }

    /// The device and exit counters as JSON (what `--metrics` writes).
    pub fn metrics(&self) -> serde_json::Value {
        let mut m = metrics_json(self.virtio(), &self.0.exits);
        if let Some(o) = m.as_object_mut() {
            let bad_dates = lock(&self.0.devices.rtc).bad_dates();
            o.insert("rtc".into(), serde_json::json!({ "bad_dates": bad_dates }));
            let bad = lock(&self.0.devices.fw_cfg).bad_accesses();
            o.insert("fw_cfg".into(), serde_json::json!({ "bad_accesses": bad }));
            if let Some(bus) = &self.0.devices.pci {
                let bad = lock(bus).bad_accesses();
                o.insert("pci".into(), serde_json::json!({ "bad_accesses": bad }));
            }
            if let Some(pm) = &self.0.devices.acpi_pm {
                let ignored = lock(pm).ignored_accesses();
                o.insert(
                    "acpi_pm".into(),
                    serde_json::json!({ "ignored_accesses": ignored }),
                );
            }
        }
        m
    }

    /// The guest profiler.
    pub fn profiler(&self) -> &Arc<Profiler> {
        &self.0.profiler
    }

    /// Ends the VM (resuming it first if paused, so its threads can end).
    pub fn shutdown(&self) {
        if self.is_paused() {
            let _ = self.resume();
        }
        self.0.exit.signal(VmExit::Shutdown);
    }

    /// How the VM ends (or ended).
    pub fn exit(&self) -> &Arc<ExitSignal> {
        &self.0.exit
    }

    /// The device loop's turns (for an inline migration).
    pub fn device_turns(&self) -> crate::device_thread::turns::SharedTurns {
        lock(&self.0.device_thread).turns()
    }

    /// Ends and joins every vCPU thread and the device thread.
    pub(crate) fn finish_threads(&self) {
        lock(&self.0.vcpus).finish(FINISH_TIMEOUT);
        lock(&self.0.device_thread).finish(FINISH_TIMEOUT);
    }
}

//! What the control API does to a running VM: status, pause/resume (vCPUs,
//! devices and the guest clock), metrics, snapshot, shutdown. Runs on the
//! VMM thread.
//!
//! A snapshot pauses a running VM, asks every paused vCPU thread for its
//! state at once (an event on each one's handle: only the thread owns its
//! `VcpuFd`, see `vcpus.rs`), reads the VM-wide and serial state here,
//! writes the file (see `snapshot.rs`) and resumes the VM if it was running.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use devices::GuestMemoryMmap;
use kvm_bindings::kvm_clock_data;
use kvm_ioctls::VmFd;
use serde_json::{json, Value};
use vmm_sys_util::eventfd::EventFd;

use crate::api::{Control, DirtyLogAction};
use crate::device_manager::VirtioSlot;
use crate::exit::{ExitSignal, VmExit};
use crate::memory::{count_bits, GuestRam, PAGE_SIZE};
use crate::pause::Gate;
use crate::profile::{self, Profiler};
use crate::snapshot::{self, SaveReport, SaveState};
use crate::vcpus::Vcpus;

/// Reads the serial UART's state.
pub type SerialStateFn = Box<dyn Fn() -> vm_superio::serial::SerialState + Send>;

/// What a snapshot needs beyond pause/resume.
pub struct SnapshotParts {
    pub mem: GuestMemoryMmap,
    pub serial: SerialStateFn,
    /// The MSRs saved for each vCPU (see `vcpu_state.rs`).
    pub msr_indices: Arc<Vec<u32>>,
    /// What the VM is (memory, vCPUs, devices).
    pub manifest: migration::Manifest,
    /// The virtio devices, in manifest order.
    pub devices: Arc<[VirtioSlot]>,
}

/// What the profiler verbs need.
pub struct ProfileParts {
    pub profiler: Arc<Profiler>,
    /// Names for the sampled addresses (an ELF vmlinux or a System.map).
    pub symbols: Option<std::path::PathBuf>,
}

/// Produces the device counters as JSON.
pub type MetricsFn = Box<dyn Fn() -> Value + Send>;

/// The VM as the control API sees it.
pub struct VmControl {
    pub vm: Arc<VmFd>,
    /// Every vCPU (shared with the VMM thread, which ends them).
    pub vcpus: Arc<Mutex<Vcpus>>,
    pub device_gate: Arc<Gate>,
    /// Wakes the device thread so that it reaches its gate.
    pub device_kick: EventFd,
    pub exit: Arc<ExitSignal>,
    pub metrics: MetricsFn,
    pub mem_bytes: u64,
    pub cpus: u8,
    pub started: Instant,
    /// What a snapshot needs; without it snapshots are refused.
    pub snapshot: Option<SnapshotParts>,
    /// What the profiler verbs need; without it they are refused.
    pub profile: Option<ProfileParts>,
    /// Guest memory and its dirty log; without it `dirty_log` is refused.
    pub ram: Option<Arc<GuestRam>>,
    /// When the dirty log was last started or read.
    dirty_since: Option<Instant>,
    /// The guest clock when paused; set back on resume.
    clock: Option<kvm_clock_data>,
    paused_at: Option<Instant>,
}

impl VmControl {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        vm: Arc<VmFd>,
        vcpus: Arc<Mutex<Vcpus>>,
        device_gate: Arc<Gate>,
        device_kick: EventFd,
        exit: Arc<ExitSignal>,
        metrics: MetricsFn,
        mem_bytes: u64,
        cpus: u8,
    ) -> Self {
        VmControl {
            vm,
            vcpus,
            device_gate,
            device_kick,
            exit,
            metrics,
            mem_bytes,
            cpus,
            started: Instant::now(),
            snapshot: None,
            profile: None,
            ram: None,
            dirty_since: None,
            clock: None,
            paused_at: None,
        }
    }

    fn paused(&self) -> bool {
        self.paused_at.is_some()
    }

    /// Saves the paused VM to `path`.
    fn save(&self, parts: &SnapshotParts, path: &Path) -> Result<SaveReport, String> {
        let clock = match self.clock {
            Some(c) => c,
            None => self
                .vm
                .get_clock()
                .map_err(|e| format!("cannot read the guest clock: {e}"))?,
        };
        let vm = snapshot::read_vm_state(&self.vm, clock).map_err(|e| e.to_string())?;
        let vcpus = devices::bus::lock(&self.vcpus)
            .capture(&parts.msr_indices)
            .map_err(|e| e.to_string())?;
        let devices = parts
            .devices
            .iter()
            .map(|d| Ok((d.id().to_string(), d.save().map_err(|e| e.to_string())?)))
            .collect::<Result<Vec<_>, String>>()?;
        let state = SaveState {
            manifest: parts.manifest.clone(),
            vm,
            vcpus,
            serial: (parts.serial)(),
            devices,
        };
        snapshot::save(path, &state, &parts.mem).map_err(|e| e.to_string())
    }
}

impl Control for VmControl {
    fn status(&mut self) -> Value {
        json!({
            "state": if self.paused() { "paused" } else { "running" },
            "vcpus": self.cpus,
            "mem_mib": self.mem_bytes >> 20,
            "uptime_s": self.started.elapsed().as_secs_f64(),
            "paused_s": self.paused_at.map(|t| t.elapsed().as_secs_f64()),
        })
    }

    fn pause(&mut self) -> Result<f64, String> {
        if self.paused() {
            return Err("the VM is already paused".into());
        }
        let start = Instant::now();
        devices::bus::lock(&self.vcpus)
            .pause()
            .map_err(|e| format!("cannot pause the vCPUs: {e}"))?;
        let kick = &self.device_kick;
        if let Err(e) = self.device_gate.pause(1, || {
            let _ = kick.write(1);
        }) {
            if let Err(r) = devices::bus::lock(&self.vcpus).resume() {
                log::error!("pause: cannot resume the vCPUs again: {r}");
            }
            return Err(format!("cannot pause the devices: {e}"));
        }
        // With every vCPU stopped, the guest clock is read once and set back
        // on resume, so the guest does not see the time it spent paused.
        match self.vm.get_clock() {
            Ok(c) => self.clock = Some(c),
            Err(e) => log::warn!("pause: cannot read the guest clock: {e}"),
        }
        self.paused_at = Some(Instant::now());
        Ok(start.elapsed().as_secs_f64() * 1000.0)
    }

    fn resume(&mut self) -> Result<(), String> {
        if !self.paused() {
            return Err("the VM is not paused".into());
        }
        if let Some(saved) = self.clock.take() {
            let c = kvm_clock_data {
                clock: saved.clock,
                ..Default::default()
            };
            if let Err(e) = self.vm.set_clock(&c) {
                log::warn!("resume: cannot set the guest clock: {e}");
            }
        }
        self.device_gate.resume();
        devices::bus::lock(&self.vcpus)
            .resume()
            .map_err(|e| format!("cannot resume the vCPUs: {e}"))?;
        self.paused_at = None;
        Ok(())
    }

    fn metrics(&mut self) -> Value {
        (self.metrics)()
    }

    fn shutdown(&mut self) {
        if self.paused() {
            let _ = self.resume();
        }
        self.exit.signal(VmExit::Shutdown);
    }

    fn snapshot(&mut self, path: &Path) -> Result<Value, String> {
        let Some(parts) = self.snapshot.take() else {
            return Err("snapshots are not available for this VM".into());
        };
        let result = self.snapshot_with(&parts, path);
        self.snapshot = Some(parts);
        result
    }

    fn profile_start(&mut self, hz: u32) -> Result<Value, String> {
        let parts = self.profile.as_ref().ok_or("profiling is not available")?;
        parts.profiler.start(hz).map_err(|e| e.to_string())?;
        Ok(json!({"hz": hz, "symbols": parts.symbols}))
    }

    fn throttle(&mut self, percent: u8) -> Result<Value, String> {
        devices::bus::lock(&self.vcpus)
            .throttle(percent)
            .map_err(|e| e.to_string())?;
        Ok(json!({"percent": percent}))
    }

    fn dirty_log(&mut self, action: DirtyLogAction) -> Result<Value, String> {
        let ram = self.ram.clone().ok_or("the dirty log is not available")?;
        match action {
            DirtyLogAction::Start => {
                ram.start_dirty_log().map_err(|e| e.to_string())?;
                self.dirty_since = Some(Instant::now());
                Ok(json!({"logging": true, "pages": ram.bytes() / PAGE_SIZE}))
            }
            DirtyLogAction::Read => self.dirty_read(&ram),
            DirtyLogAction::Stop => {
                ram.stop_dirty_log().map_err(|e| e.to_string())?;
                self.dirty_since = None;
                Ok(json!({"logging": false}))
            }
        }
    }

    fn profile_stop(&mut self, path: &Path) -> Result<Value, String> {
        let parts = self.profile.as_ref().ok_or("profiling is not available")?;
        let prof = parts.profiler.stop().map_err(|e| e.to_string())?;
        let summary = prof
            .write(path, parts.symbols.as_deref())
            .map_err(|e| e.to_string())?;
        log::info!("{}", summary.text());
        let mut v = serde_json::to_value(&summary).map_err(|e| e.to_string())?;
        if let Some(o) = v.as_object_mut() {
            o.insert(
                "table".into(),
                Value::String(profile::report::table_text(&summary.top)),
            );
        }
        Ok(v)
    }
}

impl VmControl {
    /// `dirty_log read`: the pages written since the log started or was
    /// last read, by source, then reset.
    fn dirty_read(&mut self, ram: &GuestRam) -> Result<Value, String> {
        if !ram.logging() {
            return Err("the dirty log is off (dirty_log start)".into());
        }
        let slots = ram.harvest().map_err(|e| e.to_string())?;
        ram.clear_all().map_err(|e| e.to_string())?;
        let now = Instant::now();
        let seconds = self
            .dirty_since
            .replace(now)
            .map_or(0.0, |t| (now - t).as_secs_f64());
        let kvm: u64 = slots.iter().map(|s| count_bits(&s.kvm)).sum();
        let device: u64 = slots.iter().map(|s| count_bits(&s.device)).sum();
        let pages: u64 = slots.into_iter().map(|s| s.union().count()).sum();
        let mib = (pages * PAGE_SIZE) as f64 / f64::from(1u32 << 20);
        Ok(json!({
            "logging": true,
            "pages": pages,
            "kvm_pages": kvm,
            "device_pages": device,
            "seconds": seconds,
            "mib_per_s": if seconds > 0.0 { mib / seconds } else { 0.0 },
        }))
    }

    fn snapshot_with(&mut self, parts: &SnapshotParts, path: &Path) -> Result<Value, String> {
        let start = Instant::now();
        let was_running = !self.paused();
        if was_running {
            self.pause()?;
        }
        let saved = self.save(parts, path);
        if was_running {
            if let Err(e) = self.resume() {
                log::error!("snapshot: cannot resume the VM: {e}");
            }
        }
        let report = saved?;
        let ms = start.elapsed().as_secs_f64() * 1000.0;
        log::info!(
            "snapshot {}: {} bytes ({} of memory) in {ms:.0} ms",
            path.display(),
            report.file_bytes,
            report.memory_bytes
        );
        Ok(json!({
            "path": path,
            "file_bytes": report.file_bytes,
            "memory_bytes": report.memory_bytes,
            "ms": ms,
            "state": if was_running { "running" } else { "paused" },
        }))
    }
}

//! What the control API does to a running VM: status, pause/resume (vCPUs,
//! devices and the guest clock), metrics, shutdown. Runs on the VMM thread.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use kvm_bindings::kvm_clock_data;
use kvm_ioctls::VmFd;
use serde_json::{json, Value};
use vmm_sys_util::eventfd::EventFd;

use crate::api::Control;
use crate::exit::{ExitSignal, VmExit};
use crate::pause::{self, Gate};

/// Produces the device counters as JSON.
pub type MetricsFn = Box<dyn Fn() -> Value + Send>;

/// The VM as the control API sees it.
pub struct VmControl {
    pub vm: Arc<VmFd>,
    pub vcpu_gate: Arc<Gate>,
    pub vcpu_threads: Vec<JoinHandle<()>>,
    pub device_gate: Arc<Gate>,
    /// Wakes the device thread so that it reaches its gate.
    pub device_kick: EventFd,
    pub exit: Arc<ExitSignal>,
    pub metrics: MetricsFn,
    pub mem_bytes: u64,
    pub cpus: u8,
    pub started: Instant,
    /// The guest clock when paused; set back on resume.
    clock: Option<kvm_clock_data>,
    paused_at: Option<Instant>,
}

impl VmControl {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        vm: Arc<VmFd>,
        vcpu_gate: Arc<Gate>,
        vcpu_threads: Vec<JoinHandle<()>>,
        device_gate: Arc<Gate>,
        device_kick: EventFd,
        exit: Arc<ExitSignal>,
        metrics: MetricsFn,
        mem_bytes: u64,
        cpus: u8,
    ) -> Self {
        VmControl {
            vm,
            vcpu_gate,
            vcpu_threads,
            device_gate,
            device_kick,
            exit,
            metrics,
            mem_bytes,
            cpus,
            started: Instant::now(),
            clock: None,
            paused_at: None,
        }
    }

    fn paused(&self) -> bool {
        self.paused_at.is_some()
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
        let threads = &self.vcpu_threads;
        self.vcpu_gate
            .pause(threads.len(), || pause::kick_all(threads))
            .map_err(|e| format!("cannot pause the vCPUs: {e}"))?;
        let kick = &self.device_kick;
        if let Err(e) = self.device_gate.pause(1, || {
            let _ = kick.write(1);
        }) {
            self.vcpu_gate.resume();
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
        self.vcpu_gate.resume();
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

    fn snapshot(&mut self, _path: &std::path::Path) -> Result<Value, String> {
        Err("snapshot is not implemented yet".into())
    }
}

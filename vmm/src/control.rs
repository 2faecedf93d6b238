//! The control API's verbs mapped onto a running VM: a thin adapter from
//! [`Control`] to [`VmHandle`], which does the work (pause and resume,
//! state capture, snapshots, throttle, the dirty log). Here are only the
//! JSON answers and what belongs to the API itself: when the dirty log was
//! last read, and where the profiler's symbols are.
//!
//! Runs on the VMM thread, one request at a time.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value};

use crate::api::{ColoAsk, Control, ControlError, DirtyLogAction, Refused};
use crate::colo::Slot;
use crate::migrate::{Ended, Migration, Params, VmLink};
use crate::profile;
use crate::streams::Endpoint;
use crate::vm::VmOpError;
use crate::vstate::memory::{count_bits, GuestRam, PAGE_SIZE};
use std::sync::Arc;

/// The VM as the control API sees it.
pub struct VmControl {
    vm: VmLink,
    /// This VM's side of a COLO pair, if it is in one (shared with the VMM
    /// thread's loop, which adds its report to the metrics).
    colo: Slot,
    /// Names for the profiler's addresses (an ELF vmlinux or a System.map).
    symbols: Option<PathBuf>,
    /// When the dirty log was last started or read.
    dirty_since: Option<Instant>,
    /// The last migration started from here (under way or ended).
    migration: Option<Migration>,
    /// Where a migration says it ended (watched by the VMM thread's loop).
    ended: Arc<Ended>,
    /// The pair this VM is the primary of.
    primary: Option<crate::colo::primary::Primary>,
}

impl VmControl {
    /// The verbs of `vm`.
    pub fn new(vm: VmLink, colo: Slot, symbols: Option<PathBuf>, ended: Arc<Ended>) -> Self {
        VmControl {
            vm,
            colo,
            symbols,
            dirty_since: None,
            migration: None,
            ended,
            primary: None,
        }
    }
}

impl Control for VmControl {
    fn status(&mut self) -> Value {
        json!({
            "state": if self.vm.is_paused() { "paused" } else { "running" },
            "vcpus": self.vm.manifest().vcpus,
            "mem_mib": self.vm.manifest().mem_bytes >> 20,
            "uptime_s": self.vm.uptime().as_secs_f64(),
            "paused_s": self.vm.paused_for().map(|t| t.as_secs_f64()),
        })
    }

    fn pause(&mut self) -> Result<f64, ControlError> {
        self.not_migrating()?;
        let took = self.vm.pause()?;
        Ok(took.as_secs_f64() * 1000.0)
    }

    fn resume(&mut self) -> Result<(), ControlError> {
        self.not_migrating()?;
        Ok(self.vm.resume()?)
    }

    fn metrics(&mut self) -> Value {
        let mut m = self.vm.metrics();
        self.colo.add_report(&mut m);
        m
    }

    fn shutdown(&mut self) {
        self.vm.shutdown();
    }

    fn snapshot(&mut self, path: &Path) -> Result<Value, ControlError> {
        self.not_migrating()?;
        let done = self.vm.snapshot(path)?;
        log::info!(
            "snapshot {}: {} bytes ({} of memory) in {:.0} ms \
             (state {:.1} ms, write {:.1} ms, fsync {:.1} ms)",
            path.display(),
            done.report.file_bytes,
            done.report.memory_bytes,
            done.ms,
            done.capture_ms,
            done.report.write_ms,
            done.report.sync_ms
        );
        Ok(json!({
            "path": path,
            "file_bytes": done.report.file_bytes,
            "memory_bytes": done.report.memory_bytes,
            "ms": done.ms,
            "capture_ms": done.capture_ms,
            "write_ms": done.report.write_ms,
            "sync_ms": done.report.sync_ms,
            "state": if done.was_running { "running" } else { "paused" },
        }))
    }

    fn revert(&mut self, path: &Path) -> Result<Value, ControlError> {
        self.not_migrating()?;
        let done = self.vm.revert(path)?;
        log::info!(
            "revert to {}: {} pages in {:.0} ms",
            path.display(),
            done.pages,
            done.ms
        );
        Ok(json!({
            "path": path,
            "pages": done.pages,
            "ms": done.ms,
            "state": if done.was_running { "running" } else { "paused" },
        }))
    }

    fn profile_start(&mut self, hz: u32) -> Result<Value, ControlError> {
        self.vm.profiler().start(hz)?;
        Ok(json!({"hz": hz, "symbols": self.symbols}))
    }

    fn profile_stop(&mut self, path: &Path) -> Result<Value, ControlError> {
        let prof = self.vm.profiler().stop()?;
        let summary = prof.write(path, self.symbols.as_deref())?;
        log::info!("{}", summary.text());
        let mut v = serde_json::to_value(&summary).map_err(VmOpError::Encode)?;
        if let Some(o) = v.as_object_mut() {
            o.insert(
                "table".into(),
                Value::String(profile::report::table_text(&summary.top)),
            );
        }
        Ok(v)
    }

    fn throttle(&mut self, percent: u8) -> Result<Value, ControlError> {
        self.not_migrating()?;
        self.vm.throttle(percent)?;
        Ok(json!({"percent": percent}))
    }

    fn dirty_log(&mut self, action: DirtyLogAction) -> Result<Value, ControlError> {
        self.not_migrating()?;
        let ram = self.vm.ram().clone();
        match action {
            DirtyLogAction::Start => {
                ram.start_dirty_log()?;
                self.dirty_since = Some(Instant::now());
                Ok(json!({"logging": true, "pages": ram.bytes() / PAGE_SIZE}))
            }
            DirtyLogAction::Read => self.dirty_read(&ram),
            DirtyLogAction::Stop => {
                ram.stop_dirty_log()?;
                self.dirty_since = None;
                Ok(json!({"logging": false}))
            }
        }
    }

    fn migrate(&mut self, to: &str, params: Params) -> Result<Value, ControlError> {
        self.not_migrating()?;
        params
            .check()
            .map_err(|e| ControlError::migration(Refused::Invalid(e)))?;
        let to: Endpoint = to.parse().map_err(ControlError::migration)?;
        self.vm
            .transport()
            .check(&to)
            .map_err(ControlError::migration)?;
        if self.vm.ram().logging() {
            return Err(ControlError::migration(Refused::DirtyLogOn));
        }
        // The last one's thread has ended: dropping it joins at once.
        self.migration = None;
        let m = Migration::start(self.vm.clone(), to, params, self.ended.clone())
            .map_err(|e| ControlError::migration(Refused::Thread("the thread", e)))?;
        self.migration = Some(m);
        self.migration_json()
    }

    fn migrate_status(&mut self) -> Result<Value, ControlError> {
        self.migration_json()
    }

    fn migrate_cancel(&mut self) -> Result<Value, ControlError> {
        match &self.migration {
            Some(m) if m.active() => m.cancel(),
            _ => return Err(ControlError::migration(Refused::NoneUnderWay)),
        }
        self.migration_json()
    }

    fn migrate_postcopy(&mut self) -> Result<Value, ControlError> {
        match &self.migration {
            Some(m) if m.active() && m.status().phase == crate::migrate::Phase::PreCopy => {
                if m.status().params.mode == crate::migrate::Mode::Inline {
                    let why = "post-copy needs mode thread".to_string();
                    return Err(ControlError::migration(Refused::Invalid(why)));
                }
                m.switch_to_postcopy()
            }
            Some(m) if m.active() => {
                let why = "the migration is past its pre-copy".to_string();
                return Err(ControlError::migration(Refused::Invalid(why)));
            }
            _ => return Err(ControlError::migration(Refused::NoneUnderWay)),
        }
        self.migration_json()
    }

    fn colo_start(
        &mut self,
        params: crate::colo::Params,
        arbiter: crate::colo::arbiter::ArbiterSpec,
    ) -> Result<Value, ControlError> {
        // Again only after a pair that did not start.
        if let Some(side) = self.colo.get() {
            if side.report().state != replication::failover::State::Retired {
                return Err(ControlError::colo(Refused::InPair));
            }
        }
        self.primary = None;
        self.not_migrating()?;
        // A VM booted from --firmware too: the secondary is given the same
        // image (--firmware), which the initial sync's manifest check
        // compares by size and SHA-256 before any memory moves.
        check_pair(&params)?;
        self.vm
            .transport()
            .check(&params.to)
            .map_err(ControlError::colo)?;
        let primary = crate::colo::primary::Primary::start(self.vm.clone(), params, arbiter)
            .map_err(|e| ControlError::colo(Refused::Thread("its thread", e)))?;
        self.colo.set(primary.side().clone());
        self.primary = Some(primary);
        self.colo(ColoAsk::Status)
    }

    fn colo_reprotect(&mut self, params: crate::colo::Params) -> Result<Value, ControlError> {
        use replication::failover::State;
        let side = self
            .colo
            .get()
            .ok_or_else(|| ControlError::colo(Refused::NoPair))?;
        let state = side.report().state;
        if !matches!(state, State::PrimaryAlone | State::FailedOver) {
            let name = serde_json::to_value(state).map_err(VmOpError::Encode)?;
            return Err(ControlError::colo(Refused::NotAlone(name)));
        }
        if self.migration.as_ref().is_some_and(|m| m.active()) {
            return Err(VmOpError::Migrating.into());
        }
        check_pair(&params)?;
        self.vm
            .transport()
            .check(&params.to)
            .map_err(ControlError::colo)?;
        side.request_reprotect(params);
        self.colo(ColoAsk::Status)
    }

    fn colo(&mut self, ask: ColoAsk) -> Result<Value, ControlError> {
        let side = self
            .colo
            .get()
            .ok_or_else(|| ControlError::colo(Refused::NoPair))?;
        match ask {
            ColoAsk::Status => {}
            ColoAsk::Failover => side.force_failover(),
            ColoAsk::Checkpoint => side.checkpoint_now(),
        }
        let report = serde_json::to_value(side.report()).map_err(VmOpError::Encode)?;
        Ok(json!({ "colo": report }))
    }
}

/// Checks a pair's timing and compare queue.
fn check_pair(params: &crate::colo::Params) -> Result<(), ControlError> {
    crate::colo::check_timing(
        params.checkpoint_period_ms,
        params.heartbeat_ms,
        params.heartbeat_timeout_ms,
    )
    .map_err(|e| ControlError::colo(Refused::Invalid(e)))?;
    if !(1..=65536).contains(&params.max_queue) || params.compare_timeout_ms == 0 {
        return Err(ControlError::colo(Refused::Queue));
    }
    let most = migration::protocol::colo::MAX_CHANNELS;
    if !(1..=most).contains(&params.channels) {
        return Err(ControlError::colo(Refused::Channels(params.channels, most)));
    }
    Ok(())
}

impl VmControl {
    /// Refuses what would change the VM under a migration, or run,
    /// save or replace an incoming VM that holds no guest yet.
    fn not_migrating(&self) -> Result<(), ControlError> {
        if self.vm.is_empty() {
            return Err(VmOpError::Empty.into());
        }
        if let Some(side) = self.colo.get() {
            use replication::failover::State;
            if matches!(side.report().state, State::Syncing | State::Protected) {
                return Err(ControlError::colo(Refused::Paired));
            }
        }
        match &self.migration {
            Some(m) if m.active() => Err(VmOpError::Migrating.into()),
            _ => Ok(()),
        }
    }

    fn migration_json(&self) -> Result<Value, ControlError> {
        let m = self
            .migration
            .as_ref()
            .ok_or_else(|| ControlError::migration(Refused::NoneStarted))?;
        let status = serde_json::to_value(m.status()).map_err(VmOpError::Encode)?;
        Ok(json!({ "migration": status }))
    }

    /// `dirty_log read`: the pages written since the log started or was
    /// last read, by source, then reset.
    fn dirty_read(&mut self, ram: &GuestRam) -> Result<Value, ControlError> {
        if !ram.logging() {
            return Err(VmOpError::DirtyLogOff.into());
        }
        let slots = ram.harvest()?;
        ram.clear_all()?;
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
}

/// Stands in for the VM until it runs (the API is bound before that).
pub struct NoControl;

impl Control for NoControl {
    fn status(&mut self) -> Value {
        json!({"state": "starting"})
    }
    fn pause(&mut self) -> Result<f64, ControlError> {
        Err(VmOpError::Starting.into())
    }
    fn resume(&mut self) -> Result<(), ControlError> {
        Err(VmOpError::Starting.into())
    }
    fn metrics(&mut self) -> Value {
        json!({})
    }
    fn shutdown(&mut self) {}
    fn snapshot(&mut self, _: &Path) -> Result<Value, ControlError> {
        Err(VmOpError::Starting.into())
    }
}

//! The COLO primary's thread ("colo"), started by the `colo_start` API
//! verb on a running VM: takes the lease, runs the pair
//! ([`super::pair::protect`]), and holds the lease as long as this VM
//! serves (alone, then: [`super::survivor`]).
//!
//! Never does: release the lease while this VM may serve (the survivor
//! holds it), or start a second thread for the same side.

use std::sync::Arc;
use std::thread::JoinHandle;

use replication::failover::Role;

use super::arbiter::ArbiterSpec;
use super::pair::{not_started, protect};
use super::survivor::Survivor;
use super::{Params, Report, Side};
use crate::migrate::VmLink;

/// The primary's side of a pair: its thread and its report.
pub struct Primary {
    side: Arc<Side>,
    thread: Option<JoinHandle<()>>,
}

impl Primary {
    /// Starts the pair's thread on `vm`.
    pub fn start(vm: VmLink, params: Params, arbiter: ArbiterSpec) -> std::io::Result<Primary> {
        let side = Arc::new(Side::new(Report {
            channels: params.channels,
            heartbeat_ms: params.heartbeat_ms,
            heartbeat_timeout_ms: params.heartbeat_timeout_ms,
            checkpoint_period_ms: Some(params.checkpoint_period_ms),
            ..Report::new(
                Role::Primary,
                params.to.to_string(),
                arbiter.to_string(),
                vm.transport().name(&params.to),
            )
        }));
        let s = side.clone();
        let thread = std::thread::Builder::new()
            .name("colo".into())
            .spawn(move || {
                crate::sandbox::confine(crate::sandbox::Kind::Stream);
                run(&vm, &params, &arbiter, s)
            })?;
        Ok(Primary {
            side,
            thread: Some(thread),
        })
    }

    pub fn side(&self) -> &Arc<Side> {
        &self.side
    }

    /// Whether the pair's thread still runs (it ends only when the pair
    /// could not start, this side fenced and lost, or the VMM ends).
    pub fn active(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for Primary {
    fn drop(&mut self) {
        self.side.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread's body: the lease, the pair, then this VM as the pair's
/// survivor (alone, or fenced) until the VMM ends.
fn run(vm: &VmLink, params: &Params, arbiter: &ArbiterSpec, side_arc: Arc<Side>) {
    let id = format!("primary pid {}", std::process::id());
    let mut lease = match arbiter.open(&id) {
        Ok(l) => l,
        Err(e) => return not_started(&side_arc, e.into()),
    };
    match protect(vm, params, &side_arc, &mut *lease, false) {
        Ok(ended) => Survivor::new(vm, side_arc.clone(), ended).run(&mut *lease),
        Err(e) => not_started(&side_arc, e),
    }
}

//! A COLO side that serves alone once its pair ended: a primary whose
//! secondary was lost (`primary_alone`) or a secondary that took over
//! (`failed_over`), and how it is protected again (`colo_reprotect`).
//!
//! Runs on that side's thread (the primary's `colo`, the secondary's
//! `incoming`) until the VMM ends. It ticks the failover state machine,
//! which fences this side when its lease is lost (the proxy's output shut,
//! the guest paused; the arbiter renews the lease by itself), and a fenced
//! side ends as soon as the arbiter answers who holds the lease.
//!
//! Re-protect: this VM becomes the primary of a new pair with a new
//! secondary (waiting as `tandem run --colo secondary` does), keeping its
//! lease throughout: its NICs go back onto their taps (an alone primary's
//! proxy ends and gives them up), then the pair starts as `colo_start`'s
//! does (a full sync while the guest runs, the disks' sums, checkpoints).
//! A pair that does not start leaves this VM serving alone as before; one
//! that ends leaves it the survivor again, so it can be re-protected again.
//!
//! Never does: give the lease up while this VM may serve; re-protect a
//! side that is not serving alone, or a secondary that serves through its
//! takeover proxy (connections opened before its takeover whose sequence
//! numbers it rewrites: a new pair's compare does not know them).

use std::sync::Arc;
use std::time::{Duration, Instant};

use replication::arbiter::Arbiter;
use replication::failover::{Action, Failover, Role, State};

use super::arbiter::Fence;
use super::pair::{self, Ended};
use super::proxy::Proxy;
use super::{Params, Side};
use crate::migrate::VmLink;
use crate::vstate::exit::VmExit;

/// The turn.
const TURN: Duration = Duration::from_millis(50);
/// How often a fenced side asks the arbiter who holds the lease.
const ASK_EVERY: Duration = Duration::from_millis(500);
/// How long a NIC's move back onto its tap may take.
const ATTACH_WAIT: Duration = Duration::from_secs(5);

/// See the module doc.
pub struct Survivor<'a> {
    vm: &'a VmLink,
    side: Arc<Side>,
    fo: Failover,
    fence: Fence,
    /// The proxy its output goes through, if any: an alone primary's, or a
    /// secondary's that serves through it.
    proxy: Option<Proxy>,
    /// Why the last re-protect was refused or failed (the report's reason
    /// until the next).
    note: Option<String>,
}

impl<'a> Survivor<'a> {
    /// The survivor of the pair `ended`.
    pub fn new(vm: &'a VmLink, side: Arc<Side>, ended: Ended) -> Survivor<'a> {
        Self::with(vm, side, ended.fo, ended.fence, Some(ended.proxy))
    }

    /// A survivor in state `fo`, its output through `proxy` if any.
    pub fn with(
        vm: &'a VmLink,
        side: Arc<Side>,
        fo: Failover,
        fence: Fence,
        proxy: Option<Proxy>,
    ) -> Survivor<'a> {
        Survivor {
            vm,
            side,
            fo,
            fence,
            proxy,
            note: None,
        }
    }

    /// Until the VMM ends, or this side fenced and learned that it lost.
    pub fn run(mut self, lease: &mut dyn Arbiter) {
        let mut asked = Instant::now();
        loop {
            if Side::take(&self.side.stop) {
                return;
            }
            if let Some(params) = self.side.take_reprotect() {
                self.reprotect(&params, lease);
            }
            if self.fo.state() == State::Fenced {
                if asked.elapsed() >= ASK_EVERY {
                    asked = Instant::now();
                    if let Some(why) = super::arbiter::lost(lease) {
                        self.report(lease);
                        self.vm.exit().signal(VmExit::Fenced(why));
                        return;
                    }
                }
            } else if self.fo.tick(Instant::now(), lease).contains(&Action::Fence) {
                self.fence_now();
            }
            self.report(lease);
            std::thread::sleep(TURN);
        }
    }

    fn fence_now(&self) {
        self.fence.shut();
        let why = self.fo.status(Instant::now()).reason.unwrap_or_default();
        eprintln!("tandem: COLO: fenced, the guest is paused: {why}");
        if let Err(e) = self.vm.pause() {
            log::error!("COLO: cannot pause the fenced guest: {e}");
        }
    }

    /// A new pair with this VM as its primary (see the module doc).
    fn reprotect(&mut self, params: &Params, lease: &mut dyn Arbiter) {
        if let Err(why) = self.ready() {
            log::warn!("COLO: re-protect refused: {why}");
            self.note = Some(format!("re-protect refused: {why}"));
            return;
        }
        eprintln!(
            "tandem: COLO: re-protecting: a new secondary at {}",
            params.to
        );
        self.side.renew(params);
        self.note = None;
        match pair::protect(self.vm, params, &self.side, lease, true) {
            Ok(ended) => {
                self.fo = ended.fo;
                self.fence = ended.fence;
                self.proxy = Some(ended.proxy);
            }
            Err(e) => {
                eprintln!(
                    "tandem: COLO: re-protect to {} failed: {e}; this VM serves on alone",
                    params.to
                );
                self.note = Some(format!("re-protect failed: {e}"));
            }
        }
    }

    /// Whether this side may be re-protected now; an alone primary's NICs
    /// go back onto their taps.
    fn ready(&mut self) -> Result<(), String> {
        let state = self.fo.state();
        if !matches!(state, State::PrimaryAlone | State::FailedOver) {
            return Err(format!("this side is {state:?}, not serving alone"));
        }
        if self.fo.role() == Role::Secondary {
            if self.proxy.is_some() {
                return Err("this VM serves connections opened before its takeover \
                            through its proxy (their sequence numbers rewritten); a new \
                            pair could not carry them"
                    .into());
            }
            return Ok(());
        }
        // The proxy ends and closes the taps; each NIC opens its own again.
        self.proxy = None;
        for slot in self.vm.virtio().iter() {
            if let Some(r) = slot.attach_tap(ATTACH_WAIT) {
                r?;
            }
        }
        Ok(())
    }

    fn report(&self, lease: &dyn Arbiter) {
        let s = self.fo.status(Instant::now());
        let info = lease.describe();
        let role = self.fo.role();
        self.side.update(|r| {
            r.role = role;
            r.state = s.state;
            r.epoch = s.epoch;
            r.reason = self.note.clone().or(s.reason);
            r.lease = Some(info);
        });
    }
}

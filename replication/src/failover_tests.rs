use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::*;
use crate::arbiter::tests::TempDir;
use crate::arbiter::{ArbiterInfo, LockFileLease};

/// The lease both sides see, for the mock arbiter.
#[derive(Debug, Default)]
struct Shared {
    holder: Option<u32>,
    mark: Option<u64>,
    fail_acquire: bool,
    fail_mark: bool,
    fail_read: bool,
}

/// One side's handle on the shared mock lease.
struct Mock {
    id: u32,
    shared: Arc<Mutex<Shared>>,
}

fn pair_of_mocks() -> (Mock, Mock, Arc<Mutex<Shared>>) {
    let shared = Arc::new(Mutex::new(Shared::default()));
    let p = Mock {
        id: 1,
        shared: shared.clone(),
    };
    let s = Mock {
        id: 2,
        shared: shared.clone(),
    };
    (p, s, shared)
}

fn io_err() -> ArbiterError {
    ArbiterError::Lock {
        path: "mock".into(),
        source: std::io::Error::other("injected"),
    }
}

impl Arbiter for Mock {
    fn try_acquire(&mut self) -> Result<bool, ArbiterError> {
        let mut s = self.shared.lock().unwrap();
        if s.fail_acquire {
            return Err(io_err());
        }
        match s.holder {
            None => {
                s.holder = Some(self.id);
                Ok(true)
            }
            Some(h) => Ok(h == self.id),
        }
    }
    fn holds(&self) -> bool {
        self.shared.lock().unwrap().holder == Some(self.id)
    }
    fn release(&mut self) {
        let mut s = self.shared.lock().unwrap();
        if s.holder == Some(self.id) {
            s.holder = None;
        }
    }
    fn mark_alone(&mut self, epoch: u64) -> Result<(), ArbiterError> {
        let mut s = self.shared.lock().unwrap();
        assert_eq!(s.holder, Some(self.id), "marked without the lease");
        if s.fail_mark {
            return Err(io_err());
        }
        s.mark = Some(epoch);
        Ok(())
    }
    fn clear_alone(&mut self) -> Result<(), ArbiterError> {
        self.shared.lock().unwrap().mark = None;
        Ok(())
    }
    fn alone_mark(&self) -> Result<Option<u64>, ArbiterError> {
        let s = self.shared.lock().unwrap();
        if s.fail_read {
            return Err(io_err());
        }
        Ok(s.mark)
    }
    fn gate(&self) -> crate::arbiter::Gate {
        crate::arbiter::Gate::closed()
    }
    fn current_holder(&mut self) -> Result<Option<String>, ArbiterError> {
        Ok(self.shared.lock().unwrap().holder.map(|h| h.to_string()))
    }
    fn describe(&self) -> ArbiterInfo {
        ArbiterInfo {
            kind: "mock",
            resource: String::new(),
            held: self.holds(),
            holder: None,
            ttl_left: None,
        }
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A protected pair at epoch 5, both sides started at `t0`.
fn protected_pair(t0: Instant, pa: &mut dyn Arbiter) -> (Failover, Failover) {
    let mut p = Failover::primary(Config::default(), t0, pa).unwrap();
    let mut s = Failover::secondary(Config::default(), t0);
    for e in 1..=5 {
        p.checkpoint_committed(e).unwrap();
        s.checkpoint_committed(e).unwrap();
    }
    (p, s)
}

#[test]
fn defaults() {
    let c = Config::default();
    assert_eq!((c.interval, c.timeout), (ms(100), ms(1000)));
}

#[test]
fn a_primary_needs_the_lease() {
    let (mut a, mut b, _) = pair_of_mocks();
    assert!(b.try_acquire().unwrap());
    let t0 = Instant::now();
    assert!(matches!(
        Failover::primary(Config::default(), t0, &mut a),
        Err(FailoverError::LeaseBusy)
    ));
    b.release();
    let p = Failover::primary(Config::default(), t0, &mut a).unwrap();
    assert_eq!((p.role(), p.state()), (Role::Primary, State::Syncing));
    assert!(p.serves());
}

#[test]
fn heartbeats_go_out_every_interval() {
    let (mut pa, mut sa, _) = pair_of_mocks();
    let t0 = Instant::now();
    let (mut p, mut s) = protected_pair(t0, &mut pa);
    assert_eq!(p.tick(t0, &mut pa), vec![Action::SendHeartbeat]);
    assert_eq!(p.tick(t0 + ms(50), &mut pa), vec![]);
    assert_eq!(p.tick(t0 + ms(100), &mut pa), vec![Action::SendHeartbeat]);
    assert_eq!(s.tick(t0 + ms(10), &mut sa), vec![Action::SendHeartbeat]);
    assert_eq!(s.tick(t0 + ms(109), &mut sa), vec![]);
}

#[test]
fn next_tick_is_the_next_heartbeat_or_the_silence_limit() {
    let (mut pa, _, _) = pair_of_mocks();
    let t0 = Instant::now();
    let (mut p, _) = protected_pair(t0, &mut pa);
    assert_eq!(p.next_tick(t0), ms(0));
    p.tick(t0, &mut pa);
    assert_eq!(p.next_tick(t0 + ms(30)), ms(70));
    // The peer last heard at t0: its silence ends the wait at t0 + 1 s.
    p.tick(t0 + ms(950), &mut pa);
    assert_eq!(p.next_tick(t0 + ms(960)), ms(40));
    p.heartbeat_received(t0 + ms(960));
    assert_eq!(p.next_tick(t0 + ms(960)), ms(90));
}

#[test]
fn first_checkpoint_protects_and_epochs_increase() {
    let t0 = Instant::now();
    let mut s = Failover::secondary(Config::default(), t0);
    assert_eq!(s.state(), State::Syncing);
    assert!(!s.serves());
    s.checkpoint_committed(0).unwrap();
    assert_eq!(s.state(), State::Protected);
    s.checkpoint_committed(3).unwrap();
    assert!(matches!(
        s.checkpoint_committed(3),
        Err(FailoverError::EpochNotIncreasing { last: 3, got: 3 })
    ));
    assert_eq!(s.epoch(), 3);
}

#[test]
fn heartbeat_resuming_before_timeout_changes_nothing() {
    let (mut pa, mut sa, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (mut p, mut s) = protected_pair(t0, &mut pa);
    // Silent for 999 ms, then a heartbeat: no loss at 1000 ms or 1500 ms.
    p.tick(t0 + ms(999), &mut pa);
    s.tick(t0 + ms(999), &mut sa);
    p.heartbeat_received(t0 + ms(999));
    s.heartbeat_received(t0 + ms(999));
    for t in [1000, 1500, 1999] {
        let pa_actions = p.tick(t0 + ms(t), &mut pa);
        let sa_actions = s.tick(t0 + ms(t), &mut sa);
        assert!(pa_actions.iter().all(|a| *a == Action::SendHeartbeat));
        assert!(sa_actions.iter().all(|a| *a == Action::SendHeartbeat));
    }
    assert_eq!((p.state(), s.state()), (State::Protected, State::Protected));
    assert_eq!(shared.lock().unwrap().mark, None);
    assert_eq!(s.status(t0 + ms(1999)).last_heartbeat_age_ms, 1000);
}

#[test]
fn timeout_is_strictly_past() {
    let (mut pa, _, _) = pair_of_mocks();
    let t0 = Instant::now();
    let (mut p, _) = protected_pair(t0, &mut pa);
    assert_eq!(p.tick(t0 + ms(1000), &mut pa), vec![Action::SendHeartbeat]);
    assert_eq!(p.state(), State::Protected);
    let a = p.tick(t0 + ms(1001), &mut pa);
    assert_eq!(a, vec![Action::StopReplication, Action::GoAlone]);
}

#[test]
fn secondary_death_primary_goes_alone_after_marking() {
    let (mut pa, _, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (mut p, _) = protected_pair(t0, &mut pa);
    let a = p.tick(t0 + ms(1500), &mut pa);
    assert_eq!(a, vec![Action::StopReplication, Action::GoAlone]);
    assert_eq!(p.state(), State::PrimaryAlone);
    assert!(p.serves());
    assert_eq!(shared.lock().unwrap().mark, Some(6), "epoch 5 + 1");
    // Later ticks: nothing more, no heartbeats; late heartbeats are ignored.
    p.heartbeat_received(t0 + ms(1600));
    assert_eq!(p.tick(t0 + ms(1700), &mut pa), vec![]);
    assert_eq!(p.state(), State::PrimaryAlone);
    let st = p.status(t0 + ms(1700));
    assert!(st.reason.unwrap().contains("serving alone from epoch 6"));
}

#[test]
fn protected_primary_without_the_lease_goes_on_until_the_peer_is_lost() {
    let (mut pa, _, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (mut p, _) = protected_pair(t0, &mut pa);
    // The lease cannot be renewed (etcd away): while the secondary answers,
    // the pair stays protected (the secondary covers the output and does
    // not serve).
    shared.lock().unwrap().holder = None;
    shared.lock().unwrap().fail_acquire = true;
    p.heartbeat_received(t0 + ms(500));
    assert_eq!(p.tick(t0 + ms(600), &mut pa), vec![Action::SendHeartbeat]);
    assert_eq!(p.state(), State::Protected);
    assert!(p.serves());
    // Then the peer is lost too: it cannot go alone without the lease.
    let a = p.tick(t0 + ms(1700), &mut pa);
    assert_eq!(a, vec![Action::StopReplication, Action::Fence]);
    assert_eq!(p.state(), State::Fenced);
}

#[test]
fn primary_that_cannot_hold_the_lease_fences() {
    let (mut pa, _, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (mut p, _) = protected_pair(t0, &mut pa);
    // The lease was lost (e.g. taken after a TTL) and is held elsewhere:
    // the peer's loss fences it.
    shared.lock().unwrap().holder = Some(9);
    let a = p.tick(t0 + ms(1500), &mut pa);
    assert_eq!(a, vec![Action::StopReplication, Action::Fence]);
    assert_eq!(p.state(), State::Fenced);
    assert!(!p.serves());
    assert_eq!(shared.lock().unwrap().mark, None);
}

#[test]
fn primary_that_cannot_mark_fences() {
    let (mut pa, _, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (mut p, _) = protected_pair(t0, &mut pa);
    shared.lock().unwrap().fail_mark = true;
    let a = p.connection_lost(&mut pa);
    assert_eq!(a, vec![Action::StopReplication, Action::Fence]);
    assert_eq!(p.state(), State::Fenced);
    assert!(p.status(t0).reason.unwrap().contains("alone mark"));
}

#[test]
fn primary_lease_error_fences_when_the_peer_is_lost() {
    let (mut pa, _, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (mut p, _) = protected_pair(t0, &mut pa);
    shared.lock().unwrap().holder = None;
    shared.lock().unwrap().fail_acquire = true;
    assert_eq!(
        p.connection_lost(&mut pa),
        vec![Action::StopReplication, Action::Fence]
    );
    assert!(p
        .status(t0)
        .reason
        .unwrap()
        .contains("cannot hold the lease"));
}

#[test]
fn alone_primary_losing_the_lease_fences() {
    let (mut pa, _, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (mut p, _) = protected_pair(t0, &mut pa);
    p.connection_lost(&mut pa);
    assert_eq!(p.state(), State::PrimaryAlone);
    shared.lock().unwrap().holder = None;
    let a = p.tick(t0 + ms(10), &mut pa);
    assert_eq!(a, vec![Action::StopReplication, Action::Fence]);
    assert_eq!(p.tick(t0 + ms(20), &mut pa), vec![]);
}

#[test]
fn primary_death_secondary_takes_over() {
    let (mut pa, mut sa, _) = pair_of_mocks();
    let t0 = Instant::now();
    let (_p, mut s) = protected_pair(t0, &mut pa);
    drop(pa);
    // The kernel released the dead primary's lock.
    let mut shared_release = Mock {
        id: 1,
        shared: sa.shared.clone(),
    };
    shared_release.release();
    let a = s.tick(t0 + ms(1001), &mut sa);
    assert_eq!(a, vec![Action::StopReplication, Action::TakeOver]);
    assert_eq!(s.state(), State::FailingOver);
    assert!(!s.serves(), "not before the takeover is done");
    assert_eq!(s.tick(t0 + ms(1100), &mut sa), vec![]);
    s.takeover_complete().unwrap();
    assert_eq!(s.state(), State::FailedOver);
    assert!(s.serves());
    assert!(sa.holds());
    assert_eq!(s.tick(t0 + ms(1200), &mut sa), vec![]);
    assert!(matches!(
        s.takeover_complete(),
        Err(FailoverError::InvalidState(State::FailedOver))
    ));
}

#[test]
fn failed_over_secondary_losing_the_lease_fences() {
    let (mut pa, mut sa, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (_p, mut s) = protected_pair(t0, &mut pa);
    shared.lock().unwrap().holder = None;
    s.connection_lost(&mut sa);
    s.takeover_complete().unwrap();
    shared.lock().unwrap().holder = Some(7);
    assert_eq!(
        s.tick(t0 + ms(5), &mut sa),
        vec![Action::StopReplication, Action::Fence]
    );
    assert_eq!(s.state(), State::Fenced);
}

#[test]
fn cut_link_with_both_alive_makes_exactly_one_server() {
    let dir = TempDir::new("failover-cut");
    let path = dir.0.join("lease");
    let mut pa = LockFileLease::open(&path, "primary").unwrap();
    let mut sa = LockFileLease::open(&path, "secondary").unwrap();
    let t0 = Instant::now();
    let (mut p, mut s) = protected_pair(t0, &mut pa);
    // The link is cut: no heartbeats either way. Both time out.
    let a = p.tick(t0 + ms(1001), &mut pa);
    assert_eq!(a, vec![Action::StopReplication, Action::GoAlone]);
    let a = s.tick(t0 + ms(1001), &mut sa);
    assert_eq!(a, vec![Action::StopReplication]);
    assert_eq!(s.state(), State::FailingOver);
    // The secondary keeps trying every tick and never serves.
    for i in 0..50 {
        let now = t0 + ms(1100 + 100 * i);
        assert!(!s.tick(now, &mut sa).contains(&Action::TakeOver));
        // Even heartbeats coming back do not re-form the pair.
        s.heartbeat_received(now);
        assert!(p.tick(now, &mut pa).is_empty());
    }
    assert!(p.serves() && !s.serves());
    assert!(s.status(t0).reason.unwrap().contains("held by the primary"));
    // A forced failover on the secondary is refused too.
    assert!(matches!(
        s.force_failover(&mut sa),
        Err(FailoverError::InvalidState(State::FailingOver))
    ));
    // Then the primary dies: the secondary acquires the lease, finds the
    // alone mark (6 > 5) and retires instead of serving stale state.
    drop(pa);
    let a = s.tick(t0 + ms(9000), &mut sa);
    let [Action::Retire(msg)] = a.as_slice() else {
        panic!("expected Retire, got {a:?}");
    };
    assert!(
        msg.contains("epoch 6") && msg.contains("must not serve"),
        "{msg}"
    );
    assert_eq!(s.state(), State::Retired);
    assert!(!s.serves());
    assert!(!sa.holds(), "a retired secondary gives the lease back");
    assert_eq!(s.tick(t0 + ms(9100), &mut sa), vec![]);
}

#[test]
fn secondary_takes_over_with_real_lock_files() {
    let dir = TempDir::new("failover-death");
    let path = dir.0.join("lease");
    let mut pa = LockFileLease::open(&path, "primary").unwrap();
    let mut sa = LockFileLease::open(&path, "secondary").unwrap();
    let t0 = Instant::now();
    let (_p, mut s) = protected_pair(t0, &mut pa);
    drop(pa);
    assert_eq!(
        s.tick(t0 + ms(1001), &mut sa),
        vec![Action::StopReplication, Action::TakeOver]
    );
    s.takeover_complete().unwrap();
    assert!(s.serves() && sa.holds());
}

#[test]
fn an_older_alone_mark_does_not_block_a_resynced_secondary() {
    let (mut pa, mut sa, shared) = pair_of_mocks();
    let t0 = Instant::now();
    // A previous secondary was lost at epoch 5: mark 6. A new secondary
    // re-synced and committed 6 and 7.
    shared.lock().unwrap().mark = Some(6);
    let mut p = Failover::primary(Config::default(), t0, &mut pa).unwrap();
    let mut s = Failover::secondary(Config::default(), t0);
    for e in [6, 7] {
        p.checkpoint_committed(e).unwrap();
        s.checkpoint_committed(e).unwrap();
    }
    shared.lock().unwrap().holder = None;
    let a = s.connection_lost(&mut sa);
    assert_eq!(a, vec![Action::StopReplication, Action::TakeOver]);
}

#[test]
fn a_mark_equal_to_the_next_epoch_retires() {
    let (mut pa, mut sa, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (_p, mut s) = protected_pair(t0, &mut pa);
    shared.lock().unwrap().mark = Some(6);
    shared.lock().unwrap().holder = None;
    let a = s.tick(t0 + ms(2000), &mut sa);
    assert!(
        matches!(a.as_slice(), [Action::StopReplication, Action::Retire(_)]),
        "{a:?}"
    );
    assert_eq!(shared.lock().unwrap().holder, None);
}

#[test]
fn an_unreadable_mark_never_serves() {
    let (mut pa, mut sa, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (_p, mut s) = protected_pair(t0, &mut pa);
    {
        let mut sh = shared.lock().unwrap();
        sh.holder = None;
        sh.fail_read = true;
    }
    assert_eq!(
        s.tick(t0 + ms(2000), &mut sa),
        vec![Action::StopReplication]
    );
    assert_eq!(s.state(), State::FailingOver);
    assert_eq!(shared.lock().unwrap().holder, None, "lease given back");
    assert!(s.status(t0).reason.unwrap().contains("alone mark"));
    shared.lock().unwrap().fail_read = false;
    assert_eq!(s.tick(t0 + ms(2100), &mut sa), vec![Action::TakeOver]);
}

#[test]
fn lease_errors_make_the_secondary_wait() {
    let (mut pa, mut sa, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (_p, mut s) = protected_pair(t0, &mut pa);
    {
        let mut sh = shared.lock().unwrap();
        sh.holder = None;
        sh.fail_acquire = true;
    }
    assert_eq!(
        s.tick(t0 + ms(2000), &mut sa),
        vec![Action::StopReplication]
    );
    assert_eq!(s.tick(t0 + ms(2100), &mut sa), vec![]);
    shared.lock().unwrap().fail_acquire = false;
    assert_eq!(s.tick(t0 + ms(2200), &mut sa), vec![Action::TakeOver]);
}

#[test]
fn secondary_lost_during_sync_retires() {
    let (_, mut sa, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let mut s = Failover::secondary(Config::default(), t0);
    let a = s.tick(t0 + ms(1001), &mut sa);
    assert!(
        matches!(a.as_slice(), [Action::StopReplication, Action::Retire(m)]
        if m.contains("before any checkpoint"))
    );
    assert_eq!(s.state(), State::Retired);
    assert_eq!(
        shared.lock().unwrap().holder,
        None,
        "never touched the lease"
    );
}

#[test]
fn primary_lost_its_secondary_during_sync_goes_alone() {
    let (mut pa, _, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let mut p = Failover::primary(Config::default(), t0, &mut pa).unwrap();
    let a = p.tick(t0 + ms(1001), &mut pa);
    assert_eq!(a, vec![Action::StopReplication, Action::GoAlone]);
    assert_eq!(shared.lock().unwrap().mark, Some(1));
}

#[test]
fn force_failover_on_the_primary() {
    let (mut pa, _, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (mut p, _) = protected_pair(t0, &mut pa);
    let a = p.force_failover(&mut pa).unwrap();
    assert_eq!(a, vec![Action::StopReplication, Action::GoAlone]);
    assert_eq!(shared.lock().unwrap().mark, Some(6));
    assert!(p.status(t0).reason.unwrap().contains("operator"));
    assert!(matches!(
        p.force_failover(&mut pa),
        Err(FailoverError::InvalidState(State::PrimaryAlone))
    ));
}

#[test]
fn force_failover_on_the_secondary_follows_the_lease() {
    let (mut pa, mut sa, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (_p, mut s) = protected_pair(t0, &mut pa);
    // The primary is alive and holds the lease: refused, nothing changed.
    assert!(matches!(
        s.force_failover(&mut sa),
        Err(FailoverError::LeaseBusy)
    ));
    assert_eq!(s.state(), State::Protected);
    // Free lease: takes over.
    shared.lock().unwrap().holder = None;
    let a = s.force_failover(&mut sa).unwrap();
    assert_eq!(a, vec![Action::StopReplication, Action::TakeOver]);
    s.takeover_complete().unwrap();
    assert!(s.serves());
}

#[test]
fn force_failover_on_the_secondary_retires_on_a_newer_mark() {
    let (mut pa, mut sa, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (_p, mut s) = protected_pair(t0, &mut pa);
    shared.lock().unwrap().holder = None;
    shared.lock().unwrap().mark = Some(9);
    let a = s.force_failover(&mut sa).unwrap();
    assert!(
        matches!(a.as_slice(), [Action::StopReplication, Action::Retire(_)]),
        "{a:?}"
    );
    assert_eq!(s.state(), State::Retired);
}

#[test]
fn force_failover_on_a_syncing_secondary_is_refused() {
    let (_, mut sa, _) = pair_of_mocks();
    let mut s = Failover::secondary(Config::default(), Instant::now());
    assert!(matches!(
        s.force_failover(&mut sa),
        Err(FailoverError::NothingCommitted)
    ));
    assert_eq!(s.state(), State::Syncing);
}

#[test]
fn takeover_failure_retires_and_releases() {
    let (mut pa, mut sa, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (_p, mut s) = protected_pair(t0, &mut pa);
    shared.lock().unwrap().holder = None;
    s.connection_lost(&mut sa);
    let a = s.takeover_failed("no tap", &mut sa);
    assert!(matches!(a.as_slice(), [Action::Retire(m)] if m.contains("no tap")));
    assert_eq!(shared.lock().unwrap().holder, None);
    assert!(s.takeover_failed("again", &mut sa).is_empty());
}

#[test]
fn status_reports_the_side() {
    let (mut pa, _, _) = pair_of_mocks();
    let t0 = Instant::now();
    let (p, _) = protected_pair(t0, &mut pa);
    let st = p.status(t0 + ms(250));
    assert_eq!(
        st,
        Status {
            role: Role::Primary,
            state: State::Protected,
            last_heartbeat_age_ms: 250,
            epoch: 5,
            reason: None,
        }
    );
}

#[test]
fn commits_after_the_pair_broke_are_refused() {
    let (mut pa, _, _) = pair_of_mocks();
    let t0 = Instant::now();
    let (mut p, _) = protected_pair(t0, &mut pa);
    p.connection_lost(&mut pa);
    assert!(matches!(
        p.checkpoint_committed(6),
        Err(FailoverError::InvalidState(State::PrimaryAlone))
    ));
    assert!(p.connection_lost(&mut pa).is_empty());
}

/// What `colo-status` and the metrics JSON will show: snake_case names.
#[test]
fn states_and_reasons_serialize_in_snake_case() {
    let name = |v: serde_json::Value| v.as_str().unwrap_or_default().to_string();
    assert_eq!(
        name(serde_json::json!(State::PrimaryAlone)),
        "primary_alone"
    );
    assert_eq!(name(serde_json::json!(State::FailingOver)), "failing_over");
    assert_eq!(name(serde_json::json!(State::FailedOver)), "failed_over");
    assert_eq!(name(serde_json::json!(Role::Secondary)), "secondary");
    assert_eq!(
        name(serde_json::json!(crate::schedule::Reason::Mismatch)),
        "mismatch"
    );
    assert_eq!(
        name(serde_json::json!(crate::schedule::Reason::Queue)),
        "queue"
    );
}

#[test]
fn a_primary_giving_up_goes_alone_with_its_reason() {
    let (mut pa, mut sa, shared) = pair_of_mocks();
    let t0 = Instant::now();
    let (mut p, mut s) = protected_pair(t0, &mut pa);
    // A secondary cannot give up; nothing changes.
    assert!(s.give_up("no", &mut sa).is_empty());
    assert_eq!(s.state(), State::Protected);
    let a = p.give_up("the guest wrote to a disk", &mut pa);
    assert_eq!(a, vec![Action::StopReplication, Action::GoAlone]);
    assert_eq!(p.state(), State::PrimaryAlone);
    assert_eq!(shared.lock().unwrap().mark, Some(6));
    assert!(p.status(t0).reason.unwrap().contains("disk"));
    // Once the pair is over, again is nothing.
    assert!(p.give_up("again", &mut pa).is_empty());
}

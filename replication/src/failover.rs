//! The pair's state machine: roles, the heartbeat, and who may serve after
//! a failure (design.md §6, Failover and Arbiter).
//!
//! Owns one side's [`State`], the heartbeat timing, the last committed
//! checkpoint epoch and the reason of the last failover or fence. Run by
//! the VMM thread (or the checkpoint thread), which sends and receives the
//! heartbeats, reports committed checkpoints and carries out the
//! [`Action`]s returned. It never reads a clock (every call takes `now`),
//! never does I/O except through the [`Arbiter`] it is handed, and never
//! lets a side serve without the lease: who may serve is decided by the
//! arbiter, never guessed from a silent peer.
//!
//! ```text
//!  primary:   Syncing ─first checkpoint→ Protected
//!             Syncing|Protected ─peer lost, lease held, alone marked→ PrimaryAlone
//!             PrimaryAlone ─lease lost or not holdable→ Fenced
//!             (Syncing|Protected without a renewable lease go on while
//!             the secondary answers: it covers the output and cannot
//!             serve; the peer lost then, the lease is needed to go alone)
//!  secondary: Syncing ─first checkpoint→ Protected
//!             Syncing ─primary lost (nothing committed)→ Retired
//!             Protected ─primary lost→ FailingOver (waits for the lease)
//!             FailingOver ─lease acquired, no newer alone mark→ TakeOver … FailedOver
//!             FailingOver ─lease acquired, newer alone mark→ Retired
//!             FailedOver ─lease lost→ Fenced
//! ```
//!
//! Epochs: checkpoint `n` commits the state at the end of interval `n`;
//! output released in interval `n + 1` follows it. A primary going alone
//! after committing epoch `e` marks `e + 1` (the first interval whose
//! output the secondary does not cover); a secondary whose last committed
//! epoch is `c` retires when it finds a mark `m > c`. A secondary re-synced
//! after the primary went alone commits an epoch ≥ the mark and may serve.
//!
//! Peer loss is final for the pair: once a side declared its peer lost, a
//! heartbeat that comes back changes nothing (re-protection is a new
//! pair, started from `Syncing`).

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::arbiter::{Arbiter, ArbiterError};

/// Which side this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Primary,
    Secondary,
}

/// One side's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// The pair is forming: no checkpoint committed yet.
    Syncing,
    /// Checkpoints commit; the primary's output waits for the compare.
    Protected,
    /// Secondary: the primary is lost; taking over once it holds the lease.
    FailingOver,
    /// Primary: serving without the secondary, unprotected.
    PrimaryAlone,
    /// Secondary: serving the client in the primary's place.
    FailedOver,
    /// A secondary that must not serve.
    Retired,
    /// Lost (or could not hold) the lease: must not release output.
    Fenced,
}

/// What the caller must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send a heartbeat to the peer now.
    SendHeartbeat,
    /// Drop the peer: close the replication stream, stop checkpoints.
    StopReplication,
    /// Secondary: become the VM that serves (swap its NIC onto its tap,
    /// merge the disk overlay, keep rewriting TCP sequences), then call
    /// [`Failover::takeover_complete`] or [`Failover::takeover_failed`].
    TakeOver,
    /// Primary: release frames without compare.
    GoAlone,
    /// Stop and never serve; the message says why.
    Retire(String),
    /// Stop releasing output and pause the guest: the lease is not ours.
    Fence,
}

/// Errors of a call the state does not allow. Arbiter errors during a
/// transition are not errors of the call: they decide the transition
/// (fence, or wait) and are kept as its reason.
#[derive(Debug, thiserror::Error)]
pub enum FailoverError {
    #[error("checkpoint epoch {got} does not follow the last committed epoch {last}")]
    EpochNotIncreasing { last: u64, got: u64 },
    #[error("not allowed in state {0:?}")]
    InvalidState(State),
    #[error("the lease is held by the other side (is the primary alive?)")]
    LeaseBusy,
    #[error("no checkpoint committed yet: this secondary has nothing to serve")]
    NothingCommitted,
    #[error("the arbiter failed")]
    Arbiter(#[from] ArbiterError),
}

/// Heartbeat timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// How often a heartbeat is sent.
    pub interval: Duration,
    /// The peer is lost when nothing came from it for longer than this.
    pub timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(1000),
        }
    }
}

/// One side's status, as reported (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Status {
    pub role: Role,
    pub state: State,
    /// Time since the peer's last heartbeat (or since the start).
    pub last_heartbeat_age_ms: u64,
    /// The last committed checkpoint epoch (0: none).
    pub epoch: u64,
    /// Why the last failover, go-alone, retirement or fence happened.
    pub reason: Option<String>,
}

/// One side of the pair; see the module doc.
#[derive(Debug, Clone)]
pub struct Failover {
    role: Role,
    state: State,
    config: Config,
    last_heartbeat: Instant,
    last_sent: Option<Instant>,
    epoch: u64,
    committed: bool,
    takeover_issued: bool,
    reason: Option<String>,
}

impl Failover {
    /// The primary's side. It serves from the start, so it must hold the
    /// lease first: `LeaseBusy` if another side holds it.
    pub fn primary(
        config: Config,
        now: Instant,
        arbiter: &mut dyn Arbiter,
    ) -> Result<Self, FailoverError> {
        if !arbiter.try_acquire()? {
            return Err(FailoverError::LeaseBusy);
        }
        Ok(Self::new(Role::Primary, config, now))
    }

    /// The secondary's side: it does not serve, and does not touch the
    /// lease until it has to take over.
    pub fn secondary(config: Config, now: Instant) -> Self {
        Self::new(Role::Secondary, config, now)
    }

    fn new(role: Role, config: Config, now: Instant) -> Self {
        Failover {
            role,
            state: State::Syncing,
            config,
            last_heartbeat: now,
            last_sent: None,
            epoch: 0,
            committed: false,
            takeover_issued: false,
            reason: None,
        }
    }

    pub fn role(&self) -> Role {
        self.role
    }

    pub fn state(&self) -> State {
        self.state
    }

    /// The last committed checkpoint epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether this side may release output to the client now (the primary
    /// without or after compare, the secondary after taking over).
    pub fn serves(&self) -> bool {
        match self.role {
            Role::Primary => matches!(
                self.state,
                State::Syncing | State::Protected | State::PrimaryAlone
            ),
            Role::Secondary => self.state == State::FailedOver,
        }
    }

    /// The peer's heartbeat (or any sign of life from it) arrived at `now`.
    /// Ignored once the peer was declared lost.
    pub fn heartbeat_received(&mut self, now: Instant) {
        if self.pair_alive() && now > self.last_heartbeat {
            self.last_heartbeat = now;
        }
    }

    /// Checkpoint `epoch` is committed on this side. The first one turns
    /// `Syncing` into `Protected`.
    pub fn checkpoint_committed(&mut self, epoch: u64) -> Result<(), FailoverError> {
        if !self.pair_alive() {
            return Err(FailoverError::InvalidState(self.state));
        }
        if self.committed && epoch <= self.epoch {
            return Err(FailoverError::EpochNotIncreasing {
                last: self.epoch,
                got: epoch,
            });
        }
        self.epoch = epoch;
        self.committed = true;
        self.state = State::Protected;
        Ok(())
    }

    /// Time passes: heartbeats to send, a silent peer, a lost lease, a
    /// takeover waiting for the lease.
    pub fn tick(&mut self, now: Instant, arbiter: &mut dyn Arbiter) -> Vec<Action> {
        let mut actions = Vec::new();
        if self.needs_lease() && !arbiter.holds() {
            return self.fence("the lease is no longer held".to_string());
        }
        match self.state {
            State::Syncing | State::Protected => {
                let age = now.saturating_duration_since(self.last_heartbeat);
                if age > self.config.timeout {
                    let why = format!("no heartbeat from the peer for {} ms", age.as_millis());
                    return self.peer_lost(why, arbiter);
                }
                let send = self
                    .last_sent
                    .is_none_or(|t| now.saturating_duration_since(t) >= self.config.interval);
                if send {
                    self.last_sent = Some(now);
                    actions.push(Action::SendHeartbeat);
                }
            }
            State::FailingOver if !self.takeover_issued => {
                actions.extend(self.try_take_over(arbiter));
            }
            _ => {}
        }
        actions
    }

    /// How long until [`Failover::tick`] has something to do on its own
    /// (the next heartbeat to send, or the peer's silence to notice):
    /// the longest its caller may wait without missing either.
    pub fn next_tick(&self, now: Instant) -> Duration {
        if !matches!(self.state, State::Syncing | State::Protected) {
            return self.config.interval;
        }
        let silence = (self.last_heartbeat + self.config.timeout).saturating_duration_since(now);
        let send = self.last_sent.map_or(Duration::ZERO, |t| {
            (t + self.config.interval).saturating_duration_since(now)
        });
        send.min(silence)
    }

    /// The replication stream broke (EOF, reset): the peer is lost now,
    /// without waiting for the heartbeat timeout.
    pub fn connection_lost(&mut self, arbiter: &mut dyn Arbiter) -> Vec<Action> {
        if !self.pair_alive() {
            return Vec::new();
        }
        self.peer_lost("the replication connection broke".to_string(), arbiter)
    }

    /// The `colo-failover` command. Primary: go on alone (same lease rules
    /// as a lost secondary). Secondary: take over now if the lease can be
    /// acquired; refused, with nothing changed, while the other side holds
    /// it or before any checkpoint was committed.
    pub fn force_failover(
        &mut self,
        arbiter: &mut dyn Arbiter,
    ) -> Result<Vec<Action>, FailoverError> {
        if !self.pair_alive() {
            return Err(FailoverError::InvalidState(self.state));
        }
        let why = "failover forced by the operator".to_string();
        if self.role == Role::Primary {
            return Ok(self.peer_lost(why, arbiter));
        }
        if !self.committed {
            return Err(FailoverError::NothingCommitted);
        }
        if !arbiter.try_acquire()? {
            return Err(FailoverError::LeaseBusy);
        }
        self.state = State::FailingOver;
        self.reason = Some(why);
        let mut actions = vec![Action::StopReplication];
        actions.extend(self.try_take_over(arbiter));
        Ok(actions)
    }

    /// The primary ends the pair for a reason of its own (`why`): it goes
    /// on alone under the same lease rules as after a lost secondary.
    /// Nothing for a secondary or a pair already over.
    pub fn give_up(&mut self, why: &str, arbiter: &mut dyn Arbiter) -> Vec<Action> {
        if self.role != Role::Primary || !self.pair_alive() {
            return Vec::new();
        }
        self.peer_lost(why.to_string(), arbiter)
    }

    /// The caller finished the takeover: the secondary serves.
    pub fn takeover_complete(&mut self) -> Result<(), FailoverError> {
        if self.state != State::FailingOver || !self.takeover_issued {
            return Err(FailoverError::InvalidState(self.state));
        }
        self.state = State::FailedOver;
        Ok(())
    }

    /// The caller could not take over (e.g. the tap): the secondary gives
    /// the lease back and retires.
    pub fn takeover_failed(&mut self, why: &str, arbiter: &mut dyn Arbiter) -> Vec<Action> {
        if self.state != State::FailingOver || !self.takeover_issued {
            return Vec::new();
        }
        arbiter.release();
        self.retire(format!("takeover failed: {why}"))
    }

    /// This side's status.
    pub fn status(&self, now: Instant) -> Status {
        let age = now.saturating_duration_since(self.last_heartbeat);
        Status {
            role: self.role,
            state: self.state,
            last_heartbeat_age_ms: u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
            epoch: self.epoch,
            reason: self.reason.clone(),
        }
    }

    /// Whether this side serves without its peer, or is taking over, so
    /// must hold the lease at every moment. A primary in the pair does
    /// not: its output is the secondary's too, and the secondary, which
    /// still answers it, does not serve (the vmm's peer gate bounds that
    /// in time); it needs the lease again to go alone.
    fn needs_lease(&self) -> bool {
        match self.role {
            Role::Primary => self.state == State::PrimaryAlone,
            Role::Secondary => {
                self.state == State::FailedOver
                    || (self.state == State::FailingOver && self.takeover_issued)
            }
        }
    }

    /// Whether the pair is still formed (heartbeats count).
    fn pair_alive(&self) -> bool {
        matches!(self.state, State::Syncing | State::Protected)
    }

    /// The peer is lost (`why`): the primary goes alone under the lease or
    /// fences; the secondary starts to take over or retires.
    fn peer_lost(&mut self, why: String, arbiter: &mut dyn Arbiter) -> Vec<Action> {
        log::warn!("{:?}: peer lost: {why}", self.role);
        match self.role {
            Role::Primary => self.go_alone(why, arbiter),
            Role::Secondary if !self.committed => {
                let mut actions = vec![Action::StopReplication];
                actions.extend(self.retire(format!(
                    "{why} before any checkpoint was committed: nothing to serve"
                )));
                actions
            }
            Role::Secondary => {
                self.state = State::FailingOver;
                self.reason = Some(why);
                let mut actions = vec![Action::StopReplication];
                actions.extend(self.try_take_over(arbiter));
                actions
            }
        }
    }

    /// Primary: hold the lease, record 'alone', then release output alone.
    fn go_alone(&mut self, why: String, arbiter: &mut dyn Arbiter) -> Vec<Action> {
        match arbiter.try_acquire() {
            Ok(true) => {}
            Ok(false) => return self.fence(format!("{why}; the lease is held elsewhere")),
            Err(e) => return self.fence(format!("{why}; cannot hold the lease: {e}")),
        }
        let mark = self.epoch.saturating_add(1);
        if let Err(e) = arbiter.mark_alone(mark) {
            return self.fence(format!("{why}; cannot record the alone mark: {e}"));
        }
        self.state = State::PrimaryAlone;
        self.reason = Some(format!("{why}; serving alone from epoch {mark}"));
        vec![Action::StopReplication, Action::GoAlone]
    }

    /// Secondary in `FailingOver`: one attempt at the lease.
    fn try_take_over(&mut self, arbiter: &mut dyn Arbiter) -> Vec<Action> {
        match arbiter.try_acquire() {
            Ok(true) => {}
            Ok(false) => {
                self.note_waiting("the lease is held by the primary; waiting".to_string());
                return Vec::new();
            }
            Err(e) => {
                self.note_waiting(format!("cannot take the lease ({e}); retrying"));
                return Vec::new();
            }
        }
        match arbiter.alone_mark() {
            Ok(Some(mark)) if mark > self.epoch => {
                arbiter.release();
                self.retire(format!(
                    "the primary served alone from epoch {mark}, after this \
                     secondary's last checkpoint {}: its state is behind what the \
                     client already saw, so it must not serve",
                    self.epoch
                ))
            }
            Ok(_) => {
                self.takeover_issued = true;
                self.reason = Some(format!("taking over from epoch {}", self.epoch));
                log::warn!(
                    "secondary: lease acquired, taking over from epoch {}",
                    self.epoch
                );
                vec![Action::TakeOver]
            }
            Err(e) => {
                // Cannot tell whether our state is stale: do not serve, and
                // do not keep the lease from a primary that may come back.
                arbiter.release();
                self.note_waiting(format!("cannot read the alone mark ({e}); retrying"));
                Vec::new()
            }
        }
    }

    fn note_waiting(&mut self, why: String) {
        if self.reason.as_deref() != Some(why.as_str()) {
            log::warn!("secondary: {why}");
            self.reason = Some(why);
        }
    }

    fn retire(&mut self, why: String) -> Vec<Action> {
        log::error!("secondary retires: {why}");
        self.state = State::Retired;
        self.reason = Some(why.clone());
        vec![Action::Retire(why)]
    }

    fn fence(&mut self, why: String) -> Vec<Action> {
        log::error!("{:?} fenced: {why}", self.role);
        self.state = State::Fenced;
        self.reason = Some(why);
        vec![Action::StopReplication, Action::Fence]
    }
}

#[cfg(test)]
#[path = "failover_tests.rs"]
mod tests;

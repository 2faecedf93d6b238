//! The etcd lease's connections and its keep-alive task ([`crate::etcd`]).
//!
//! Owns [`Shared`] (which lease this side holds, and its gate), the
//! [`Connector`] both the caller's calls and the task connect with, and
//! [`KeepAlive`], the task that renews a held lease every TTL/6 and moves
//! the gate on. The task runs on the lease's runtime thread ("etcd"); it
//! never blocks that thread, never waits on etcd longer than the call
//! timeout per renewal, and never opens the gate further than the send
//! instant of a renewal the server confirmed + 2/3 of its TTL. It changes
//! the gate only under [`Shared`]'s lock and only while its lease is still
//! the held one, so a released lease's task cannot reopen anything.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, LeaseKeepAliveStream, LeaseKeeper};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tokio::time::{self, MissedTickBehavior};

use crate::arbiter::Gate;
use crate::sync::lock;

/// The part of a gate's deadline a renewal or a grant gives: output may
/// go on until 2/3 of the TTL after the request was sent, a third of the
/// TTL before the server can let the lease expire.
pub(crate) fn open_part(ttl: Duration) -> Duration {
    ttl * 2 / 3
}

/// Which lease this side holds, and the gate its output passes. Both
/// change together, under the lock; the gate is read without it.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The held lease's id; 0 when none (etcd never grants 0).
    lease: Mutex<i64>,
    gate: Gate,
}

impl Shared {
    pub(crate) fn new() -> Shared {
        Shared {
            lease: Mutex::new(0),
            gate: Gate::closed(),
        }
    }

    pub(crate) fn gate(&self) -> &Gate {
        &self.gate
    }

    /// The held lease's id, 0 when none.
    pub(crate) fn lease(&self) -> i64 {
        *lock(&self.lease)
    }

    /// `lease` is held, granted by a request sent at `sent` with `ttl`.
    pub(crate) fn hold(&self, lease: i64, sent: Instant, ttl: Duration) {
        let mut held = lock(&self.lease);
        *held = lease;
        self.gate.open_until(sent + open_part(ttl));
    }

    /// Nothing is held any more: closes the gate; the lease that was held
    /// (0: none).
    pub(crate) fn give_up(&self) -> i64 {
        let mut held = lock(&self.lease);
        self.gate.close();
        std::mem::replace(&mut *held, 0)
    }

    /// `lease` was renewed by a request sent at `sent`, with `ttl`.
    fn renewed(&self, lease: i64, sent: Instant, ttl: Duration) {
        let held = lock(&self.lease);
        if *held == lease {
            self.gate.extend_until(sent + open_part(ttl));
        }
    }

    /// `lease` is gone at the server. True if it was the held one (the
    /// gate is closed now).
    fn lost(&self, lease: i64) -> bool {
        let mut held = lock(&self.lease);
        if *held != lease {
            return false;
        }
        *held = 0;
        self.gate.close();
        true
    }
}

/// How much longer than our own bound the client's own timeouts are: a
/// backstop (and the deadline etcd is told), so that ours fires first and
/// the error names the call.
const CLIENT_GRACE: Duration = Duration::from_millis(100);

/// How a client reaches etcd: the endpoints and the options.
#[derive(Debug, Clone)]
pub(crate) struct Connector {
    endpoints: Vec<String>,
    options: ConnectOptions,
}

impl Connector {
    /// For unary calls each bounded by `timeout`: the client's connect and
    /// request timeouts too.
    pub(crate) fn unary(endpoints: &[String], timeout: Duration) -> Connector {
        Connector {
            endpoints: endpoints.to_vec(),
            options: ConnectOptions::new()
                .with_connect_timeout(timeout + CLIENT_GRACE)
                .with_timeout(timeout + CLIENT_GRACE),
        }
    }

    /// For the keep-alive stream: the client's connect timeout, no request
    /// timeout (it would cut the stream; the task bounds each renewal).
    pub(crate) fn streaming(endpoints: &[String], timeout: Duration) -> Connector {
        Connector {
            endpoints: endpoints.to_vec(),
            options: ConnectOptions::new().with_connect_timeout(timeout + CLIENT_GRACE),
        }
    }

    /// A new client (no request is sent yet). Must run on the runtime.
    pub(crate) async fn connect(&self) -> Result<Client, etcd_client::Error> {
        Client::connect(&self.endpoints, Some(self.options.clone())).await
    }
}

/// What one renewal found.
#[derive(Debug)]
enum Renewal {
    /// The server renewed the lease, for `ttl`, at or after `sent`.
    Renewed { sent: Instant, ttl: Duration },
    /// The server no longer has the lease (TTL 0 or not found).
    Gone,
    /// No answer, or an error: try again on a new connection.
    Failed(String),
}

/// A keep-alive stream, with the client whose connection carries it.
struct Stream {
    _client: Client,
    keeper: LeaseKeeper,
    responses: LeaseKeepAliveStream,
}

/// The running keep-alive task of one lease; stopped when dropped.
#[derive(Debug)]
pub(crate) struct KeepAlive {
    task: JoinHandle<()>,
}

impl KeepAlive {
    /// Starts renewing `lease` (granted for `ttl`) every `ttl / 6`, each
    /// renewal bounded by `timeout`. `name` names the lease in the log.
    pub(crate) fn start(
        handle: &Handle,
        connector: Connector,
        shared: Arc<Shared>,
        lease: i64,
        ttl: Duration,
        timeout: Duration,
        name: String,
    ) -> KeepAlive {
        let task = handle.spawn(run(connector, shared, lease, ttl, timeout, name));
        KeepAlive { task }
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(
    connector: Connector,
    shared: Arc<Shared>,
    lease: i64,
    ttl: Duration,
    timeout: Duration,
    name: String,
) {
    let period = ttl / 6;
    let mut tick = time::interval_at(time::Instant::now() + period, period);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut stream = None;
    let mut failing = false;
    loop {
        tick.tick().await;
        match renew(&connector, &mut stream, lease, ttl, timeout).await {
            Renewal::Renewed { sent, ttl } => {
                if failing {
                    log::info!("{name}: lease {lease:x} renewed again");
                    failing = false;
                }
                shared.renewed(lease, sent, ttl);
            }
            Renewal::Gone => {
                if shared.lost(lease) {
                    log::error!(
                        "{name}: lease {lease:x} is gone at the server: this side \
                         no longer holds it"
                    );
                }
                return;
            }
            Renewal::Failed(why) => {
                stream = None;
                if !failing {
                    log::warn!(
                        "{name}: cannot renew lease {lease:x} ({why}); retrying every \
                         {period:?}, the gate closes at its deadline"
                    );
                    failing = true;
                }
            }
        }
    }
}

/// One renewal of `lease` (granted for `granted`): on the open stream, or
/// on a new one (whose creation is itself a renewal).
async fn renew(
    connector: &Connector,
    stream: &mut Option<Stream>,
    lease: i64,
    granted: Duration,
    timeout: Duration,
) -> Renewal {
    let sent = Instant::now();
    let attempt = async {
        if let Some(s) = stream.as_mut() {
            s.keeper.keep_alive().await?;
            return match s.responses.message().await? {
                Some(resp) => Ok(resp.ttl()),
                None => Err(etcd_client::Error::LeaseKeepAliveError(
                    "the keep-alive stream ended".to_string(),
                )),
            };
        }
        let mut client = connector.connect().await?;
        match client.lease_keep_alive(lease).await {
            Ok((keeper, responses)) => {
                *stream = Some(Stream {
                    _client: client,
                    keeper,
                    responses,
                });
                // The first answer had a TTL > 0: the lease's own TTL.
                Ok(i64::try_from(granted.as_secs()).unwrap_or(i64::MAX))
            }
            // The only error of a stream's creation after the server
            // answered: its answer had TTL 0 ("lease not found").
            Err(etcd_client::Error::LeaseKeepAliveError(_)) => Ok(0),
            Err(e) => Err(e),
        }
    };
    match time::timeout(timeout, attempt).await {
        Ok(Ok(ttl)) if ttl > 0 => Renewal::Renewed {
            sent,
            ttl: Duration::from_secs(ttl.unsigned_abs()),
        },
        Ok(Ok(_)) => Renewal::Gone,
        Ok(Err(e)) => Renewal::Failed(e.to_string()),
        Err(_) => Renewal::Failed(format!("no answer within {timeout:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_released_lease_cannot_reopen_the_gate() {
        let shared = Shared::new();
        let now = Instant::now();
        let ttl = Duration::from_secs(3);
        shared.hold(7, now, ttl);
        assert!(shared.gate().is_open());
        assert_eq!(shared.gate().deadline(), Some(now + Duration::from_secs(2)));
        shared.renewed(7, now + Duration::from_millis(500), ttl);
        assert_eq!(
            shared.gate().deadline(),
            Some(now + Duration::from_millis(2500))
        );
        shared.renewed(7, now, ttl);
        assert_eq!(
            shared.gate().deadline(),
            Some(now + Duration::from_millis(2500)),
            "a late answer to an older renewal never moves it back"
        );
        assert_eq!(shared.give_up(), 7);
        shared.renewed(7, Instant::now(), ttl);
        assert!(!shared.gate().is_open(), "renewal after release");
        assert!(!shared.lost(7));
        assert_eq!(shared.lease(), 0);
    }

    #[test]
    fn a_lost_lease_closes_only_its_own_gate() {
        let shared = Shared::new();
        let ttl = Duration::from_secs(2);
        shared.hold(8, Instant::now(), ttl);
        assert!(!shared.lost(9), "another lease's task");
        assert!(shared.gate().is_open());
        assert!(shared.lost(8));
        assert!(!shared.gate().is_open());
        assert_eq!(shared.give_up(), 0);
    }
}

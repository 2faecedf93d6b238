//! The pair's lease across hosts: a key in etcd (v3) under a TTL lease
//! (design.md §6, Arbiter).
//!
//! Owns [`EtcdSpec`] (`etcd:http://HOST:PORT[,http://HOST:PORT...]/KEY`)
//! and [`EtcdLease`], an [`Arbiter`]: a tokio runtime with one worker
//! thread named "etcd", a client for the caller's calls and the keep-alive
//! task of the held lease (in `etcd_keepalive.rs`). The caller (the
//! VMM's colo thread, a plain thread) calls in and waits on the runtime,
//! at most [`call_timeout`] per call; the keep-alive task runs on the
//! "etcd" thread; the gate ([`Arbiter::gate`]) is read at every frame by
//! the network thread, without a lock. It must never be called from inside
//! an async runtime (it blocks on its own), never waits on etcd longer
//! than the call timeout (dropping a held lease: the call timeout + 200
//! ms), and never opens the gate without a lease the server confirmed.
//!
//! The rules. With `T` the TTL the server granted (whole seconds, at least
//! [`MIN_TTL`]) and `c = min(T/4, 1 s)` the call timeout:
//! - Acquire: at `s` (before anything is sent), grant a lease of `T`, then
//!   in one transaction: if the key was never created (create revision 0),
//!   put our id in it under that lease. If so, this side holds, and its
//!   gate opens until `s + 2T/3`; else the new lease is revoked and the
//!   answer is "held elsewhere" (`Ok(false)`).
//! - Keep-alive: every `T/6`, a renewal sent at `r` that the server answers
//!   with a TTL `T' > 0` moves the gate to `r + 2T'/3` (never earlier); an
//!   answer with TTL 0 (the lease is gone) closes the gate for good. No
//!   answer within `c` (or an error): the connection is dropped and made
//!   again at the next renewal; the gate runs out by itself at its
//!   deadline, and opens again if a later renewal reaches the server while
//!   the lease still lives there.
//!   A try makes at most three calls (grant, transaction, and a revoke
//!   after a failed transaction), each within `c`.
//! - Release: close the gate, stop the task, revoke the lease (within `c`).
//! - The alone mark (`KEY/alone`, the epoch in decimal, on no lease: it
//!   outlives its writer) is written and removed only in a transaction that
//!   checks the key holds our id under our lease.
//!
//! Why two sides never serve at once. The key is created only when absent
//! and belongs to the creator's lease; it goes only with that lease (expiry
//! or revocation). So B's gate opens only after B created the key, so only
//! after A's lease ended. A's gate is open only until `r + 2T/3` for a
//! request sent at `r` that renewed (or granted) the lease; the server
//! renewed it when the request arrived, at or after `r`, so the lease
//! cannot expire before `r + T` (etcd never shortens a lease: a leader
//! change only extends them). A revokes only after closing its gate. So
//! A's gate closes at least `T/3` before B's can open, assuming the three
//! clocks' rates agree to far better than a third over `T`. That margin
//! (≥ 666 ms at `T` = 2 s) covers a frame that passed the gate just
//! before its deadline and the VMM pausing its guest: a side whose thread
//! is held up longer than `T/3` between the gate check and the write is
//! not covered. The key and its lease belong to tandem: deleting the key
//! or revoking the lease by hand (etcdctl) while a side holds it lets the
//! other side in up to `T/6` before the holder notices.

use std::fmt;
use std::future::Future;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse};
use tokio::runtime::{Handle, Runtime};

use crate::arbiter::{Arbiter, ArbiterError, ArbiterInfo, Gate};
use crate::etcd_keepalive::{Connector, KeepAlive, Shared};
use crate::sync::lock;

/// The shortest TTL: etcd's own minimum with its default timing
/// (1.5 × the 1 s election timeout, rounded up).
pub const MIN_TTL: Duration = Duration::from_secs(2);

/// The longest any one call into etcd may take.
pub const MAX_CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// How long dropping a lease waits for its runtime's tasks to end.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_millis(200);

/// The form of a spec, for error messages.
const FORM: &str = "etcd:http://HOST:PORT[,http://HOST:PORT...]/KEY";

/// The bound on each call into etcd for a lease of `ttl`: `min(ttl/4, 1 s)`.
pub fn call_timeout(ttl: Duration) -> Duration {
    (ttl / 4).min(MAX_CALL_TIMEOUT)
}

/// Where the lease lives: etcd's client endpoints and the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdSpec {
    /// `http://HOST:PORT` each.
    pub endpoints: Vec<String>,
    /// The key, with its leading slash (`/tandem/pair1`).
    pub key: String,
}

impl FromStr for EtcdSpec {
    type Err = ArbiterError;

    /// Parses `etcd:http://HOST:PORT[,http://HOST:PORT...]/KEY`: the key
    /// is everything from the first `/` after the last endpoint.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |why: String| ArbiterError::BadSpec(format!("{s:?}: {why} (expected {FORM})"));
        let mut rest = s
            .strip_prefix("etcd:")
            .ok_or_else(|| bad("no `etcd:` prefix".to_string()))?;
        let mut endpoints = Vec::new();
        let key = loop {
            let Some(after) = rest.strip_prefix("http://") else {
                let why = if rest.starts_with("https://") {
                    "TLS (https://) is not supported".to_string()
                } else if rest.is_empty() || rest.starts_with('/') {
                    "no endpoint".to_string()
                } else {
                    let end = rest.find([',', '/']).unwrap_or(rest.len());
                    format!("endpoint {:?} is not http://HOST:PORT", &rest[..end])
                };
                return Err(bad(why));
            };
            let end = after.find([',', '/']).unwrap_or(after.len());
            let host_port = &after[..end];
            check_host_port(host_port)
                .map_err(|why| bad(format!("endpoint http://{host_port}: {why}")))?;
            endpoints.push(format!("http://{host_port}"));
            match after[end..].chars().next() {
                Some(',') => rest = &after[end + 1..],
                Some(_) => break &after[end..],
                None => return Err(bad("no key after the endpoints".to_string())),
            }
        };
        if key.len() < 2 {
            return Err(bad("empty key".to_string()));
        }
        if key.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad(format!("the key {key:?} has whitespace")));
        }
        Ok(EtcdSpec {
            endpoints,
            key: key.to_string(),
        })
    }
}

/// Checks `HOST:PORT`: a name or IPv4 address, or `[IPv6]`, and a port.
fn check_host_port(host_port: &str) -> Result<(), String> {
    let (host, port) = host_port
        .rsplit_once(':')
        .ok_or_else(|| "no :PORT".to_string())?;
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return Err(format!("bad port {port:?}")),
    }
    let ok = if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        !v6.is_empty()
            && v6
                .chars()
                .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.')
    } else {
        !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
    };
    if ok {
        Ok(())
    } else {
        Err(format!("bad host {host:?}"))
    }
}

impl fmt::Display for EtcdSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "etcd:{}{}", self.endpoints.join(","), self.key)
    }
}

/// The pair's lease in etcd; see the module doc.
pub struct EtcdLease {
    spec: EtcdSpec,
    /// `spec` as text, naming the lease in messages.
    name: String,
    mark_key: String,
    id: String,
    ttl: Duration,
    call_timeout: Duration,
    handle: Handle,
    /// Some until dropped.
    runtime: Option<Runtime>,
    connector: Connector,
    /// The caller's client, made again after any failed call.
    client: Mutex<Option<Client>>,
    shared: Arc<Shared>,
    keep_alive: Option<KeepAlive>,
    /// The holder last seen in etcd (our id while held).
    last_holder: Option<String>,
}

impl fmt::Debug for EtcdLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdLease")
            .field("spec", &self.name)
            .field("id", &self.id)
            .field("ttl", &self.ttl)
            .field("lease", &self.shared.lease())
            .field("gate", self.shared.gate())
            .finish_non_exhaustive()
    }
}

impl EtcdLease {
    /// The lease at `spec` for side `id`, with `ttl` (whole seconds, at
    /// least [`MIN_TTL`]). Does not contact etcd (it may be down when a
    /// side starts); starts the runtime.
    pub fn open(spec: &EtcdSpec, id: &str, ttl: Duration) -> Result<EtcdLease, ArbiterError> {
        Self::open_with(spec, id, ttl, || {})
    }

    /// [`open`](Self::open), with `on_thread_start` run first on each
    /// thread the runtime starts (the VMM confines them there).
    pub fn open_with(
        spec: &EtcdSpec,
        id: &str,
        ttl: Duration,
        on_thread_start: impl Fn() + Send + Sync + 'static,
    ) -> Result<EtcdLease, ArbiterError> {
        if ttl < MIN_TTL || ttl.subsec_nanos() != 0 || i64::try_from(ttl.as_secs()).is_err() {
            return Err(ArbiterError::BadSpec(format!(
                "TTL {ttl:?}: must be whole seconds, at least {} s",
                MIN_TTL.as_secs()
            )));
        }
        if id.is_empty() {
            return Err(ArbiterError::BadSpec("empty holder id".to_string()));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("etcd")
            .on_thread_start(on_thread_start)
            .enable_all()
            .build()
            .map_err(ArbiterError::Runtime)?;
        let call_timeout = call_timeout(ttl);
        Ok(EtcdLease {
            name: spec.to_string(),
            mark_key: format!("{}/alone", spec.key),
            spec: spec.clone(),
            id: id.to_string(),
            ttl,
            call_timeout,
            handle: runtime.handle().clone(),
            runtime: Some(runtime),
            connector: Connector::unary(&spec.endpoints, call_timeout),
            client: Mutex::new(None),
            shared: Arc::new(Shared::new()),
            keep_alive: None,
            last_holder: None,
        })
    }

    /// The TTL asked for.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The spec this lease was opened with.
    pub fn spec(&self) -> &EtcdSpec {
        &self.spec
    }

    fn what(&self, action: &str) -> String {
        format!("{action} ({})", self.name)
    }

    /// Runs `f` on a client (the cached one, or a new one), waiting at
    /// most the call timeout; drops the client after any failure.
    fn call<T, F, Fut>(&self, action: &str, f: F) -> Result<T, ArbiterError>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.call_within(action, self.call_timeout, f)
    }

    /// [`Self::call`], waiting at most `limit` (at most the call timeout).
    fn call_within<T, F, Fut>(&self, action: &str, limit: Duration, f: F) -> Result<T, ArbiterError>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let cached = lock(&self.client).clone();
        let connector = &self.connector;
        let run = async move {
            let client = match cached {
                Some(c) => c,
                None => connector.connect().await?,
            };
            let out = f(client.clone()).await?;
            Ok::<_, etcd_client::Error>((client, out))
        };
        // The timer is made inside the runtime, which owns the clock.
        let limit = limit.min(self.call_timeout);
        let res = self
            .handle
            .block_on(async move { tokio::time::timeout(limit, run).await });
        let mut client = lock(&self.client);
        match res {
            Ok(Ok((c, out))) => {
                *client = Some(c);
                Ok(out)
            }
            Ok(Err(source)) => {
                *client = None;
                Err(ArbiterError::Etcd {
                    what: self.what(action),
                    source,
                })
            }
            Err(_) => {
                *client = None;
                Err(ArbiterError::Timeout {
                    what: self.what(action),
                    after: limit,
                })
            }
        }
    }

    /// Revokes `lease`, best effort (logged).
    fn revoke(&self, lease: i64) {
        let res = self.call("revoke the lease", |mut c| async move {
            c.lease_revoke(lease).await
        });
        if let Err(e) = res {
            log::warn!("lease {lease:x}: {e}");
        }
    }

    /// Grants a lease of our TTL: its id and the TTL granted.
    fn grant(&self) -> Result<(i64, Duration), ArbiterError> {
        let secs = i64::try_from(self.ttl.as_secs()).unwrap_or(i64::MAX);
        let resp = self.call("grant a lease", |mut c| async move {
            c.lease_grant(secs, None).await
        })?;
        let granted = u64::try_from(resp.ttl()).unwrap_or(0);
        if granted == 0 || resp.id() == 0 {
            self.revoke(resp.id());
            return Err(ArbiterError::Protocol(format!(
                "lease {:x} granted with TTL {} s ({})",
                resp.id(),
                resp.ttl(),
                self.name
            )));
        }
        if granted != self.ttl.as_secs() {
            log::info!(
                "{}: asked for a TTL of {} s, granted {granted} s",
                self.name,
                self.ttl.as_secs()
            );
        }
        Ok((resp.id(), Duration::from_secs(granted)))
    }

    /// Puts our id in the key under `lease` if the key is absent; else
    /// the holder found in it.
    fn take_key(&self, lease: i64) -> Result<Result<(), Option<String>>, ArbiterError> {
        let key = self.spec.key.clone();
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.clone(),
                self.id.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(key, None)]);
        let resp = self.call("take the key", |mut c| async move { c.txn(txn).await })?;
        if resp.succeeded() {
            Ok(Ok(()))
        } else {
            Ok(Err(holder_in(&resp)))
        }
    }

    /// Runs `op` if the key holds our id under our lease; `NotHeld` if not
    /// (or if this side's gate is closed).
    fn under_lease(&mut self, action: &str, op: TxnOp) -> Result<(), ArbiterError> {
        let lease = self.shared.lease();
        if !self.holds() || lease == 0 {
            return Err(self.not_held());
        }
        let key = self.spec.key.clone();
        let txn = Txn::new()
            .when([
                Compare::value(key.clone(), CompareOp::Equal, self.id.clone()),
                Compare::lease(key, CompareOp::Equal, lease),
            ])
            .and_then([op]);
        // Done while the gate is open, or not at all: a side that goes
        // alone must know before its gate closes (and it fences then).
        let left = self.shared.gate().time_left().unwrap_or(self.call_timeout);
        let resp = self.call_within(action, left, |mut c| async move { c.txn(txn).await })?;
        if resp.succeeded() {
            Ok(())
        } else {
            Err(self.not_held())
        }
    }

    fn not_held(&self) -> ArbiterError {
        ArbiterError::NotHeld {
            resource: self.name.clone(),
        }
    }
}

/// The holder's id in a transaction's `get` of the key, if any.
fn holder_in(resp: &TxnResponse) -> Option<String> {
    resp.op_responses().into_iter().find_map(|r| match r {
        TxnOpResponse::Get(g) => g
            .kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
        _ => None,
    })
}

impl Arbiter for EtcdLease {
    fn try_acquire(&mut self) -> Result<bool, ArbiterError> {
        if self.holds() {
            return Ok(true);
        }
        let sent = Instant::now();
        let (lease, granted) = self.grant()?;
        match self.take_key(lease) {
            Ok(Ok(())) => {}
            Ok(Err(holder)) => {
                self.last_holder = holder;
                self.revoke(lease);
                return Ok(false);
            }
            Err(e) => {
                // The put may have reached the server: revoking undoes it.
                self.revoke(lease);
                return Err(e);
            }
        }
        // The key was absent, so an older lease of ours (if its task had
        // not heard yet) no longer holds it: stop renewing it.
        let old = self.shared.lease();
        self.keep_alive = None;
        self.shared.hold(lease, sent, granted);
        if old != 0 {
            self.revoke(old);
        }
        self.keep_alive = Some(KeepAlive::start(
            &self.handle,
            Connector::streaming(&self.spec.endpoints, self.call_timeout),
            self.shared.clone(),
            lease,
            granted,
            self.call_timeout,
            self.name.clone(),
        ));
        self.last_holder = Some(self.id.clone());
        log::info!("{}: lease {lease:x} acquired by {}", self.name, self.id);
        Ok(self.holds())
    }

    /// Held and renewed in time (the gate opens only while a lease is
    /// held). No call to etcd.
    fn holds(&self) -> bool {
        self.shared.gate().is_open()
    }

    fn release(&mut self) {
        let lease = self.shared.give_up();
        self.keep_alive = None;
        if lease != 0 {
            self.revoke(lease);
            log::info!("{}: lease {lease:x} released by {}", self.name, self.id);
        }
    }

    fn mark_alone(&mut self, epoch: u64) -> Result<(), ArbiterError> {
        let op = TxnOp::put(self.mark_key.clone(), epoch.to_string(), None);
        self.under_lease("write the alone mark", op)
    }

    fn clear_alone(&mut self) -> Result<(), ArbiterError> {
        let op = TxnOp::delete(self.mark_key.clone(), None);
        self.under_lease("remove the alone mark", op)
    }

    fn alone_mark(&self) -> Result<Option<u64>, ArbiterError> {
        let key = self.mark_key.clone();
        let resp = self.call("read the alone mark", |mut c| async move {
            c.get(key, None).await
        })?;
        let Some(kv) = resp.kvs().first() else {
            return Ok(None);
        };
        let content = String::from_utf8_lossy(kv.value());
        content
            .trim()
            .parse::<u64>()
            .map(Some)
            .map_err(|_| ArbiterError::BadMark {
                resource: format!("{} ({})", self.mark_key, self.name),
                content: content.chars().take(64).collect(),
            })
    }

    fn describe(&self) -> ArbiterInfo {
        let held = self.holds();
        ArbiterInfo {
            kind: "etcd",
            resource: self.name.clone(),
            held,
            holder: if held {
                Some(self.id.clone())
            } else {
                self.last_holder.clone()
            },
            ttl_left: if held {
                self.shared.gate().time_left()
            } else {
                None
            },
        }
    }

    fn gate(&self) -> Gate {
        self.shared.gate().clone()
    }

    fn current_holder(&mut self) -> Result<Option<String>, ArbiterError> {
        let key = self.spec.key.clone();
        let resp = self.call(
            "read the holder",
            |mut c| async move { c.get(key, None).await },
        )?;
        let holder = resp
            .kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned());
        self.last_holder.clone_from(&holder);
        Ok(holder)
    }
}

impl Drop for EtcdLease {
    /// Releases (best effort, within the call timeout) and stops the
    /// runtime, waiting at most [`SHUTDOWN_TIMEOUT`] for its tasks.
    fn drop(&mut self) {
        self.release();
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(SHUTDOWN_TIMEOUT);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> Result<EtcdSpec, String> {
        s.parse::<EtcdSpec>().map_err(|e| e.to_string())
    }

    #[test]
    fn specs_that_parse() {
        let s =
            spec("etcd:http://198.51.100.1:2379,http://198.51.100.5:2379/tandem/pair1").unwrap();
        assert_eq!(
            s.endpoints,
            ["http://198.51.100.1:2379", "http://198.51.100.5:2379"]
        );
        assert_eq!(s.key, "/tandem/pair1");
        let s = spec("etcd:http://localhost:2379/k").unwrap();
        assert_eq!(s.endpoints, ["http://localhost:2379"]);
        assert_eq!(s.key, "/k");
        let s = spec("etcd:http://[::1]:2379/a/b,c").unwrap();
        assert_eq!(s.endpoints, ["http://[::1]:2379"]);
        assert_eq!(s.key, "/a/b,c", "the key is everything after the endpoints");
    }

    #[test]
    fn display_round_trips() {
        for text in [
            "etcd:http://198.51.100.1:2379,http://198.51.100.5:2379/tandem/pair1",
            "etcd:http://etcd-1.example:2379/x",
            "etcd:http://[2001:db8::1]:2379/tandem/p",
        ] {
            let s = spec(text).unwrap();
            assert_eq!(s.to_string(), text);
            assert_eq!(spec(&s.to_string()).unwrap(), s);
        }
    }

    #[test]
    fn specs_refused_with_the_reason() {
        let cases = [
            ("http://127.0.0.1:2379/k", "no `etcd:` prefix"),
            ("etcd:", "no endpoint"),
            ("etcd:/k", "no endpoint"),
            ("etcd:127.0.0.1:2379/k", "is not http://HOST:PORT"),
            ("etcd:https://127.0.0.1:2379/k", "TLS"),
            ("etcd:http://127.0.0.1/k", "no :PORT"),
            ("etcd:http://127.0.0.1:0/k", "bad port"),
            ("etcd:http://127.0.0.1:99999/k", "bad port"),
            ("etcd:http://:2379/k", "bad host"),
            ("etcd:http://a b:2379/k", "bad host"),
            ("etcd:http://::1:2379/k", "bad host"),
            ("etcd:http://127.0.0.1:2379", "no key"),
            ("etcd:http://127.0.0.1:2379,", "no endpoint"),
            ("etcd:http://127.0.0.1:2379,http://h:1", "no key"),
            ("etcd:http://127.0.0.1:2379/", "empty key"),
            ("etcd:http://127.0.0.1:2379/a b", "whitespace"),
            ("etcd:http://127.0.0.1:2379/a\tb", "whitespace"),
        ];
        for (text, why) in cases {
            match spec(text) {
                Ok(s) => panic!("{text:?} parsed as {s:?}"),
                Err(e) => {
                    assert!(e.contains(why), "{text:?}: {e:?} does not say {why:?}");
                    assert!(e.contains(FORM), "{e:?} shows the form");
                }
            }
        }
    }

    #[test]
    fn open_checks_the_ttl_without_contacting_etcd() {
        // Port 1 on loopback: nothing listens, and nothing is sent.
        let s = spec("etcd:http://127.0.0.1:1/k").unwrap();
        for bad in [
            Duration::from_secs(1),
            Duration::from_millis(2500),
            Duration::ZERO,
        ] {
            let e = EtcdLease::open(&s, "a", bad).unwrap_err();
            assert!(matches!(e, ArbiterError::BadSpec(_)), "{e:?}");
        }
        assert!(EtcdLease::open(&s, "", MIN_TTL).is_err());
        let lease = EtcdLease::open(&s, "a", Duration::from_secs(3)).unwrap();
        assert_eq!(lease.ttl(), Duration::from_secs(3));
        assert!(!lease.holds());
        assert!(!lease.gate().is_open());
        let info = lease.describe();
        assert_eq!(info.kind, "etcd");
        assert_eq!(info.resource, "etcd:http://127.0.0.1:1/k");
        assert_eq!((info.held, info.holder, info.ttl_left), (false, None, None));
    }

    #[test]
    fn calls_are_bounded_by_a_quarter_of_the_ttl_up_to_a_second() {
        assert_eq!(
            call_timeout(Duration::from_secs(2)),
            Duration::from_millis(500)
        );
        assert_eq!(
            call_timeout(Duration::from_secs(3)),
            Duration::from_millis(750)
        );
        assert_eq!(call_timeout(Duration::from_secs(4)), Duration::from_secs(1));
        assert_eq!(
            call_timeout(Duration::from_secs(60)),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn nothing_held_means_nothing_written() {
        let s = spec("etcd:http://127.0.0.1:1/k").unwrap();
        let mut lease = EtcdLease::open(&s, "a", MIN_TTL).unwrap();
        let t = Instant::now();
        assert!(matches!(
            lease.mark_alone(3),
            Err(ArbiterError::NotHeld { .. })
        ));
        assert!(matches!(
            lease.clear_alone(),
            Err(ArbiterError::NotHeld { .. })
        ));
        assert!(
            t.elapsed() < Duration::from_millis(100),
            "refused without a call"
        );
        lease.release();
        drop(lease);
    }
}

//! The control API: a Unix socket (`tandem run --api-sock PATH`) that takes
//! one JSON request per line and answers each with one JSON line.
//!
//! Requests ([`Request`]: `cmd` selects the verb; unknown fields are refused):
//! ```text
//! {"cmd":"status"}                 -> {"ok":true,"state":"running"|"paused",...}
//! {"cmd":"pause"}                  -> {"ok":true,"state":"paused","pause_ms":...}
//! {"cmd":"resume"}                 -> {"ok":true,"state":"running"}
//! {"cmd":"metrics"}                -> {"ok":true,"metrics":{...}}
//! {"cmd":"shutdown"}               -> {"ok":true}, then the VMM exits (status 0)
//! {"cmd":"snapshot","path":"F"}    -> {"ok":true,"path":"F","file_bytes":...}
//! {"cmd":"revert","path":"F"}      -> {"ok":true,"pages":...,"ms":...,"state":...}
//!                                     (back to snapshot F of this same VM)
//! {"cmd":"profile_start","hz":N}   -> {"ok":true,"hz":N,...} (hz optional, default 1000)
//! {"cmd":"profile_stop","path":"F"} -> {"ok":true,"samples":...,"top":[...],"table":"..."}
//! {"cmd":"throttle","percent":N}   -> {"ok":true,"percent":N} (0 to 99; 0: off)
//! {"cmd":"dirty_log","action":"start"|"read"|"stop"}
//!                                  -> {"ok":true,"logging":...,"pages":...,"kvm_pages":...,...}
//! {"cmd":"migrate","to":"tcp:H:P"|"unix:PATH","downtime_ms":300,"bandwidth_mib":null,
//!  "auto_converge":true,"timeout_s":600,"mode":"thread"|"inline",
//!  "initially_set":true,"connections":1,"postcopy":false,"postcopy_after_rounds":null}
//!                                  -> {"ok":true,"migration":{status}} (started; fields optional)
//! {"cmd":"migrate_status"}         -> {"ok":true,"migration":{"phase":...,"round":...,...}}
//! {"cmd":"migrate_cancel"}         -> {"ok":true,"migration":{...}} (the guest runs on here)
//! {"cmd":"migrate_postcopy"}       -> {"ok":true,"migration":{...}} (switches at the next look)
//! {"cmd":"colo_start","to":"tcp:H:P"|"unix:PATH","checkpoint_period_ms":20000,
//!  "heartbeat_ms":100,"heartbeat_timeout_ms":1000,"lease":"/tmp/F.lock"
//!  |"arbiter":"etcd:http://H:P/KEY","lease_ttl_s":3,
//!  "compare_timeout_ms":3000,"max_queue":1024,"queue_full":"drop"|"checkpoint","channels":1}
//!                                  -> {"ok":true,"colo":{report}} (started; fields optional)
//! {"cmd":"colo_reprotect","to":"tcp:H:P"|"unix:PATH", and colo_start's timing fields}
//!                                  -> {"ok":true,"colo":{report}} (asked; a survivor acts on it)
//! {"cmd":"colo_status"}            -> {"ok":true,"colo":{"role":...,"state":...,...}}
//! {"cmd":"colo_failover"}          -> {"ok":true,"colo":{...}} (asked; the side acts on it)
//! {"cmd":"colo_checkpoint"}        -> {"ok":true,"colo":{...}} (asked, on the primary)
//! ```
//! Any failure is `{"ok":false,"error":"..."}`; a malformed request, an
//! oversized line or a client that goes away never affects the VM.
//!
//! The same [`Request`] type is what `tandem ctl` serializes ([`request`]),
//! so the server and its client cannot disagree on the wire format.
//!
//! Runs on the VMM thread as an event-manager subscriber; the work of each
//! verb is done by a [`Control`] that the VM provides. Never here: a panic
//! or an allocation beyond [`MAX_REQUEST`] per client on what a client sends.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::vm::VmOpError;

mod error;
pub use error::{ControlError, Refused};

/// The longest request line taken.
pub const MAX_REQUEST: usize = 64 << 10;
/// The longest answer line `tandem ctl` reads.
const MAX_ANSWER: u64 = 64 << 20;
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
const MAX_CLIENTS: usize = 16;
const LISTENER: u32 = u32::MAX;

/// API errors: setting up the socket, parsing a request (the server answers
/// those with JSON errors), and the client's side of a request.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("--api-sock {path}: {err}")]
    Bind { path: PathBuf, err: std::io::Error },
    #[error("not a JSON object")]
    NotObject,
    #[error("{0}")]
    Json(#[source] serde_json::Error),
    #[error("cannot encode the request: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("cannot connect to {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot send the request: {0}")]
    Send(#[source] std::io::Error),
    #[error("no answer: {0}")]
    NoAnswer(#[source] std::io::Error),
    #[error("no answer: the VMM closed the connection")]
    Closed,
    #[error("answer longer than {MAX_ANSWER} bytes")]
    AnswerTooLong,
    #[error("unreadable answer: {0}")]
    Answer(#[source] serde_json::Error),
}

/// One request: a JSON object whose `cmd` names the variant (snake case)
/// and whose other keys are exactly that variant's fields.
///
/// The verbs without fields are empty struct variants (`Status {}`), not
/// unit variants: serde's internally tagged enums ignore unknown keys beside
/// a unit variant even under `deny_unknown_fields`, and refuse them beside
/// a struct variant (tested below). Fields are checked as they are read
/// (non-empty paths, rates and percentages in range), each error naming its
/// field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    Status {},
    Pause {},
    Resume {},
    Metrics {},
    Shutdown {},
    Snapshot {
        #[serde(deserialize_with = "field::path")]
        path: PathBuf,
    },
    Revert {
        #[serde(deserialize_with = "field::path")]
        path: PathBuf,
    },
    ProfileStart {
        #[serde(default = "field::default_hz", deserialize_with = "field::hz")]
        hz: u32,
    },
    ProfileStop {
        #[serde(deserialize_with = "field::path")]
        path: PathBuf,
    },
    DirtyLog {
        #[serde(deserialize_with = "field::action")]
        action: DirtyLogAction,
    },
    Throttle {
        #[serde(deserialize_with = "field::percent")]
        percent: u8,
    },
    /// Starts a live migration to `to` (`tcp:HOST:PORT` or `unix:PATH`)
    /// on the migration thread; answers at once (follow it with
    /// `migrate_status`).
    Migrate {
        #[serde(deserialize_with = "field::endpoint")]
        to: String,
        #[serde(default = "field::default_downtime")]
        downtime_ms: u64,
        #[serde(default)]
        bandwidth_mib: Option<u64>,
        #[serde(default = "field::default_true")]
        auto_converge: bool,
        #[serde(default = "field::default_timeout")]
        timeout_s: u64,
        #[serde(default)]
        mode: crate::migrate::Mode,
        #[serde(default = "field::default_true")]
        initially_set: bool,
        #[serde(default = "field::default_connections")]
        connections: u16,
        #[serde(default)]
        postcopy: bool,
        #[serde(default)]
        postcopy_after_rounds: Option<u32>,
    },
    MigrateStatus {},
    /// Switches the migration under way to post-copy at its next look.
    MigratePostcopy {},
    MigrateCancel {},
    /// Makes this running VM the primary of a COLO pair with the secondary
    /// waiting at `to` (`tandem run --colo secondary`); answers at once.
    ColoStart {
        #[serde(deserialize_with = "field::endpoint")]
        to: String,
        #[serde(default)]
        lease: Option<PathBuf>,
        #[serde(default)]
        arbiter: Option<String>,
        #[serde(default)]
        lease_ttl_s: Option<u32>,
        #[serde(flatten)]
        pair: crate::colo::PairParams,
    },
    /// Makes this VM, serving alone after its pair ended (primary_alone or
    /// failed_over), the primary of a new pair with the secondary waiting
    /// at `to`; it keeps its lease. Answers at once.
    ColoReprotect {
        #[serde(deserialize_with = "field::endpoint")]
        to: String,
        #[serde(flatten)]
        pair: crate::colo::PairParams,
    },
    ColoStatus {},
    ColoFailover {},
    ColoCheckpoint {},
}

/// What `dirty_log` does: turn KVM's dirty log on, read (and reset) what
/// was written since the last read, or turn it off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DirtyLogAction {
    Start,
    Read,
    Stop,
}

/// The checks of [`Request`]'s fields, as serde `deserialize_with` functions.
mod field {
    use std::fmt::Display;
    use std::path::PathBuf;

    use serde::de::{Deserialize, Deserializer, Error};

    /// `T`, with an error that names `name` (serde's own messages inside an
    /// internally tagged enum do not say which field they are about).
    fn named<'de, T: Deserialize<'de>, D: Deserializer<'de>>(
        name: &str,
        d: D,
    ) -> Result<T, D::Error> {
        T::deserialize(d).map_err(|e| invalid::<D>(name, e))
    }

    fn invalid<'de, D: Deserializer<'de>>(name: &str, what: impl Display) -> D::Error {
        D::Error::custom(format_args!("\"{name}\": {what}"))
    }

    /// A non-empty path.
    pub fn path<'de, D: Deserializer<'de>>(d: D) -> Result<PathBuf, D::Error> {
        let p: PathBuf = named("path", d)?;
        if p.as_os_str().is_empty() {
            return Err(invalid::<D>("path", "must not be empty"));
        }
        Ok(p)
    }

    /// A migration address (`tcp:HOST:PORT` or `unix:PATH`).
    pub fn endpoint<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        let s: String = named("to", d)?;
        s.parse::<crate::streams::Endpoint>()
            .map_err(|e| invalid::<D>("to", e))?;
        Ok(s)
    }

    pub fn default_downtime() -> u64 {
        crate::migrate::status::DEFAULT_DOWNTIME_MS
    }

    pub fn default_timeout() -> u64 {
        crate::migrate::status::DEFAULT_TIMEOUT_S
    }

    pub fn default_true() -> bool {
        true
    }

    pub fn default_connections() -> u16 {
        1
    }

    pub fn default_hz() -> u32 {
        crate::profile::DEFAULT_HZ
    }

    /// A sampling rate the profiler takes.
    pub fn hz<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        let hz: u32 = named("hz", d)?;
        crate::profile::check_hz(hz).map_err(|e| invalid::<D>("hz", e))
    }

    /// 0 to [`crate::vstate::vcpu::MAX_THROTTLE`].
    pub fn percent<'de, D: Deserializer<'de>>(d: D) -> Result<u8, D::Error> {
        let max = crate::vstate::vcpu::MAX_THROTTLE;
        let n: u64 = named("percent", d)?;
        u8::try_from(n)
            .ok()
            .filter(|&p| p <= max)
            .ok_or_else(|| invalid::<D>("percent", format_args!("{n} is not 0 to {max}")))
    }

    pub fn action<'de, D: Deserializer<'de>>(d: D) -> Result<super::DirtyLogAction, D::Error> {
        named("action", d)
    }
}

/// What the VM does for each verb. An error goes to the client as its
/// one-line message.
pub trait Control {
    /// State and facts about the VM (merged into the answer).
    fn status(&mut self) -> Value;
    /// Stops vCPUs and devices; returns how long it took, in ms.
    fn pause(&mut self) -> Result<f64, ControlError>;
    fn resume(&mut self) -> Result<(), ControlError>;
    fn metrics(&mut self) -> Value;
    /// Asks the VM to end; the answer is sent before it does.
    fn shutdown(&mut self);
    fn snapshot(&mut self, path: &Path) -> Result<Value, ControlError>;
    /// Takes the VM back to snapshot `path` of itself.
    fn revert(&mut self, _path: &Path) -> Result<Value, ControlError> {
        Err(VmOpError::Unavailable("revert").into())
    }
    /// Starts the guest profiler at `hz` samples per second.
    fn profile_start(&mut self, _hz: u32) -> Result<Value, ControlError> {
        Err(VmOpError::Unavailable("profiling").into())
    }
    /// Stops the guest profiler and writes its folded stacks to `path`.
    fn profile_stop(&mut self, _path: &Path) -> Result<Value, ControlError> {
        Err(VmOpError::Unavailable("profiling").into())
    }
    /// Makes every vCPU sleep `percent` of each throttle window.
    fn throttle(&mut self, _percent: u8) -> Result<Value, ControlError> {
        Err(VmOpError::Unavailable("throttling").into())
    }
    /// Starts, reads or stops the dirty log of guest memory.
    fn dirty_log(&mut self, _action: DirtyLogAction) -> Result<Value, ControlError> {
        Err(VmOpError::Unavailable("the dirty log").into())
    }
    /// Starts a live migration to `to`.
    fn migrate(
        &mut self,
        _to: &str,
        _params: crate::migrate::Params,
    ) -> Result<Value, ControlError> {
        Err(VmOpError::Unavailable("migration").into())
    }
    /// The migration's progress (or its report, once it ended).
    fn migrate_status(&mut self) -> Result<Value, ControlError> {
        Err(VmOpError::Unavailable("migration").into())
    }
    /// Cancels the migration under way; the guest runs on here.
    fn migrate_cancel(&mut self) -> Result<Value, ControlError> {
        Err(VmOpError::Unavailable("migration").into())
    }
    /// Switches the migration under way to post-copy.
    fn migrate_postcopy(&mut self) -> Result<Value, ControlError> {
        Err(VmOpError::Unavailable("migration").into())
    }
    /// Starts a COLO pair with this VM as its primary.
    fn colo_start(
        &mut self,
        _params: crate::colo::Params,
        _arbiter: crate::colo::arbiter::ArbiterSpec,
    ) -> Result<Value, ControlError> {
        Err(VmOpError::Unavailable("COLO").into())
    }
    /// Protects this VM, which serves alone, with a new secondary.
    fn colo_reprotect(&mut self, _params: crate::colo::Params) -> Result<Value, ControlError> {
        Err(VmOpError::Unavailable("COLO").into())
    }
    /// This VM's side of its COLO pair; `failover` and `checkpoint` ask
    /// the side for one first.
    fn colo(&mut self, _ask: ColoAsk) -> Result<Value, ControlError> {
        Err(VmOpError::Unavailable("COLO").into())
    }
}

/// What a COLO verb asks of the side besides its report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColoAsk {
    Status,
    Failover,
    Checkpoint,
}

impl Request {
    /// Parses one request: a JSON object with `cmd` and exactly the fields
    /// that verb takes.
    pub fn parse(line: &[u8]) -> Result<Request, ApiError> {
        // Serde's internally tagged enums also take a sequence (tag first):
        // the wire format is objects only.
        if line.trim_ascii_start().first() != Some(&b'{') {
            return Err(ApiError::NotObject);
        }
        serde_json::from_slice(line).map_err(ApiError::Json)
    }
}

/// `e`'s message; when a file was refused while Landlock confines this
/// process, with what to add (a path the VMM was not started with).
fn with_landlock_hint(e: &ControlError) -> String {
    // A transparent wrapper hides its io::Error from `source()`: the
    // message says it (EACCES's text).
    let message = e.to_string();
    let denied = message.contains("Permission denied (os error 13)");
    if denied && crate::sandbox::landlock::active() {
        format!(
            "{message} (Landlock: this VMM may open only the paths it was started with; \
             start it with --landlock-rule DIR:rw for this file's directory, \
             see docs/sandbox.md)"
        )
    } else {
        message
    }
}

/// Parses one request line and runs it; always returns an answer.
pub fn handle_line(line: &[u8], ctl: &mut dyn Control) -> Value {
    let req = match Request::parse(line) {
        Ok(r) => r,
        Err(e) => return json!({"ok": false, "error": format!("bad request: {e}")}),
    };
    let answer = |r: Result<Value, ControlError>| match r {
        Ok(mut v) => {
            if let Some(o) = v.as_object_mut() {
                o.insert("ok".into(), Value::Bool(true));
            }
            v
        }
        Err(e) => json!({"ok": false, "error": with_landlock_hint(&e)}),
    };
    match req {
        Request::Status {} => answer(Ok(ctl.status())),
        Request::Pause {} => answer(
            ctl.pause()
                .map(|ms| json!({"state": "paused", "pause_ms": ms})),
        ),
        Request::Resume {} => answer(ctl.resume().map(|()| json!({"state": "running"}))),
        Request::Metrics {} => answer(Ok(json!({"metrics": ctl.metrics()}))),
        Request::Shutdown {} => {
            ctl.shutdown();
            json!({"ok": true})
        }
        Request::Snapshot { path } => answer(ctl.snapshot(&path)),
        Request::Revert { path } => answer(ctl.revert(&path)),
        Request::ProfileStart { hz } => answer(ctl.profile_start(hz)),
        Request::ProfileStop { path } => answer(ctl.profile_stop(&path)),
        Request::Throttle { percent } => answer(ctl.throttle(percent)),
        Request::DirtyLog { action } => answer(ctl.dirty_log(action)),
        r @ Request::Migrate { .. } => answer(migrate(ctl, r)),
        Request::MigratePostcopy {} => answer(ctl.migrate_postcopy()),
        Request::MigrateStatus {} => answer(ctl.migrate_status()),
        Request::MigrateCancel {} => answer(ctl.migrate_cancel()),
        Request::ColoStart {
            to,
            lease,
            arbiter,
            lease_ttl_s,
            pair,
        } => answer(colo_start(
            ctl,
            &to,
            pair,
            arbiter.as_deref(),
            lease,
            lease_ttl_s,
        )),
        Request::ColoReprotect { to, pair } => {
            answer(pair_to(&to, pair).and_then(|params| ctl.colo_reprotect(params)))
        }
        Request::ColoStatus {} => answer(ctl.colo(ColoAsk::Status)),
        Request::ColoFailover {} => answer(ctl.colo(ColoAsk::Failover)),
        Request::ColoCheckpoint {} => answer(ctl.colo(ColoAsk::Checkpoint)),
    }
}

/// A `migrate` request's migration, started.
fn migrate(ctl: &mut dyn Control, r: Request) -> Result<Value, ControlError> {
    let Request::Migrate {
        to,
        downtime_ms,
        bandwidth_mib,
        auto_converge,
        timeout_s,
        mode,
        initially_set,
        connections,
        postcopy,
        postcopy_after_rounds,
    } = r
    else {
        return Err(VmOpError::Unavailable("migration").into());
    };
    let params = crate::migrate::Params {
        downtime_ms,
        bandwidth_mib,
        auto_converge,
        timeout_s,
        mode,
        initially_set,
        connections,
        postcopy,
        postcopy_after_rounds,
    };
    ctl.migrate(&to, params)
}

/// The pair of `pair` with the secondary at `to`.
fn pair_to(to: &str, pair: crate::colo::PairParams) -> Result<crate::colo::Params, ControlError> {
    let to = to
        .parse::<crate::streams::Endpoint>()
        .map_err(ControlError::colo)?;
    Ok(crate::colo::Params { to, pair })
}

/// `colo_start`: the pair and its arbiter, then the verb.
fn colo_start(
    ctl: &mut dyn Control,
    to: &str,
    pair: crate::colo::PairParams,
    arbiter: Option<&str>,
    lease: Option<PathBuf>,
    lease_ttl_s: Option<u32>,
) -> Result<Value, ControlError> {
    let params = pair_to(to, pair)?;
    let arbiter =
        crate::colo::arbiter::ArbiterSpec::from_options(arbiter, lease, lease_ttl_s, &params.to)
            .map_err(|e| ControlError::colo(Refused::Invalid(e)))?;
    ctl.colo_start(params, arbiter)
}

struct Client {
    stream: UnixStream,
    buf: Vec<u8>,
}

/// The API socket on the event loop.
pub struct ApiServer {
    listener: UnixListener,
    path: PathBuf,
    clients: HashMap<u32, Client>,
    next_id: u32,
    ctl: Box<dyn Control + Send>,
}

impl ApiServer {
    /// Binds `path` (a stale socket file there is replaced; any other file
    /// is an error).
    pub fn bind(path: &Path, ctl: Box<dyn Control + Send>) -> Result<ApiServer, ApiError> {
        let err = |err| ApiError::Bind {
            path: path.to_path_buf(),
            err,
        };
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(err(std::io::Error::new(
                    ErrorKind::AlreadyExists,
                    "exists and is not a socket",
                )));
            }
            if UnixStream::connect(path).is_ok() {
                return Err(err(std::io::Error::new(
                    ErrorKind::AddrInUse,
                    "another VMM is listening there",
                )));
            }
            std::fs::remove_file(path).map_err(err)?;
        }
        let listener = UnixListener::bind(path).map_err(err)?;
        listener.set_nonblocking(true).map_err(err)?;
        Ok(ApiServer {
            listener,
            path: path.to_path_buf(),
            clients: HashMap::new(),
            next_id: 0,
            ctl,
        })
    }

    /// Replaces what the verbs act on (the VM, once it runs).
    pub fn set_control(&mut self, ctl: Box<dyn Control + Send>) {
        self.ctl = ctl;
    }

    fn accept(&mut self, ops: &mut EventOps) {
        loop {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    log::warn!("api: accept: {e}");
                    return;
                }
            };
            if self.clients.len() >= MAX_CLIENTS {
                let mut s = stream;
                let _ = s.set_write_timeout(Some(WRITE_TIMEOUT));
                let _ = writeln!(s, "{}", json!({"ok": false, "error": "too many clients"}));
                continue;
            }
            // Blocking, with a write timeout: reads happen only when epoll
            // says there is data, and answers are small.
            if stream.set_nonblocking(false).is_err()
                || stream.set_write_timeout(Some(WRITE_TIMEOUT)).is_err()
            {
                continue;
            }
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1) % LISTENER;
            if let Err(e) = ops.add(Events::with_data(&stream, id, EventSet::IN)) {
                log::warn!("api: cannot watch a client: {e:?}");
                continue;
            }
            self.clients.insert(
                id,
                Client {
                    stream,
                    buf: Vec::new(),
                },
            );
        }
    }

    /// Reads what a client sent and answers each complete line. Returns
    /// false when the client is gone or must be dropped.
    fn serve(&mut self, id: u32) -> bool {
        let Some(client) = self.clients.get_mut(&id) else {
            return false;
        };
        let mut chunk = [0u8; 4096];
        let n = match client.stream.read(&mut chunk) {
            Ok(0) => return false,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted || e.kind() == ErrorKind::WouldBlock => {
                return true
            }
            Err(_) => return false,
        };
        client.buf.extend_from_slice(&chunk[..n]);
        while let Some(end) = client.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = client.buf.drain(..=end).collect();
            let line = line.trim_ascii();
            if line.is_empty() {
                continue;
            }
            let answer = handle_line(line, self.ctl.as_mut());
            if writeln!(client.stream, "{answer}").is_err() {
                return false;
            }
        }
        if client.buf.len() > MAX_REQUEST {
            let answer =
                json!({"ok": false, "error": format!("request longer than {MAX_REQUEST} bytes")});
            let _ = writeln!(client.stream, "{answer}");
            return false;
        }
        true
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl MutEventSubscriber for ApiServer {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::with_data(&self.listener, LISTENER, EventSet::IN)) {
            log::error!("api: cannot watch the socket: {e:?}");
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let id = events.data();
        if id == LISTENER {
            self.accept(ops);
            return;
        }
        if !self.serve(id) {
            if let Some(c) = self.clients.remove(&id) {
                let _ = ops.remove(Events::with_data_raw(
                    c.stream.as_raw_fd(),
                    id,
                    EventSet::IN,
                ));
            }
        }
    }
}

/// The client side (`tandem ctl`): sends one request, returns the answer.
pub fn request(path: &Path, req: &Request) -> Result<Value, ApiError> {
    let mut line = serde_json::to_vec(req).map_err(ApiError::Encode)?;
    line.push(b'\n');
    let mut s = UnixStream::connect(path).map_err(|source| ApiError::Connect {
        path: path.to_path_buf(),
        source,
    })?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
    s.write_all(&line).map_err(ApiError::Send)?;
    let mut answer = Vec::new();
    BufReader::new(s)
        .take(MAX_ANSWER)
        .read_until(b'\n', &mut answer)
        .map_err(ApiError::NoAnswer)?;
    match answer.last() {
        None => return Err(ApiError::Closed),
        Some(b'\n') => {}
        Some(_) if answer.len() as u64 >= MAX_ANSWER => return Err(ApiError::AnswerTooLong),
        Some(_) => {}
    }
    serde_json::from_slice(&answer).map_err(ApiError::Answer)
}

#[cfg(test)]
mod tests;

//! The control API: a Unix socket (`tandem run --api-sock PATH`) that takes
//! one JSON request per line and answers each with one JSON line.
//!
//! Requests (`cmd` selects the verb; unknown fields are refused):
//! ```text
//! {"cmd":"status"}                 -> {"ok":true,"state":"running"|"paused",...}
//! {"cmd":"pause"}                  -> {"ok":true,"state":"paused","pause_ms":...}
//! {"cmd":"resume"}                 -> {"ok":true,"state":"running"}
//! {"cmd":"metrics"}                -> {"ok":true,"metrics":{...}}
//! {"cmd":"shutdown"}               -> {"ok":true}, then the VMM exits (status 0)
//! {"cmd":"snapshot","path":"F"}    -> {"ok":true,"path":"F","file_bytes":...}
//! {"cmd":"profile_start","hz":N}   -> {"ok":true,"hz":N,...} (hz optional, default 1000)
//! {"cmd":"profile_stop","path":"F"} -> {"ok":true,"samples":...,"top":[...],"table":"..."}
//! {"cmd":"throttle","percent":N}   -> {"ok":true,"percent":N} (0 to 99; 0: off)
//! {"cmd":"dirty_log","action":"start"|"read"|"stop"}
//!                                  -> {"ok":true,"logging":...,"pages":...,"kvm_pages":...,...}
//! ```
//! Any failure is `{"ok":false,"error":"..."}`; a malformed request, an
//! oversized line or a client that goes away never affects the VM.
//!
//! Runs on the VMM thread as an event-manager subscriber; the work of each
//! verb is done by a [`Control`] that the VM provides.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use serde_json::{json, Value};

/// The longest request line taken.
pub const MAX_REQUEST: usize = 64 << 10;
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
const MAX_CLIENTS: usize = 16;
const LISTENER: u32 = u32::MAX;

/// API errors (setting up the socket; requests fail with JSON errors).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("--api-sock {path}: {err}")]
    Bind { path: PathBuf, err: std::io::Error },
}

/// One request.
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    Status,
    Pause,
    Resume,
    Metrics,
    Shutdown,
    Snapshot { path: PathBuf },
    ProfileStart { hz: u32 },
    ProfileStop { path: PathBuf },
    DirtyLog { action: DirtyLogAction },
    Throttle { percent: u8 },
}

/// What `dirty_log` does: turn KVM's dirty log on, read (and reset) what
/// was written since the last read, or turn it off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirtyLogAction {
    Start,
    Read,
    Stop,
}

impl DirtyLogAction {
    /// `start`, `read` or `stop`.
    pub fn parse(s: &str) -> Result<DirtyLogAction, String> {
        match s {
            "start" => Ok(DirtyLogAction::Start),
            "read" => Ok(DirtyLogAction::Read),
            "stop" => Ok(DirtyLogAction::Stop),
            other => Err(format!(
                "dirty_log: \"action\" is start, read or stop, not {other:?}"
            )),
        }
    }
}

/// What the VM does for each verb. Errors are messages for the client.
pub trait Control {
    /// State and facts about the VM (merged into the answer).
    fn status(&mut self) -> Value;
    /// Stops vCPUs and devices; returns how long it took, in ms.
    fn pause(&mut self) -> Result<f64, String>;
    fn resume(&mut self) -> Result<(), String>;
    fn metrics(&mut self) -> Value;
    /// Asks the VM to end; the answer is sent before it does.
    fn shutdown(&mut self);
    fn snapshot(&mut self, path: &Path) -> Result<Value, String>;
    /// Starts the guest profiler at `hz` samples per second.
    fn profile_start(&mut self, _hz: u32) -> Result<Value, String> {
        Err("profiling is not available".into())
    }
    /// Stops the guest profiler and writes its folded stacks to `path`.
    fn profile_stop(&mut self, _path: &Path) -> Result<Value, String> {
        Err("profiling is not available".into())
    }
    /// Makes every vCPU sleep `percent` of each throttle window.
    fn throttle(&mut self, _percent: u8) -> Result<Value, String> {
        Err("throttling is not available".into())
    }
    /// Starts, reads or stops the dirty log of guest memory.
    fn dirty_log(&mut self, _action: DirtyLogAction) -> Result<Value, String> {
        Err("the dirty log is not available".into())
    }
}

/// A non-empty `path` string field of `obj`.
fn path_field(obj: &serde_json::Map<String, Value>, cmd: &str) -> Result<PathBuf, String> {
    obj.get("path")
        .and_then(Value::as_str)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .ok_or_else(|| format!("{cmd} needs a \"path\" string"))
}

impl Request {
    /// Parses one request: a JSON object with `cmd` and exactly the fields
    /// that verb takes.
    pub fn parse(line: &[u8]) -> Result<Request, String> {
        let v: Value = serde_json::from_slice(line).map_err(|e| e.to_string())?;
        let obj = v.as_object().ok_or("not a JSON object")?;
        let cmd = obj
            .get("cmd")
            .and_then(Value::as_str)
            .ok_or("no \"cmd\" string")?;
        let (req, fields): (Request, &[&str]) = match cmd {
            "status" => (Request::Status, &[]),
            "pause" => (Request::Pause, &[]),
            "resume" => (Request::Resume, &[]),
            "metrics" => (Request::Metrics, &[]),
            "shutdown" => (Request::Shutdown, &[]),
            "snapshot" => (
                Request::Snapshot {
                    path: path_field(obj, cmd)?,
                },
                &["path"],
            ),
            "profile_start" => {
                let hz = match obj.get("hz") {
                    None => crate::profile::DEFAULT_HZ,
                    Some(v) => v
                        .as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or("profile_start: \"hz\" must be a whole number")?,
                };
                let hz = crate::profile::check_hz(hz).map_err(|e| e.to_string())?;
                (Request::ProfileStart { hz }, &["hz"])
            }
            "profile_stop" => (
                Request::ProfileStop {
                    path: path_field(obj, cmd)?,
                },
                &["path"],
            ),
            "dirty_log" => {
                let action = obj
                    .get("action")
                    .and_then(Value::as_str)
                    .ok_or("dirty_log needs an \"action\" string")?;
                (
                    Request::DirtyLog {
                        action: DirtyLogAction::parse(action)?,
                    },
                    &["action"],
                )
            }
            "throttle" => {
                let percent = obj
                    .get("percent")
                    .and_then(Value::as_u64)
                    .and_then(|n| u8::try_from(n).ok())
                    .filter(|&p| p <= crate::vcpu::MAX_THROTTLE)
                    .ok_or_else(|| {
                        format!(
                            "throttle needs a \"percent\" from 0 to {}",
                            crate::vcpu::MAX_THROTTLE
                        )
                    })?;
                (Request::Throttle { percent }, &["percent"])
            }
            other => return Err(format!("unknown cmd {other:?}")),
        };
        if let Some(k) = obj
            .keys()
            .find(|k| *k != "cmd" && !fields.contains(&k.as_str()))
        {
            return Err(format!("{cmd} takes no field {k:?}"));
        }
        Ok(req)
    }
}

/// Parses one request line and runs it; always returns an answer.
pub fn handle_line(line: &[u8], ctl: &mut dyn Control) -> Value {
    let req = match Request::parse(line) {
        Ok(r) => r,
        Err(e) => return json!({"ok": false, "error": format!("bad request: {e}")}),
    };
    let merge = |mut v: Value| {
        if let Some(o) = v.as_object_mut() {
            o.insert("ok".into(), Value::Bool(true));
        }
        v
    };
    match req {
        Request::Status => merge(ctl.status()),
        Request::Pause => match ctl.pause() {
            Ok(ms) => json!({"ok": true, "state": "paused", "pause_ms": ms}),
            Err(e) => json!({"ok": false, "error": e}),
        },
        Request::Resume => match ctl.resume() {
            Ok(()) => json!({"ok": true, "state": "running"}),
            Err(e) => json!({"ok": false, "error": e}),
        },
        Request::Metrics => json!({"ok": true, "metrics": ctl.metrics()}),
        Request::Shutdown => {
            ctl.shutdown();
            json!({"ok": true})
        }
        Request::Snapshot { path } => match ctl.snapshot(&path) {
            Ok(v) => merge(v),
            Err(e) => json!({"ok": false, "error": e}),
        },
        Request::ProfileStart { hz } => match ctl.profile_start(hz) {
            Ok(v) => merge(v),
            Err(e) => json!({"ok": false, "error": e}),
        },
        Request::ProfileStop { path } => match ctl.profile_stop(&path) {
            Ok(v) => merge(v),
            Err(e) => json!({"ok": false, "error": e}),
        },
        Request::Throttle { percent } => match ctl.throttle(percent) {
            Ok(v) => merge(v),
            Err(e) => json!({"ok": false, "error": e}),
        },
        Request::DirtyLog { action } => match ctl.dirty_log(action) {
            Ok(v) => merge(v),
            Err(e) => json!({"ok": false, "error": e}),
        },
    }
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
pub fn request(path: &Path, req: &Value) -> Result<Value, String> {
    let mut s = UnixStream::connect(path)
        .map_err(|e| format!("cannot connect to {}: {e}", path.display()))?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
    writeln!(s, "{req}").map_err(|e| format!("cannot send the request: {e}"))?;
    let mut answer = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        match s.read(&mut byte) {
            Ok(0) => break,
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) => answer.push(byte[0]),
            Err(e) => return Err(format!("no answer: {e}")),
        }
    }
    serde_json::from_slice(&answer).map_err(|e| format!("unreadable answer: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Fake {
        paused: bool,
        shutdown: bool,
    }

    impl Control for Fake {
        fn status(&mut self) -> Value {
            json!({"state": if self.paused {"paused"} else {"running"}})
        }
        fn pause(&mut self) -> Result<f64, String> {
            if self.paused {
                return Err("already paused".into());
            }
            self.paused = true;
            Ok(1.0)
        }
        fn resume(&mut self) -> Result<(), String> {
            if !self.paused {
                return Err("not paused".into());
            }
            self.paused = false;
            Ok(())
        }
        fn metrics(&mut self) -> Value {
            json!({"net": []})
        }
        fn shutdown(&mut self) {
            self.shutdown = true;
        }
        fn snapshot(&mut self, _: &Path) -> Result<Value, String> {
            Err("not supported".into())
        }
    }

    #[test]
    fn verbs() {
        let mut f = Fake::default();
        assert_eq!(
            handle_line(br#"{"cmd":"status"}"#, &mut f)["state"],
            "running"
        );
        assert_eq!(handle_line(br#"{"cmd":"pause"}"#, &mut f)["ok"], true);
        assert_eq!(
            handle_line(br#"{"cmd":"status"}"#, &mut f)["state"],
            "paused"
        );
        let again = handle_line(br#"{"cmd":"pause"}"#, &mut f);
        assert_eq!(again["ok"], false);
        assert_eq!(again["error"], "already paused");
        assert_eq!(handle_line(br#"{"cmd":"resume"}"#, &mut f)["ok"], true);
        assert_eq!(
            handle_line(br#"{"cmd":"metrics"}"#, &mut f)["metrics"]["net"],
            json!([])
        );
        assert_eq!(
            handle_line(br#"{"cmd":"snapshot","path":"/tmp/x"}"#, &mut f)["ok"],
            false
        );
        assert_eq!(
            Request::parse(br#"{"cmd":"profile_start"}"#),
            Ok(Request::ProfileStart { hz: 1000 })
        );
        assert_eq!(
            Request::parse(br#"{"cmd":"profile_start","hz":250}"#),
            Ok(Request::ProfileStart { hz: 250 })
        );
        let a = handle_line(br#"{"cmd":"profile_stop","path":"/tmp/p"}"#, &mut f);
        assert_eq!(a["error"], "profiling is not available");
        assert_eq!(
            Request::parse(br#"{"cmd":"dirty_log","action":"read"}"#),
            Ok(Request::DirtyLog {
                action: DirtyLogAction::Read
            })
        );
        assert_eq!(
            Request::parse(br#"{"cmd":"throttle","percent":60}"#),
            Ok(Request::Throttle { percent: 60 })
        );
        let a = handle_line(br#"{"cmd":"dirty_log","action":"start"}"#, &mut f);
        assert_eq!(a["error"], "the dirty log is not available");
        assert_eq!(handle_line(br#"{"cmd":"shutdown"}"#, &mut f)["ok"], true);
        assert!(f.shutdown);
    }

    #[test]
    fn bad_requests_get_json_errors() {
        let mut f = Fake::default();
        for bad in [
            &b"not json"[..],
            b"{}",
            b"[]",
            b"{\"cmd\":\"reboot\"}",
            b"{\"cmd\":\"status\",\"extra\":1}",
            b"{\"cmd\":\"snapshot\"}",
            b"{\"cmd\":7}",
            b"{\"cmd\":\"snapshot\",\"path\":\"\"}",
            b"{\"cmd\":\"snapshot\",\"path\":1}",
            b"{\"cmd\":\"profile_start\",\"hz\":0}",
            b"{\"cmd\":\"profile_start\",\"hz\":100000}",
            b"{\"cmd\":\"profile_start\",\"hz\":\"fast\"}",
            b"{\"cmd\":\"profile_start\",\"hz\":-1}",
            b"{\"cmd\":\"profile_stop\"}",
            b"{\"cmd\":\"dirty_log\"}",
            b"{\"cmd\":\"throttle\"}",
            b"{\"cmd\":\"throttle\",\"percent\":100}",
            b"{\"cmd\":\"throttle\",\"percent\":-5}",
            b"{\"cmd\":\"dirty_log\",\"action\":\"clear\"}",
            b"{\"cmd\":\"dirty_log\",\"action\":1}",
            b"{\"cmd\":\"profile_stop\",\"path\":\"x\",\"hz\":1}",
            b"\xff\xfe",
        ] {
            let a = handle_line(bad, &mut f);
            assert_eq!(a["ok"], false, "{}", String::from_utf8_lossy(bad));
            assert!(a["error"].as_str().unwrap().starts_with("bad request"));
        }
        assert!(!f.paused && !f.shutdown);
    }
}

//! The API's parsing and dispatch, with a fake VM.

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
    fn pause(&mut self) -> Result<f64, ControlError> {
        if self.paused {
            return Err(VmOpError::AlreadyPaused.into());
        }
        self.paused = true;
        Ok(1.0)
    }
    fn resume(&mut self) -> Result<(), ControlError> {
        if !self.paused {
            return Err(VmOpError::NotPaused.into());
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
    fn snapshot(&mut self, _: &Path) -> Result<Value, ControlError> {
        Err(VmOpError::Unavailable("snapshots").into())
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
    assert_eq!(again["error"], "the VM is already paused");
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
        Request::parse(br#"{"cmd":"profile_start"}"#).unwrap(),
        Request::ProfileStart { hz: 1000 }
    );
    assert_eq!(
        Request::parse(br#"{"cmd":"profile_start","hz":250}"#).unwrap(),
        Request::ProfileStart { hz: 250 }
    );
    let a = handle_line(br#"{"cmd":"profile_stop","path":"/tmp/p"}"#, &mut f);
    assert_eq!(a["error"], "profiling is not available");
    assert_eq!(
        Request::parse(br#"{"cmd":"dirty_log","action":"read"}"#).unwrap(),
        Request::DirtyLog {
            action: DirtyLogAction::Read
        }
    );
    assert_eq!(
        Request::parse(br#"{"cmd":"throttle","percent":60}"#).unwrap(),
        Request::Throttle { percent: 60 }
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
        b"[\"status\"]",
        b"[\"snapshot\",\"/tmp/x\"]",
        b"{\"cmd\":\"status\",\"cmd\":\"pause\"}",
        b"{\"cmd\":\"snapshot\",\"path\":\"a\",\"path\":\"b\"}",
        b"{\"cmd\":\"status\"} {\"cmd\":\"pause\"}",
        b"{\"cmd\":\"throttle\",\"percent\":1.5}",
        b"{\"cmd\":\"throttle\",\"percent\":null}",
    ] {
        let a = handle_line(bad, &mut f);
        assert_eq!(a["ok"], false, "{}", String::from_utf8_lossy(bad));
        assert!(a["error"].as_str().unwrap().starts_with("bad request"));
    }
    assert!(!f.paused && !f.shutdown);
}

/// `tandem ctl` serializes the same type: the wire format of each verb.
#[test]
fn requests_serialize_to_the_documented_lines_and_back() {
    for (req, line) in [
        (Request::Status {}, r#"{"cmd":"status"}"#),
        (Request::Pause {}, r#"{"cmd":"pause"}"#),
        (Request::Resume {}, r#"{"cmd":"resume"}"#),
        (Request::Metrics {}, r#"{"cmd":"metrics"}"#),
        (Request::Shutdown {}, r#"{"cmd":"shutdown"}"#),
        (
            Request::Snapshot {
                path: "/tmp/s".into(),
            },
            r#"{"cmd":"snapshot","path":"/tmp/s"}"#,
        ),
        (
            Request::ProfileStart { hz: 1000 },
            r#"{"cmd":"profile_start","hz":1000}"#,
        ),
        (
            Request::ProfileStop {
                path: "/tmp/p".into(),
            },
            r#"{"cmd":"profile_stop","path":"/tmp/p"}"#,
        ),
        (
            Request::DirtyLog {
                action: DirtyLogAction::Stop,
            },
            r#"{"cmd":"dirty_log","action":"stop"}"#,
        ),
        (
            Request::Throttle { percent: 99 },
            r#"{"cmd":"throttle","percent":99}"#,
        ),
        (
            Request::Migrate {
                to: "unix:/tmp/m".into(),
                downtime_ms: 300,
                bandwidth_mib: Some(128),
                auto_converge: true,
                timeout_s: 600,
                mode: crate::migrate::Mode::Inline,
                initially_set: false,
                connections: 4,
                postcopy: true,
                postcopy_after_rounds: Some(3),
            },
            r#"{"cmd":"migrate","to":"unix:/tmp/m","downtime_ms":300,"bandwidth_mib":128,"auto_converge":true,"timeout_s":600,"mode":"inline","initially_set":false,"connections":4,"postcopy":true,"postcopy_after_rounds":3}"#,
        ),
        (Request::MigratePostcopy {}, r#"{"cmd":"migrate_postcopy"}"#),
    ] {
        assert_eq!(serde_json::to_string(&req).unwrap(), line);
        assert_eq!(Request::parse(line.as_bytes()).unwrap(), req, "{line}");
        // Whitespace and key order are free.
        let spaced = format!(" {} ", line.replace(',', " , "));
        assert_eq!(Request::parse(spaced.as_bytes()).unwrap(), req, "{spaced}");
    }
    assert_eq!(
        Request::parse(br#"{"path":"/x","cmd":"snapshot"}"#).unwrap(),
        Request::Snapshot { path: "/x".into() }
    );
}

/// `deny_unknown_fields` holds for every variant of the internally
/// tagged enum, with fields and without, wherever the stray key is.
#[test]
fn every_verb_refuses_a_field_it_does_not_take() {
    for line in [
        r#"{"cmd":"status","bogus":1}"#,
        r#"{"bogus":1,"cmd":"pause"}"#,
        r#"{"cmd":"resume","bogus":null}"#,
        r#"{"cmd":"metrics","bogus":{}}"#,
        r#"{"cmd":"shutdown","bogus":"now"}"#,
        r#"{"cmd":"snapshot","path":"/x","bogus":1}"#,
        r#"{"cmd":"profile_start","bogus":1}"#,
        r#"{"cmd":"profile_stop","bogus":1,"path":"/x"}"#,
        r#"{"cmd":"dirty_log","action":"read","bogus":1}"#,
        r#"{"cmd":"throttle","percent":1,"bogus":1}"#,
    ] {
        let e = Request::parse(line.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("unknown field `bogus`"), "{line}: {e}");
    }
}

/// Each refused field is named in the error.
#[test]
fn field_errors_name_the_field() {
    for (line, expect) in [
        (r#"{"cmd":"snapshot"}"#, "missing field `path`"),
        (
            r#"{"cmd":"snapshot","path":""}"#,
            "\"path\": must not be empty",
        ),
        (
            r#"{"cmd":"snapshot","path":1}"#,
            "\"path\": invalid type: integer",
        ),
        (
            r#"{"cmd":"profile_stop","path":[]}"#,
            "\"path\": invalid type",
        ),
        (
            r#"{"cmd":"profile_start","hz":0}"#,
            "\"hz\": sampling rate must be 1 to",
        ),
        (
            r#"{"cmd":"profile_start","hz":"fast"}"#,
            "\"hz\": invalid type: string",
        ),
        (
            r#"{"cmd":"profile_start","hz":-1}"#,
            "\"hz\": invalid value",
        ),
        (r#"{"cmd":"throttle"}"#, "missing field `percent`"),
        (
            r#"{"cmd":"migrate","to":"unix:/m","mode":"fast"}"#,
            "unknown variant `fast`, expected `thread` or `inline`",
        ),
        (
            r#"{"cmd":"throttle","percent":100}"#,
            "\"percent\": 100 is not 0 to 99",
        ),
        (
            r#"{"cmd":"throttle","percent":256}"#,
            "\"percent\": 256 is not 0 to 99",
        ),
        (
            r#"{"cmd":"throttle","percent":-5}"#,
            "\"percent\": invalid value",
        ),
        (r#"{"cmd":"dirty_log"}"#, "missing field `action`"),
        (
            r#"{"cmd":"dirty_log","action":"clear"}"#,
            "\"action\": unknown variant `clear`, expected one of `start`, `read`, `stop`",
        ),
        (r#"{"cmd":"reboot"}"#, "unknown variant `reboot`"),
        (r#"{"cmd":7}"#, "invalid type: integer `7`"),
        (r#"{}"#, "missing field `cmd`"),
        (r#"["status"]"#, "not a JSON object"),
    ] {
        let e = Request::parse(line.as_bytes()).unwrap_err().to_string();
        assert!(e.contains(expect), "{line}: {e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }
    let a = handle_line(br#"{"cmd":"throttle","percent":100}"#, &mut Fake::default());
    assert_eq!(a["error"], "bad request: \"percent\": 100 is not 0 to 99");
}

/// The COLO verbs take the pair's parameters flattened: each optional
/// (the defaults of `colo::PairParams`), a stray key still refused.
#[test]
fn colo_verbs_take_the_pair_parameters_flattened() {
    let start = Request::parse(br#"{"cmd":"colo_start","to":"unix:/tmp/c","heartbeat_ms":50}"#);
    let Ok(Request::ColoStart {
        to, pair, lease, ..
    }) = start
    else {
        panic!("{start:?}");
    };
    assert_eq!(to, "unix:/tmp/c");
    assert_eq!(lease, None);
    assert_eq!(
        pair,
        crate::colo::PairParams {
            heartbeat_ms: 50,
            ..Default::default()
        }
    );
    let line = br#"{"cmd":"colo_reprotect","to":"unix:/tmp/c"}"#;
    assert_eq!(
        Request::parse(line).unwrap(),
        Request::ColoReprotect {
            to: "unix:/tmp/c".into(),
            pair: crate::colo::PairParams::default(),
        }
    );
    for line in [
        r#"{"cmd":"colo_start","to":"unix:/tmp/c","bogus":1}"#,
        r#"{"cmd":"colo_reprotect","to":"unix:/tmp/c","lease":"/x"}"#,
    ] {
        let e = Request::parse(line.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("unknown field"), "{line}: {e}");
    }
}

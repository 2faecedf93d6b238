//! `tandem ctl migrate`: starts a migration through the control API,
//! follows it (a live progress line on a terminal) and prints its report.
//!
//! Runs in the `tandem ctl` process, not in the VMM. Never does: decide
//! anything about the migration; it only asks and shows.

use std::io::IsTerminal;
use std::path::Path;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;

use crate::api::{self, ApiError, Request};

const POLL: Duration = Duration::from_millis(100);

/// Starts the migration `req` on the VM at `sock` and follows it to its
/// end; prints the report (as JSON with `json`). Returns whether it
/// completed.
pub fn follow(sock: &Path, req: &Request, json: bool) -> Result<bool, ApiError> {
    let answer = api::request(sock, req)?;
    if answer["ok"] != true {
        print_refusal(&answer, json);
        return Ok(false);
    }
    let bar = (!json && std::io::stderr().is_terminal()).then(|| {
        let b = ProgressBar::new_spinner();
        b.set_style(
            ProgressStyle::with_template("{spinner} {elapsed:>4} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        b.enable_steady_tick(Duration::from_millis(100));
        b
    });
    let last = loop {
        std::thread::sleep(POLL);
        let a = api::request(sock, &Request::MigrateStatus {})?;
        let m = a["migration"].clone();
        if let Some(b) = &bar {
            b.set_message(progress_line(&m));
        }
        if matches!(
            m["phase"].as_str(),
            Some("completed" | "failed" | "cancelled")
        ) {
            break m;
        }
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if json {
        println!("{}", serde_json::to_string(&last).unwrap_or_default());
    } else {
        print!("{}", report_text(&last));
    }
    Ok(last["phase"] == "completed")
}

fn print_refusal(answer: &Value, json: bool) {
    if json {
        println!("{answer}");
    } else {
        eprintln!(
            "tandem: migrate: {}",
            answer["error"].as_str().unwrap_or("refused")
        );
    }
}

fn mib(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0) / f64::from(1 << 20)
}

/// One line of progress: phase, round, what is left, rates, throttle.
pub fn progress_line(m: &Value) -> String {
    format!(
        "{} round {}  {:.1} MiB sent, {:.1} MiB left  send {:.0} MiB/s  dirty {:.0} MiB/s  throttle {}%",
        m["phase"].as_str().unwrap_or("?"),
        m["round"],
        mib(&m["sent_bytes"]),
        mib(&m["remaining_bytes"]),
        m["send_rate_mib"].as_f64().unwrap_or(0.0),
        m["dirty_rate_mib"].as_f64().unwrap_or(0.0),
        m["throttle"],
    )
}

/// The end report, as text.
pub fn report_text(m: &Value) -> String {
    let f = |k: &str| m[k].as_f64().unwrap_or(0.0);
    let mut out = format!(
        "migration to {}: {}\n",
        m["to"].as_str().unwrap_or("?"),
        m["phase"].as_str().unwrap_or("?")
    );
    if let Some(e) = m["error"].as_str() {
        out += &format!("  error: {e}\n  the guest runs on at the source\n");
    }
    out += &format!(
        "  total {:.0} ms, setup {:.0} ms",
        f("total_ms"),
        f("setup_ms")
    );
    match m["downtime_ms"].as_f64() {
        Some(d) => {
            let budget = m["params"]["downtime_ms"].as_f64().unwrap_or(0.0);
            let over = if d > budget { " (over the budget)" } else { "" };
            out += &format!(", downtime {d:.0} ms of {budget:.0} ms budget{over}\n");
        }
        None => out += "\n",
    }
    out += &format!(
        "  {:.1} MiB sent, {} pages ({} zero)\n  rounds {}: pages per round {}\n  throttle reached {}%\n",
        mib(&m["sent_bytes"]),
        m["pages"],
        m["zero_pages"],
        m["rounds"].as_array().map_or(0, Vec::len),
        m["rounds"],
        m["throttle"],
    );
    out
}

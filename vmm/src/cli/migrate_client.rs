//! `tandem ctl migrate`: starts a migration through the control API,
//! follows it (a live progress line on a terminal) and prints its report,
//! with `--probe` what the guest felt before vs during it
//! ([`super::probe`]).
//!
//! Runs in the `tandem ctl` process, not in the VMM. Never does: decide
//! anything about the migration; it only asks and shows.

use std::io::IsTerminal;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

use super::probe::{self, Probe, ProbeConfig, ProbeError};
use crate::api::{self, ApiError, Request};
use crate::migrate::{status, Mode};
use crate::streams::Endpoint;

use super::values::{self, ModeArg};

const POLL: Duration = Duration::from_millis(100);

/// `tandem ctl migrate`'s arguments.
#[derive(Debug, clap::Args)]
pub struct MigrateArgs {
    /// Where: tcp:HOST:PORT or unix:PATH (what the destination's
    /// --incoming was given).
    #[arg(value_name = "ADDR", value_parser = |s: &str| s.parse::<Endpoint>())]
    pub to: Endpoint,
    /// The longest the guest may stay paused at the switch-over, ms.
    #[arg(long, value_name = "MS", default_value_t = status::DEFAULT_DOWNTIME_MS,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub downtime_ms: u64,
    /// Send at most this many MiB/s (default: unlimited).
    #[arg(long, value_name = "MIB_PER_S", value_parser = clap::value_parser!(u64).range(1..))]
    pub bandwidth: Option<u64>,
    /// Throttle the vCPUs step by step when the guest dirties memory
    /// faster than it is sent.
    #[arg(long, value_name = "on|off", default_value = "on", action = clap::ArgAction::Set,
          hide_possible_values = true, value_parser = clap::builder::BoolishValueParser::new())]
    pub auto_converge: bool,
    /// Give up after this many seconds (the guest runs on here).
    #[arg(long, value_name = "S", default_value_t = status::DEFAULT_TIMEOUT_S,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout_s: u64,
    /// Where the migration runs: its own thread, or `inline` in slices
    /// from the device thread's event loop (as QEMU's I/O thread once did;
    /// to measure what the thread buys).
    #[arg(long, default_value = "thread", value_parser = values::parser::<ModeArg, Mode>())]
    pub mode: Mode,
    /// Start KVM's dirty log with every page dirty, where KVM offers it
    /// (KVM_DIRTY_LOG_INITIALLY_SET): memory is write-protected chunk by
    /// chunk as the first round copies it, not all at once at the start
    /// (a stall of milliseconds per GiB). `off` protects it all at the
    /// start, to measure the difference.
    #[arg(long, value_name = "on|off", default_value = "on", action = clap::ArgAction::Set,
          hide_possible_values = true, value_parser = clap::builder::BoolishValueParser::new())]
    pub initially_set: bool,
    /// Send the pages over this many streams at once (1 to 16), each by
    /// its own thread, the final paused copy too; the destination applies
    /// the state once every stream has delivered its share. Each stream is
    /// authenticated as the first (TLS), and one that breaks fails the
    /// migration (the guest runs on here).
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=16))]
    pub connections: u16,
    /// Switch to post-copy when the pre-copy rounds stop shrinking the
    /// dirty set: the destination runs the guest at once and fetches its
    /// missing pages from here on demand (faulted ones first, the rest in
    /// the background), so any workload ends in bounded time. Once it
    /// switched, neither side alone holds the guest: a broken link loses
    /// it. `tandem ctl migrate-postcopy` switches by hand.
    #[arg(long)]
    pub postcopy: bool,
    /// With --postcopy: switch after this many rounds at the latest
    /// (round 0, all of memory, counts).
    #[arg(long, value_name = "N", requires = "postcopy",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub postcopy_after_rounds: Option<u32>,
    /// Measure what the guest feels: ping GUEST_IP from here (every
    /// --probe-interval-ms) and collect the gaps `tandem-jitter HOST_IP:PORT`, run in the guest,
    /// reports over UDP; the report adds before vs during figures. Runs in
    /// this command's network namespace.
    #[arg(long, value_name = "GUEST_IP")]
    pub probe: Option<Ipv4Addr>,
    /// The UDP port the guest's `tandem-jitter` sends to.
    #[arg(long, value_name = "PORT", default_value_t = 7777, requires = "probe")]
    pub probe_port: u16,
    /// How often the probe pings the guest, ms.
    #[arg(long, value_name = "MS", default_value_t = 10, requires = "probe",
          value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub probe_interval_ms: u64,
    /// Seconds probed before the migration starts (the "before" figures).
    #[arg(long, value_name = "S", default_value_t = 3, requires = "probe",
          value_parser = clap::value_parser!(u64).range(1..=600))]
    pub probe_before_s: u64,
    /// Draw the guest's gaps and the ping round trips over time, the
    /// migration's phases marked, into this PNG file.
    #[arg(long, value_name = "FILE.png", requires = "probe", value_parser = png_path)]
    pub plot: Option<PathBuf>,
    /// Print the report as one JSON object (and no progress bar).
    #[arg(long)]
    pub json: bool,
}

/// A path ending in `.png` (the plot is a PNG, whatever its name).
fn png_path(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    match p.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("png") => Ok(p),
        _ => Err("the plot is a PNG file: give a name ending in .png".into()),
    }
}

impl MigrateArgs {
    /// The API request these arguments make.
    pub fn request(&self) -> Request {
        Request::Migrate {
            to: self.to.to_string(),
            downtime_ms: self.downtime_ms,
            bandwidth_mib: self.bandwidth,
            auto_converge: self.auto_converge,
            timeout_s: self.timeout_s,
            mode: self.mode,
            initially_set: self.initially_set,
            connections: self.connections,
            postcopy: self.postcopy,
            postcopy_after_rounds: self.postcopy_after_rounds,
        }
    }
}

/// Why `tandem ctl migrate` could not do its part.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("--probe: {0}")]
    Probe(#[from] ProbeError),
}

/// `tandem ctl migrate`: returns whether the migration completed.
pub fn run(sock: &Path, args: &MigrateArgs) -> Result<bool, ClientError> {
    let probe = match args.probe {
        Some(guest) => {
            let listen = SocketAddr::from((Ipv4Addr::UNSPECIFIED, args.probe_port));
            let mut cfg = ProbeConfig::new(guest, listen);
            cfg.interval = Duration::from_millis(args.probe_interval_ms);
            let p = Probe::start(&cfg)?;
            std::thread::sleep(Duration::from_secs(args.probe_before_s));
            p.mark("migrate");
            Some(p)
        }
        None => None,
    };
    let mark = |label: &str| {
        if let Some(p) = &probe {
            p.mark(label);
        }
    };
    let mut last = match follow(sock, &args.request(), !args.json, &mark)? {
        Ok(last) => last,
        Err(refusal) => {
            print_refusal(&refusal, args.json);
            return Ok(false);
        }
    };
    if let Some(p) = probe {
        last["probe"] = probe_report(p, args.plot.as_deref());
    }
    if args.json {
        println!("{}", serde_json::to_string(&last).unwrap_or_default());
    } else {
        print!("{}", report_text(&last));
    }
    Ok(last["phase"] == "completed")
}

/// How long the probe goes on after the migration ended.
const PROBE_AFTER: Duration = Duration::from_secs(1);

/// Ends the probe and makes its part of the report (the plot drawn).
fn probe_report(p: Probe, plot: Option<&Path>) -> Value {
    std::thread::sleep(PROBE_AFTER);
    let data = p.finish();
    let at = |label: &str| data.marks.iter().find(|m| m.label == label).map(|m| m.t_ms);
    let from = at("migrate").unwrap_or(0.0);
    let to = at("done").unwrap_or(from);
    let summary = probe::summarize(&data, (from, to));
    let mut out = json!({ "summary": summary, "text": summary.text() });
    if data.reports == 0 {
        out["warning"] = json!(
            "no datagram from the guest's tandem-jitter: is it running, sending to this host's port?"
        );
    }
    if let Some(path) = plot {
        match probe::plot(&data, path) {
            Ok(()) => out["plot"] = json!(path.display().to_string()),
            Err(e) => out["plot_error"] = json!(e.to_string()),
        }
    }
    out
}

/// Starts the migration `req` on the VM at `sock` and follows it to its
/// end (a progress line on a terminal with `show`), telling `mark` of each
/// new phase; returns its last status, or the refusal.
pub fn follow(
    sock: &Path,
    req: &Request,
    show: bool,
    mark: &dyn Fn(&str),
) -> Result<Result<Value, Value>, ApiError> {
    let answer = api::request(sock, req)?;
    if answer["ok"] != true {
        return Ok(Err(answer));
    }
    let bar = (show && std::io::stderr().is_terminal()).then(|| {
        let b = ProgressBar::new_spinner();
        b.set_style(
            ProgressStyle::with_template("{spinner} {elapsed:>4} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        b.enable_steady_tick(Duration::from_millis(100));
        b
    });
    let mut phase = String::new();
    let last = loop {
        std::thread::sleep(POLL);
        let a = api::request(sock, &Request::MigrateStatus {})?;
        let m = a["migration"].clone();
        if let Some(b) = &bar {
            b.set_message(progress_line(&m));
        }
        let now = m["phase"].as_str().unwrap_or("?");
        if now != phase {
            phase = now.to_owned();
            mark(&phase);
        }
        if matches!(now, "completed" | "failed" | "cancelled") {
            mark("done");
            break m;
        }
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(Ok(last))
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

/// The post-copy part of the report (nothing without one).
fn postcopy_text(p: &Value) -> String {
    if !p.is_object() {
        return String::new();
    }
    let g = |k: &str| p[k].as_f64().unwrap_or(0.0);
    format!(
        "  post-copy from round {}: {} of {} pages sent after the switch ({} asked for), all \
         there after {:.0} ms\n  the destination's guest waited on {} faults: p50 {:.1} ms, \
         p99 {:.1} ms, max {:.1} ms\n  the source kept the guest's memory until then\n",
        p["switched_at_round"],
        p["sent_pages"],
        p["needed_pages"],
        p["requested_pages"],
        g("fetch_ms"),
        p["faults"],
        g("fault_p50_ms"),
        g("fault_p99_ms"),
        g("fault_max_ms"),
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
        let fate = if m["lost"].as_bool() == Some(true) {
            "the guest is lost: it ran at the destination since the switch to post-copy"
        } else {
            "the guest runs on at the source"
        };
        out += &format!("  error: {e}\n  {fate}\n");
    }
    out += &format!(
        "  total {:.0} ms, setup {:.0} ms, dirty log started in {:.2} ms ({})",
        f("total_ms"),
        f("setup_ms"),
        f("log_start_ms"),
        if m["log_all_dirty"].as_bool() == Some(true) {
            "all dirty, protected chunk by chunk"
        } else {
            "all memory write-protected at once"
        }
    );
    match m["downtime_ms"].as_f64() {
        Some(d) => {
            let budget = m["params"]["downtime_ms"].as_f64().unwrap_or(0.0);
            let over = if d > budget { " (over the budget)" } else { "" };
            out += &format!(", downtime {d:.0} ms of {budget:.0} ms budget{over}\n");
            let p = &m["downtime_parts"];
            if p.is_object() {
                let g = |k: &str| p[k].as_f64().unwrap_or(0.0);
                out += &format!(
                    "  downtime: pause {:.1}, last pages {:.1}, state {:.1}, disks {:.1}, handover {:.1} ms\n",
                    g("pause_ms"),
                    g("pages_ms"),
                    g("state_ms"),
                    g("disks_ms"),
                    g("handover_ms")
                );
            }
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
    out += &postcopy_text(&m["postcopy"]);
    if let Some(t) = m["probe"]["text"].as_str() {
        out += t;
    }
    for k in ["warning", "plot_error"] {
        if let Some(w) = m["probe"][k].as_str() {
            out += &format!("  probe: {w}\n");
        }
    }
    if let Some(p) = m["probe"]["plot"].as_str() {
        out += &format!("  plot: {p}\n");
    }
    out
}

//! `tandem ctl`: one control-API request per verb (the [`Verb`]s), its
//! answer printed as JSON; `migrate` is followed to its end by
//! [`super::migrate_client`]. The closing list of verbs in `tandem ctl
//! --help` is generated from [`Verb`] ([`verbs_line`]).
//!
//! Runs in the `tandem ctl` process, not in the VMM. Never does: decide
//! anything the VMM decides (it asks and shows), or open a file the VMM
//! writes (paths go over as absolute paths).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};

use super::migrate_client::{self, MigrateArgs};
use super::values::{self, DirtyLogArg, QueueFullArg};
use super::{absolute, fail};
use crate::api::{DirtyLogAction, Request};
use crate::colo::QueueFullPolicy;

/// `tandem ctl`'s arguments: the VM's socket and the verb.
#[derive(Args)]
pub struct CtlArgs {
    /// The VM's control socket (what `tandem run --api-sock` was given).
    #[arg(long, value_name = "PATH")]
    api_sock: PathBuf,
    #[command(subcommand)]
    verb: Verb,
}

/// What `tandem ctl` asks the VM.
#[derive(Subcommand)]
pub enum Verb {
    /// State (running or paused), vCPUs, memory, uptime.
    Status,
    /// Stop every vCPU and device processing; the guest clock stops too.
    Pause,
    /// Continue a paused VM.
    Resume,
    /// Device counters.
    Metrics,
    /// End the VM (tandem exits with status 0).
    Shutdown,
    /// Write the whole VM to PATH (pausing it meanwhile if it runs); continue
    /// it later with `tandem run --restore PATH`. Disk contents are not in
    /// the file: keep the images as they are (or copy them) for the restore.
    Snapshot {
        /// The snapshot file to write.
        path: PathBuf,
    },
    /// Take the running VM back to a snapshot of itself (written by
    /// `snapshot` from this same VM): memory, vCPUs and devices as they were
    /// then; a running VM runs on from there, a paused one stays paused. The
    /// file is verified whole before the VM is touched. Disks are not
    /// reverted (as with a restore).
    Revert {
        /// The snapshot file.
        path: PathBuf,
    },
    /// Start sampling where the guest's vCPUs spend their time (see
    /// `tandem run --help`, --guest-profile); end with profile-stop.
    ProfileStart {
        /// Samples per second of each vCPU (1 to 10000).
        #[arg(long, value_name = "N", default_value_t = crate::profile::DEFAULT_HZ)]
        hz: u32,
    },
    /// Stop the profile, write its folded stacks to PATH (written by the
    /// VMM) and print the top functions.
    ProfileStop {
        /// The folded-stacks file to write.
        path: PathBuf,
        /// Print the VMM's JSON answer instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Make every vCPU sleep PERCENT of each 50 ms window (what migration's
    /// auto-converge does to a guest that dirties memory faster than it can
    /// be sent); 0 turns it off.
    Throttle {
        /// 0 to 99.
        #[arg(value_parser = clap::value_parser!(u8).range(0..=99))]
        percent: u8,
    },
    /// Send the running guest to `tandem run --incoming ADDR` (live: it runs
    /// on while its memory is copied, and pauses only for the last copy).
    /// Shows progress on a terminal and ends with a report. On success the
    /// VMM here exits (status 0); on any failure the guest runs on here as
    /// before. Exit status 0 when the migration completed, 1 otherwise.
    Migrate(MigrateArgs),
    /// The migration's progress, or its report once it ended.
    MigrateStatus,
    /// Cancel the migration under way; the guest runs on here.
    MigrateCancel,
    /// Switch the migration under way to post-copy at its next look at the
    /// dirty log (thread mode): the destination runs the guest and fetches
    /// what it lacks from here. From then on a broken link loses the guest.
    MigratePostcopy,
    /// Make this running VM the primary of a COLO pair with the secondary
    /// waiting at ADDR (`tandem run --colo secondary --colo-listen ADDR`):
    /// a full sync first (a migration that keeps the guest here), then a
    /// checkpoint at once and every --checkpoint-period-ms, and heartbeats.
    /// Answers at once; follow it with colo-status. Writable disks are
    /// replicated (the images must start equal: they are hashed).
    ColoStart {
        /// The secondary: tcp:HOST:PORT or unix:PATH.
        #[arg(value_name = "ADDR")]
        to: String,
        #[command(flatten)]
        pair: PairArgs,
        /// The lease file the pair shares on one host (default: after ADDR,
        /// as the secondary's --colo-lease).
        #[arg(long, value_name = "PATH", conflicts_with = "arbiter")]
        lease: Option<PathBuf>,
        /// The arbiter of a pair on two hosts:
        /// etcd:http://ADDR:PORT[,http://ADDR:PORT...]/KEY, the endpoints
        /// this host reaches etcd by and the key both sides use. The side
        /// that serves holds a lease on KEY and keeps it alive; when it
        /// cannot renew it in time it fences itself (stops its output,
        /// pauses its guest) before the lease can expire.
        #[arg(long, value_name = "SPEC")]
        arbiter: Option<String>,
        /// The etcd lease's TTL, whole seconds (2 at least; default 3): a
        /// side cut off is replaced after about this long.
        #[arg(long, value_name = "S", requires = "arbiter")]
        lease_ttl_s: Option<u32>,
    },
    /// On a VM that serves alone after its pair ended (primary_alone, or
    /// failed_over: the survivor of a failover), protect it again with a
    /// new secondary waiting at ADDR (`tandem run --colo secondary
    /// --colo-listen ADDR`, its disks copies of this VM's images as they
    /// are now): a full sync while the guest keeps serving, then
    /// checkpoints, as colo-start. It keeps its lease (the arbiter it was
    /// started with). Answers at once; follow it with colo-status.
    ColoReprotect {
        /// The new secondary: tcp:HOST:PORT or unix:PATH.
        #[arg(value_name = "ADDR")]
        to: String,
        #[command(flatten)]
        pair: PairArgs,
    },
    /// This side of its COLO pair: role, state (syncing, protected,
    /// failing_over, primary_alone, failed_over, retired, fenced), the last
    /// committed checkpoint, checkpoints by reason with their pause and
    /// bytes, the heartbeat's age.
    ColoStatus,
    /// Primary: go on alone now. Secondary: take over now, if the lease is
    /// free (the primary holds it while it lives). Then colo-status.
    ColoFailover,
    /// Primary: a checkpoint now.
    ColoCheckpoint,
    /// Guest memory's dirty log: `start` turns KVM's log on, `read` prints
    /// the pages written since the last read (by the vCPUs and by device
    /// emulation) and resets it, `stop` turns it off.
    DirtyLog {
        /// What to do with the log.
        #[arg(value_parser = values::parser::<DirtyLogArg, DirtyLogAction>())]
        action: DirtyLogAction,
    },
}

/// A pair's timing and compare queue (colo-start, colo-reprotect).
#[derive(clap::Args, Debug)]
pub struct PairArgs {
    /// A checkpoint this often, ms (at least 100).
    #[arg(long, value_name = "N", default_value_t = crate::colo::DEFAULT_PERIOD_MS)]
    checkpoint_period_ms: u64,
    /// A heartbeat this often, ms (at least 10).
    #[arg(long, value_name = "N", default_value_t = crate::colo::DEFAULT_HEARTBEAT_MS)]
    heartbeat_ms: u32,
    /// The peer is lost after this long without a heartbeat, ms (over
    /// twice --heartbeat-ms).
    #[arg(long, value_name = "N", default_value_t = crate::colo::DEFAULT_HEARTBEAT_TIMEOUT_MS)]
    heartbeat_timeout_ms: u32,
    /// A frame of this VM's waits this long for the secondary's same
    /// frame, ms, then a checkpoint releases it.
    #[arg(long, value_name = "N", default_value_t = crate::colo::DEFAULT_COMPARE_TIMEOUT_MS)]
    compare_timeout_ms: u64,
    /// Frames the compare holds on each side, at most (1 to 65536).
    #[arg(long, value_name = "N", default_value_t = crate::colo::DEFAULT_MAX_QUEUE)]
    max_queue: usize,
    /// What a full compare queue does: drop the frame (and count it), or
    /// also take a checkpoint (only to measure the difference).
    #[arg(long, value_name = "POLICY", default_value = "drop",
          value_parser = values::parser::<QueueFullArg, QueueFullPolicy>())]
    colo_queue_full: QueueFullPolicy,
    /// Connections a checkpoint's pages go over at once, each with a
    /// thread on both sides (like QEMU's multifd): 1 (the pair's stream
    /// itself) to 16.
    #[arg(long, value_name = "N", default_value_t = 1)]
    colo_channels: u16,
}

impl PairArgs {
    /// The pair's timing and queue as `colo` takes them, with the peer
    /// `to` checked here. (This and [`pair_request`] are the one place the
    /// options are copied into the API's pair parameters.)
    fn params(&self, to: &str) -> Result<crate::colo::Params, String> {
        Ok(crate::colo::Params {
            to: to
                .parse()
                .map_err(|e: crate::streams::endpoint::BadEndpoint| e.to_string())?,
            pair: self.pair(),
        })
    }

    /// The pair's timing and queue as the API and `colo` take them.
    fn pair(&self) -> crate::colo::PairParams {
        crate::colo::PairParams {
            checkpoint_period_ms: self.checkpoint_period_ms,
            heartbeat_ms: self.heartbeat_ms,
            heartbeat_timeout_ms: self.heartbeat_timeout_ms,
            compare_timeout_ms: self.compare_timeout_ms,
            max_queue: self.max_queue,
            queue_full: self.colo_queue_full,
            channels: self.colo_channels,
        }
    }
}

/// `tandem ctl`: send the verb's request and print the answer.
pub fn run(args: CtlArgs) -> ExitCode {
    let req = match &args.verb {
        Verb::Migrate(m) => {
            return match migrate_client::run(&args.api_sock, m) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::from(1),
                Err(e) => fail(e),
            };
        }
        verb => match request(verb) {
            Ok(r) => r,
            Err(e) => return fail(e),
        },
    };
    let table = matches!(args.verb, Verb::ProfileStop { json: false, .. });
    match crate::api::request(&args.api_sock, &req) {
        Ok(answer) => {
            match answer["table"].as_str() {
                Some(t) if table => println!(
                    "{} samples in {:.1} s ({} user) -> {}\n{t}",
                    answer["samples"],
                    answer["seconds"].as_f64().unwrap_or(0.0),
                    answer["user_samples"],
                    answer["file"].as_str().unwrap_or("?"),
                ),
                _ => println!(
                    "{}",
                    serde_json::to_string_pretty(&answer).unwrap_or_default()
                ),
            }
            if answer["ok"] == true {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => fail(e),
    }
}

/// The API request of a verb (`migrate` is the client's: a request and
/// its follow-up).
fn request(verb: &Verb) -> Result<Request, String> {
    Ok(match verb {
        Verb::Status => Request::Status {},
        Verb::Pause => Request::Pause {},
        Verb::Resume => Request::Resume {},
        Verb::Metrics => Request::Metrics {},
        Verb::Shutdown => Request::Shutdown {},
        // The VMM opens the file: give it a path that means the same there.
        Verb::Snapshot { path } => Request::Snapshot {
            path: absolute(path),
        },
        Verb::Revert { path } => Request::Revert {
            path: absolute(path),
        },
        Verb::ProfileStart { hz } => Request::ProfileStart { hz: *hz },
        Verb::ProfileStop { path, .. } => Request::ProfileStop {
            path: absolute(path),
        },
        Verb::Throttle { percent } => Request::Throttle { percent: *percent },
        Verb::DirtyLog { action } => Request::DirtyLog { action: *action },
        Verb::Migrate(m) => m.request(),
        Verb::MigrateStatus => Request::MigrateStatus {},
        Verb::MigrateCancel => Request::MigrateCancel {},
        Verb::MigratePostcopy => Request::MigratePostcopy {},
        Verb::ColoStart { .. } | Verb::ColoReprotect { .. } => pair_request(verb)?,
        Verb::ColoStatus => Request::ColoStatus {},
        Verb::ColoFailover => Request::ColoFailover {},
        Verb::ColoCheckpoint => Request::ColoCheckpoint {},
    })
}

/// The request of `colo-start` or `colo-reprotect` (the peer of
/// `colo-reprotect` is checked here, that of `colo-start` by the VMM).
fn pair_request(verb: &Verb) -> Result<Request, String> {
    Ok(match verb {
        Verb::ColoStart {
            to,
            pair,
            lease,
            arbiter,
            lease_ttl_s,
        } => Request::ColoStart {
            to: to.clone(),
            lease: lease.as_deref().map(absolute),
            arbiter: arbiter.clone(),
            lease_ttl_s: *lease_ttl_s,
            pair: pair.pair(),
        },
        Verb::ColoReprotect { to, pair } => {
            let p = pair.params(to)?;
            Request::ColoReprotect {
                to: p.to.to_string(),
                pair: p.pair,
            }
        }
        _ => return Err("not a COLO pair verb".into()),
    })
}

/// Every verb of `tandem ctl` (the subcommands of `ctl`, its definition),
/// each with its arguments: `snapshot PATH`, `dirty-log start|read|stop`,
/// `migrate ADDR [OPTIONS]`, ... in the order `--help` lists them.
pub fn verbs_line(ctl: &clap::Command) -> String {
    let verbs: Vec<String> = ctl
        .get_subcommands()
        .filter(|v| v.get_name() != "help")
        .map(synopsis)
        .collect();
    verbs.join(", ")
}

/// One verb and its arguments.
fn synopsis(verb: &clap::Command) -> String {
    let mut words = vec![verb.get_name().to_string()];
    let mut options = false;
    for arg in verb.get_arguments() {
        if matches!(arg.get_id().as_str(), "help" | "version") {
            continue;
        }
        if !arg.is_positional() {
            options = true;
            continue;
        }
        let values = arg.get_possible_values();
        words.push(if values.is_empty() {
            let name = arg.get_value_names().and_then(|n| n.first());
            name.map_or_else(|| arg.get_id().as_str().to_uppercase(), |n| n.to_string())
        } else {
            let names: Vec<&str> = values.iter().map(|v| v.get_name()).collect();
            names.join("|")
        });
    }
    if options {
        words.push("[OPTIONS]".into());
    }
    words.join(" ")
}

//! The `tandem` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use vmm::builder::Start;
use vmm::config::{self, VmConfig, DEFAULT_MEM};
use vmm::run_args::RunArgs;
use vmm::vstate::exit::VmExit;

#[derive(Parser)]
#[command(
    name = "tandem",
    version,
    about = "tandem: a KVM virtual machine monitor",
    long_about = "tandem: a KVM virtual machine monitor.\n\n\
        Boots Linux guests (ELF vmlinux or bzImage) on /dev/kvm with a serial console \
        on your terminal."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot a guest and connect its serial console to this terminal.
    #[command(after_help = "\
Console: stdin and stdout are the guest's serial port. On a terminal, input is raw \
(Ctrl-C goes to the guest); type Ctrl-A x to quit, Ctrl-A Ctrl-A to send Ctrl-A. \
From a pipe, input is held until the guest listens; end of input does not stop the guest.

Exit status: 0 when the guest reboots or powers off (or Ctrl-A x), 1 when the VM \
cannot start (bad option, unreadable kernel, no /dev/kvm...), 2 when the guest \
kernel panics, 3 when a vCPU fails.

Examples: printf 'uname -r\\nreboot -f\\n' | tandem run
          tandem run --config vm.toml --mem 1G")]
    Run(Box<RunArgs>),
    /// Send a request to a running VM's control API and print the answer
    /// (JSON). Exit status 0 when the request succeeded, 1 otherwise.
    #[command(after_help = "\
Verbs: status, pause, resume, metrics, shutdown, snapshot PATH, revert PATH, \
profile-start [--hz N], profile-stop PATH, dirty-log start|read|stop, \
throttle PERCENT, migrate ADDR [--downtime-ms N] [--bandwidth MIB_PER_S] \
[--auto-converge on|off] [--timeout-s N] [--mode thread|inline] [--probe GUEST_IP] \
[--plot FILE.png] [--json], migrate-status, migrate-cancel.

Example: tandem ctl --api-sock /tmp/vm.sock pause")]
    Ctl(CtlArgs),
}

#[derive(Args)]
struct CtlArgs {
    /// The VM's control socket (what `tandem run --api-sock` was given).
    #[arg(long, value_name = "PATH")]
    api_sock: PathBuf,
    #[command(subcommand)]
    verb: Verb,
}

#[derive(Subcommand)]
enum Verb {
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
        #[arg(long, value_name = "N", default_value_t = vmm::profile::DEFAULT_HZ)]
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
    Migrate(vmm::migrate::client::MigrateArgs),
    /// The migration's progress, or its report once it ended.
    MigrateStatus,
    /// Cancel the migration under way; the guest runs on here.
    MigrateCancel,
    /// Make this running VM the primary of a COLO pair with the secondary
    /// waiting at ADDR (`tandem run --colo secondary --colo-listen ADDR`):
    /// a full sync first (a migration that keeps the guest here), then a
    /// checkpoint at once and every --checkpoint-period-ms, and heartbeats.
    /// Answers at once; follow it with colo-status. Writable disks are
    /// replicated (the images must start equal: they are hashed).
    ColoStart {
        /// The secondary: tcp:HOST:PORT or unix:PATH.
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
        action: vmm::api::DirtyLogAction,
    },
}

/// A pair's timing and compare queue (colo-start, colo-reprotect).
#[derive(clap::Args, Debug)]
struct PairArgs {
    /// A checkpoint this often, ms (at least 100).
    #[arg(long, value_name = "N", default_value_t = vmm::colo::DEFAULT_PERIOD_MS)]
    checkpoint_period_ms: u64,
    /// A heartbeat this often, ms (at least 10).
    #[arg(long, value_name = "N", default_value_t = vmm::colo::DEFAULT_HEARTBEAT_MS)]
    heartbeat_ms: u32,
    /// The peer is lost after this long without a heartbeat, ms (over
    /// twice --heartbeat-ms).
    #[arg(long, value_name = "N", default_value_t = vmm::colo::DEFAULT_HEARTBEAT_TIMEOUT_MS)]
    heartbeat_timeout_ms: u32,
    /// A frame of this VM's waits this long for the secondary's same
    /// frame, ms, then a checkpoint releases it.
    #[arg(long, value_name = "N", default_value_t = vmm::colo::DEFAULT_COMPARE_TIMEOUT_MS)]
    compare_timeout_ms: u64,
    /// Frames the compare holds on each side, at most (1 to 65536).
    #[arg(long, value_name = "N", default_value_t = vmm::colo::DEFAULT_MAX_QUEUE)]
    max_queue: usize,
    /// What a full compare queue does: drop the frame (and count it), or
    /// also take a checkpoint (only to measure the difference).
    #[arg(long, value_name = "POLICY", default_value = "drop")]
    colo_queue_full: vmm::colo::QueueFullPolicy,
    /// Connections a checkpoint's pages go over at once, each with a
    /// thread on both sides (like QEMU's multifd): 1 (the pair's stream
    /// itself) to 16.
    #[arg(long, value_name = "N", default_value_t = 1)]
    colo_channels: u16,
}

impl PairArgs {
    fn params(&self, to: &str) -> Result<vmm::colo::Params, String> {
        Ok(vmm::colo::Params {
            to: to
                .parse()
                .map_err(|e: vmm::streams::endpoint::BadEndpoint| e.to_string())?,
            pair: self.pair(),
        })
    }

    fn pair(&self) -> vmm::colo::PairParams {
        vmm::colo::PairParams {
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

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("tandem: error: {msg}");
    ExitCode::from(1)
}

/// `path` made absolute (as it is, if that fails).
fn absolute(path: &std::path::Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

fn run_ctl(args: CtlArgs) -> ExitCode {
    use vmm::api::Request;
    let req = match &args.verb {
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
        Verb::Migrate(m) => {
            return match vmm::migrate::client::run(&args.api_sock, m) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::from(1),
                Err(e) => fail(e),
            };
        }
        Verb::MigrateStatus => Request::MigrateStatus {},
        Verb::MigrateCancel => Request::MigrateCancel {},
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
        Verb::ColoReprotect { to, pair } => match pair.params(to) {
            Ok(p) => Request::ColoReprotect {
                to: p.to.to_string(),
                pair: p.pair,
            },
            Err(e) => return fail(e),
        },
        Verb::ColoStatus => Request::ColoStatus {},
        Verb::ColoFailover => Request::ColoFailover {},
        Verb::ColoCheckpoint => Request::ColoCheckpoint {},
    };
    let table = matches!(args.verb, Verb::ProfileStop { json: false, .. });
    match vmm::api::request(&args.api_sock, &req) {
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

/// The command line, or the exit code of `--help`, `--version` or a
/// one-line error.
fn parse_cli() -> Result<Cli, ExitCode> {
    match Cli::try_parse() {
        Ok(c) => Ok(c),
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                e.exit();
            }
            // One line: clap's first line, without its usage block (and
            // the names it lists on the next lines, e.g. missing options).
            let text = e.to_string();
            let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
            let mut first = lines.next().unwrap_or("invalid arguments").to_string();
            while first.ends_with(':') {
                match lines.next() {
                    Some(l) if !l.starts_with("Usage:") => first = format!("{first} {l}"),
                    _ => break,
                }
            }
            let sub = std::env::args().nth(1).filter(|a| a == "run" || a == "ctl");
            let help = sub.map_or("tandem --help".to_string(), |s| {
                format!("tandem {s} --help")
            });
            eprintln!("tandem: {first} (see '{help}')");
            Err(ExitCode::from(1))
        }
    }
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp_millis()
        .init();
    let cli = match parse_cli() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let args = match cli.command {
        Command::Run(args) => *args,
        Command::Ctl(ctl) => return run_ctl(ctl),
    };
    let args = match args.resolve() {
        Ok(a) => a,
        Err(e) => return fail(e),
    };
    let host = vmm::host_emu::HostKind::detect();
    let cmdline = args
        .cmdline
        .clone()
        .unwrap_or_else(|| config::default_cmdline(host));
    if args.print_cmdline {
        println!("{}", vmm::builder::effective_cmdline(&cmdline, host));
        return ExitCode::SUCCESS;
    }

    if let Some(path) = args.restore.clone() {
        return restore(&path, args);
    }
    if let Some(from) = args.incoming.clone() {
        return incoming(from, args);
    }
    if let (Some(_), Some(from)) = (args.colo, args.colo_listen.clone()) {
        return incoming(from, args);
    }
    boot(args, cmdline)
}

/// The guest memory asked for (default [`DEFAULT_MEM`]), if this host has it.
fn guest_mem(asked: Option<u64>) -> Result<u64, ExitCode> {
    let mem = asked
        .map_or_else(|| config::parse_mem(DEFAULT_MEM), Ok)
        .map_err(fail)?;
    config::check_mem_fits(mem, &format!("{}M", mem >> 20)).map_err(fail)?;
    Ok(mem)
}

/// `tandem run --incoming ADDR`: build the VM paused, bind ADDR, and let
/// the incoming thread fill and start it.
fn incoming(from: vmm::streams::Endpoint, args: RunArgs) -> ExitCode {
    let mem = match guest_mem(args.mem) {
        Ok(m) => m,
        Err(code) => return code,
    };
    let profile = match args.profile(None) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let tls = match args.streams() {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let transport = match args.transport() {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    let streams = transport.name(&from);
    let listener = match vmm::migrate::dest::listen(&from, &transport) {
        Ok(l) => l,
        Err(e) => return fail(e),
    };
    let cfg = VmConfig {
        firmware: args.firmware.clone(),
        kernel: PathBuf::new(),
        initrd: None,
        cmdline: String::new(),
        mem_bytes: mem,
        cpus: args.cpus.unwrap_or(1),
        machine: args.machine.unwrap_or_default(),
        nets: args.nets,
        disks: args.disks,
        metrics: args.metrics,
        api_sock: args.api_sock,
        profile,
        streams: tls,
    };
    let secondary = args.colo.is_some();
    let start = if secondary {
        Start::Secondary
    } else {
        Start::Incoming
    };
    let vm = match vmm::builder::build(&cfg, start) {
        Ok(vm) => vm,
        Err(e) => return fail(e),
    };
    let then = if secondary {
        let arbiter = match vmm::colo::arbiter::ArbiterSpec::from_options(
            args.colo_arbiter.as_deref(),
            args.colo_lease.as_deref().map(absolute),
            args.colo_lease_ttl_s,
            &from,
        ) {
            Ok(a) => a,
            Err(e) => return fail(e),
        };
        let side = vmm::colo::secondary::side(&from, &arbiter, streams);
        vm.set_colo(side.clone());
        Some(vmm::colo::secondary::then(side, arbiter, vm.transport()))
    } else {
        None
    };
    if let Err(e) = vmm::migrate::dest::spawn_then(vm.handle(), listener, from, then) {
        return fail(format!("cannot start the incoming thread: {e}"));
    }
    finish(vm.run())
}

/// `tandem run`: boot the kernel given (or the default guest).
fn boot(args: RunArgs, cmdline: String) -> ExitCode {
    let mem = match guest_mem(args.mem) {
        Ok(m) => m,
        Err(code) => return code,
    };
    let (kernel, initrd) = match (&args.firmware, args.kernel.clone()) {
        (Some(_), Some(k)) => (k, args.initrd.clone()),
        (Some(_), None) => (PathBuf::new(), None),
        (None, Some(k)) => (k, args.initrd.clone()),
        (None, None) => match config::default_guest() {
            Ok((k, i)) => (k, Some(args.initrd.clone().unwrap_or(i))),
            Err(e) => return fail(e),
        },
    };
    let symbols_from = args.firmware.is_none().then_some(kernel.as_path());
    let profile = match args.profile(symbols_from) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let streams = match args.streams() {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let cfg = VmConfig {
        firmware: args.firmware.clone(),
        kernel,
        initrd,
        cmdline,
        mem_bytes: mem,
        cpus: args.cpus.unwrap_or(1),
        machine: args.machine.unwrap_or_default(),
        nets: args.nets,
        disks: args.disks,
        metrics: args.metrics,
        api_sock: args.api_sock,
        profile,
        streams,
    };
    finish(vmm::builder::run(&cfg))
}

/// `tandem run --restore FILE`: verify everything, then build and run.
fn restore(path: &std::path::Path, args: RunArgs) -> ExitCode {
    let profile = match args.profile(None) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let streams = match args.streams() {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let mut disks = args.disks;
    let firmware = match args.firmware.as_deref().map(vmm::boot::firmware::identify) {
        Some(Ok(id)) => Some(id),
        Some(Err(e)) => return fail(e),
        None => None,
    };
    let asked = vmm::snapshot::Asked {
        mem: args.mem,
        cpus: args.cpus,
        machine: args.machine,
        nets: &args.nets,
        firmware: firmware.as_ref(),
    };
    let snap = match vmm::snapshot::load(path, asked, &mut disks) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let cpus = match u8::try_from(snap.state.manifest.vcpus) {
        Ok(c) => c,
        Err(_) => return fail(format!("{}: bad vCPU count", path.display())),
    };
    let cfg = VmConfig {
        firmware: args.firmware.clone(),
        kernel: PathBuf::new(),
        initrd: None,
        cmdline: String::new(),
        mem_bytes: snap.state.manifest.mem_bytes,
        cpus,
        machine: vmm::device_manager::machine_of(&snap.state.manifest),
        nets: args.nets,
        disks,
        metrics: args.metrics,
        api_sock: args.api_sock,
        profile,
        streams,
    };
    finish(vmm::builder::build(&cfg, Start::Restore(Box::new(snap))).and_then(|vm| vm.run()))
}

fn finish(result: Result<VmExit, vmm::vm_loop::VmError>) -> ExitCode {
    match result {
        Ok(why) => {
            match &why {
                VmExit::Panic(msg) => eprintln!("tandem: the guest kernel panicked: {msg}"),
                VmExit::Fatal(msg) => eprintln!("tandem: the VM stopped: {msg}"),
                VmExit::Migrated(to) => {
                    eprintln!("tandem: the guest migrated to {to} and runs there")
                }
                VmExit::IncomingFailed(msg) => eprintln!("tandem: error: {msg}"),
                VmExit::Retired(msg) => eprintln!("tandem: COLO: this secondary retires: {msg}"),
                VmExit::Fenced(msg) => eprintln!("tandem: COLO: fenced: {msg}"),
                other => log::info!("guest ended: {other:?}"),
            }
            ExitCode::from(why.status() as u8)
        }
        Err(e) => fail(e),
    }
}

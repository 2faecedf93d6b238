//! The `tandem` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use vmm::config::{self, VmConfig, DEFAULT_MEM};
use vmm::exit::VmExit;
use vmm::vm::Start;

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

Example: printf 'uname -r\\nreboot -f\\n' | tandem run")]
    Run(Box<RunArgs>),
    /// Send a request to a running VM's control API and print the answer
    /// (JSON). Exit status 0 when the request succeeded, 1 otherwise.
    #[command(after_help = "\
Verbs: status, pause, resume, metrics, shutdown, snapshot PATH, \
profile-start [--hz N], profile-stop PATH, dirty-log start|read|stop, \
throttle PERCENT.

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
    /// Guest memory's dirty log: `start` turns KVM's log on, `read` prints
    /// the pages written since the last read (by the vCPUs and by device
    /// emulation) and resets it, `stop` turns it off.
    DirtyLog {
        /// start, read or stop.
        action: vmm::api::DirtyLogAction,
    },
}

#[derive(Args)]
struct RunArgs {
    /// Guest kernel: an ELF vmlinux (fastest here) or a bzImage.
    /// Default: the guest built by resources/build-guest.sh (target/guest/vmlinux,
    /// with target/guest/initramfs.cpio as initrd).
    #[arg(long, value_name = "PATH")]
    kernel: Option<PathBuf>,
    /// Initial ramdisk (uncompressed cpio boots fastest).
    #[arg(long, value_name = "PATH")]
    initrd: Option<PathBuf>,
    /// Kernel command line. Parameters this host's KVM needs are appended.
    /// Default: "console=ttyS0 reboot=k panic=1", with "quiet" on hosts
    /// whose KVM emulates the guest kernel (printing the boot log there
    /// costs seconds).
    #[arg(long, value_name = "STR")]
    cmdline: Option<String>,
    /// Guest memory: a number with K, M, G or T (a plain number is MiB).
    /// Default: 128M, or the snapshot's with --restore.
    #[arg(long, value_name = "SIZE", value_parser = config::parse_mem)]
    mem: Option<u64>,
    /// Print the kernel command line the guest would get (with what this
    /// host needs appended) and exit.
    #[arg(long)]
    print_cmdline: bool,
    /// A virtio-net device on tap NAME (created if absent); repeatable
    /// (eth0, eth1, ... in that order). mac=AA:BB:CC:DD:EE:FF sets the MAC;
    /// sndbuf=SIZE (e.g. 256K) bounds the tap's send buffer so that a guest
    /// sending faster than the host path drains is throttled (its TX queue
    /// waits) instead of growing host queues; default: unlimited, as in QEMU.
    /// rsc=on coalesces received TCP segments into large packets before they
    /// reach the guest (receive segment coalescing; also offers RSC_EXT to
    /// drivers that report coalescing, e.g. Windows NetKVM); default off.
    /// rsc_interval_us=N: how long a partly coalesced packet may wait for
    /// more segments, 1 to 1000000 µs (default 300).
    #[arg(long = "net",
          value_name = "tap=NAME[,mac=MAC][,sndbuf=SIZE][,rsc=on|off][,rsc_interval_us=N]",
          value_parser = config::parse_net)]
    nets: Vec<config::NetSpec>,
    /// A virtio-blk device on a raw image FILE (a regular file or a block
    /// device); repeatable: the guest sees /dev/vda, /dev/vdb, ... in order.
    /// readonly=on offers the disk read-only (writes fail with an I/O error
    /// and the file is opened read-only); id=NAME (up to 20 characters,
    /// default: the file name) is the serial the guest reads from
    /// /sys/block/vdX/serial. The image is locked while tandem runs (shared
    /// when read-only). To boot from it, give a kernel without an initrd and
    /// `root=/dev/vda` in --cmdline.
    #[arg(long = "disk", value_name = "path=FILE[,readonly=on][,id=NAME]",
          value_parser = config::parse_disk)]
    disks: Vec<config::DiskSpec>,
    /// Write device counters as JSON to PATH, every second and at exit.
    #[arg(long, value_name = "PATH")]
    metrics: Option<PathBuf>,
    /// Serve the control API on a Unix socket at PATH (JSON lines; see
    /// `tandem ctl --help`). A stale socket file there is replaced.
    #[arg(long, value_name = "PATH")]
    api_sock: Option<PathBuf>,
    /// Number of vCPUs (1 to 32). Default: 1, or the snapshot's with --restore.
    #[arg(long, value_name = "N",
          value_parser = |s: &str| config::parse_cpus(s, config::max_cpus()))]
    cpus: Option<u8>,
    /// Continue the VM saved in FILE (by `tandem ctl ... snapshot FILE`)
    /// instead of booting a kernel. The whole file is verified first. Give
    /// the snapshot's devices again, in the same order: --net with the same
    /// MAC and rsc (the tap may differ), --disk with the same readonly flag,
    /// size and id, on the image as it was at the snapshot (the path may
    /// differ). Any other --mem, --cpus or device set is refused, saying
    /// what differs.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["kernel", "initrd", "cmdline", "print_cmdline"])]
    restore: Option<PathBuf>,
    /// Profile the guest from start to end into FILE: each vCPU's
    /// instruction pointer is sampled --guest-profile-hz times a second
    /// (the vCPU is kicked out of KVM_RUN and its registers read), with the
    /// kernel call chain read from guest memory when the guest kernel keeps
    /// frame pointers; user-mode samples count as [user]. FILE gets folded
    /// stacks (what flamegraph tools read, e.g. `inferno-flamegraph FILE >
    /// boot.svg`), and the top 30 functions are printed on stderr at exit.
    /// For a window on a running VM: `tandem ctl profile-start/profile-stop`.
    #[arg(long, value_name = "FILE")]
    guest_profile: Option<PathBuf>,
    /// Samples per second and vCPU for --guest-profile (1 to 10000).
    #[arg(long, value_name = "N", default_value_t = vmm::profile::DEFAULT_HZ,
          requires = "guest_profile",
          value_parser = |s: &str| -> Result<u32, String> {
              let n: u32 = s.parse().map_err(|_| format!("'{s}' is not a number"))?;
              vmm::profile::check_hz(n).map_err(|e| e.to_string())
          })]
    guest_profile_hz: u32,
    /// Names for profiled addresses: an ELF vmlinux or a System.map. Default:
    /// the --kernel when it is an ELF vmlinux (a bzImage has no symbols:
    /// give its System.map); needed for --restore.
    #[arg(long, value_name = "FILE")]
    guest_symbols: Option<PathBuf>,
}

impl RunArgs {
    /// The profiler's settings; an unreadable --guest-symbols is an error.
    fn profile(&self, kernel: Option<&std::path::Path>) -> Result<config::ProfileConfig, String> {
        if let Some(s) = &self.guest_symbols {
            vmm::profile::symbols::Symbols::load(s).map_err(|e| format!("--guest-symbols: {e}"))?;
        }
        let symbols = self
            .guest_symbols
            .clone()
            .or_else(|| kernel.filter(|k| config::is_elf(k)).map(Into::into));
        Ok(config::ProfileConfig {
            file: self.guest_profile.clone(),
            hz: self.guest_profile_hz,
            symbols,
        })
    }
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("tandem: error: {msg}");
    ExitCode::from(1)
}

fn run_ctl(args: CtlArgs) -> ExitCode {
    use vmm::api::Request;
    let req = match &args.verb {
        Verb::Status => Request::Status {},
        Verb::Pause => Request::Pause {},
        Verb::Resume => Request::Resume {},
        Verb::Metrics => Request::Metrics {},
        Verb::Shutdown => Request::Shutdown {},
        Verb::Snapshot { path } => Request::Snapshot { path: path.clone() },
        Verb::ProfileStart { hz } => Request::ProfileStart { hz: *hz },
        Verb::ProfileStop { path, .. } => Request::ProfileStop {
            // The VMM writes the file: give it a path that means the same there.
            path: std::path::absolute(path).unwrap_or_else(|_| path.clone()),
        },
        Verb::Throttle { percent } => Request::Throttle { percent: *percent },
        Verb::DirtyLog { action } => Request::DirtyLog { action: *action },
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

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp_millis()
        .init();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
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
            eprintln!("tandem: {first} (see 'tandem run --help')");
            return ExitCode::from(1);
        }
    };
    let args = match cli.command {
        Command::Run(args) => *args,
        Command::Ctl(ctl) => return run_ctl(ctl),
    };
    let host = vmm::host::HostKind::detect();
    let cmdline = args
        .cmdline
        .clone()
        .unwrap_or_else(|| config::default_cmdline(host));
    if args.print_cmdline {
        println!("{}", vmm::vm::effective_cmdline(&cmdline, host));
        return ExitCode::SUCCESS;
    }

    if let Some(path) = args.restore.clone() {
        return restore(&path, args);
    }

    let mem = match args.mem {
        Some(m) => m,
        None => match config::parse_mem(DEFAULT_MEM) {
            Ok(m) => m,
            Err(e) => return fail(e),
        },
    };
    let asked_mem = format!("{}M", mem >> 20);
    if let Err(e) = config::check_mem_fits(mem, &asked_mem) {
        return fail(e);
    }
    let (kernel, initrd) = match args.kernel.clone() {
        Some(k) => (k, args.initrd.clone()),
        None => match config::default_guest() {
            Ok((k, i)) => (k, Some(args.initrd.clone().unwrap_or(i))),
            Err(e) => return fail(e),
        },
    };
    let profile = match args.profile(Some(&kernel)) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let cfg = VmConfig {
        kernel,
        initrd,
        cmdline,
        mem_bytes: mem,
        cpus: args.cpus.unwrap_or(1),
        nets: args.nets,
        disks: args.disks,
        metrics: args.metrics,
        api_sock: args.api_sock,
        profile,
    };
    finish(vmm::vm::run(&cfg))
}

/// `tandem run --restore FILE`: verify everything, then build and run.
fn restore(path: &std::path::Path, args: RunArgs) -> ExitCode {
    let profile = match args.profile(None) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let mut disks = args.disks;
    let snap = match vmm::snapshot::load(path, args.mem, args.cpus, &args.nets, &mut disks) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let cpus = match u8::try_from(snap.manifest.vcpus) {
        Ok(c) => c,
        Err(_) => return fail(format!("{}: bad vCPU count", path.display())),
    };
    let cfg = VmConfig {
        kernel: PathBuf::new(),
        initrd: None,
        cmdline: String::new(),
        mem_bytes: snap.manifest.mem_bytes,
        cpus,
        nets: args.nets,
        disks,
        metrics: args.metrics,
        api_sock: args.api_sock,
        profile,
    };
    finish(vmm::vm::run_from(&cfg, Start::Restore(Box::new(snap))))
}

fn finish(result: Result<VmExit, vmm::vm::VmError>) -> ExitCode {
    match result {
        Ok(why) => {
            match &why {
                VmExit::Panic(msg) => eprintln!("tandem: the guest kernel panicked: {msg}"),
                VmExit::Fatal(msg) => eprintln!("tandem: the VM stopped: {msg}"),
                other => log::info!("guest ended: {other:?}"),
            }
            ExitCode::from(why.status() as u8)
        }
        Err(e) => fail(e),
    }
}

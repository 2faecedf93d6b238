//! The `tandem` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use vmm::config::{self, VmConfig, DEFAULT_CMDLINE, DEFAULT_MEM};
use vmm::exit::VmExit;

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
    Run(RunArgs),
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
    #[arg(long, value_name = "STR", default_value = DEFAULT_CMDLINE)]
    cmdline: String,
    /// Guest memory: a number with K, M, G or T (a plain number is MiB).
    #[arg(long, value_name = "SIZE", default_value = DEFAULT_MEM,
          value_parser = config::parse_mem)]
    mem: u64,
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
    /// Write device counters as JSON to PATH, every second and at exit.
    #[arg(long, value_name = "PATH")]
    metrics: Option<PathBuf>,
    /// Number of vCPUs (1 to 32).
    #[arg(long, value_name = "N", default_value = "1",
          value_parser = |s: &str| config::parse_cpus(s, config::max_cpus()))]
    cpus: u8,
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("tandem: error: {msg}");
    ExitCode::from(1)
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
            // One line: clap's first line, without its usage block.
            let text = e.to_string();
            let first = text.lines().next().unwrap_or("invalid arguments");
            eprintln!("tandem: {first} (see 'tandem run --help')");
            return ExitCode::from(1);
        }
    };
    let Command::Run(args) = cli.command;
    if args.print_cmdline {
        println!(
            "{}",
            vmm::vm::effective_cmdline(&args.cmdline, vmm::host::HostKind::detect())
        );
        return ExitCode::SUCCESS;
    }

    let asked_mem = format!("{}M", args.mem >> 20);
    if let Err(e) = config::check_mem_fits(args.mem, &asked_mem) {
        return fail(e);
    }
    let (kernel, initrd) = match args.kernel {
        Some(k) => (k, args.initrd),
        None => match config::default_guest() {
            Ok((k, i)) => (k, Some(args.initrd.unwrap_or(i))),
            Err(e) => return fail(e),
        },
    };
    let cfg = VmConfig {
        kernel,
        initrd,
        cmdline: args.cmdline,
        mem_bytes: args.mem,
        cpus: args.cpus,
        nets: args.nets,
        metrics: args.metrics,
    };
    match vmm::vm::run(&cfg) {
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

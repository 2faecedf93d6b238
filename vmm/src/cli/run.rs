//! `tandem run`: the options resolved ([`super::run_args`]), then one of
//! three starts: boot a kernel or firmware, continue a snapshot
//! (`--restore`), or wait for a guest (`--incoming`, `--colo secondary`);
//! each builds its `VmConfig` through
//! [`VmOptions::into_config`](super::run_args::VmOptions::into_config) and runs
//! the VM on this thread to its end.
//!
//! Runs on the main thread, which becomes the VMM thread. Never does:
//! build a VM before its options are checked, or print more than one line
//! for a failure to start.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::fail;
use super::run_args::{BootParts, RunArgs, RunArgsError, Shape};
use crate::builder::{self, Start};
use crate::config::{self, ConfigError, DEFAULT_MEM};
use crate::migrate::MigrateError;
use crate::vstate::exit::VmExit;

/// `tandem run --help`'s closing text.
pub const AFTER_HELP: &str = "\
Console: stdin and stdout are the guest's serial port. On a terminal, input is raw \
(Ctrl-C goes to the guest); type Ctrl-A x to quit, Ctrl-A Ctrl-A to send Ctrl-A. \
From a pipe, input is held until the guest listens; end of input does not stop the guest.

Exit status: 0 when the guest reboots or powers off, on Ctrl-A x or `tandem ctl shutdown`, \
and when the guest migrated away; 1 when the VM cannot start (bad option, unreadable \
kernel, no /dev/kvm...), when an incoming migration fails, and when a COLO secondary \
retires or a COLO side fences itself; 2 when the guest kernel panics; 3 when a vCPU fails; \
4 when a thread makes a system call its seccomp filter denies (--seccomp).

Examples: printf 'uname -r\\nreboot -f\\n' | tandem run
          tandem run --config vm.toml --mem 1G --api-sock /tmp/vm.sock
          tandem run --restore /tmp/vm.snap
          tandem run --incoming unix:/tmp/vm.migrate";

/// Why `tandem run` could not start its VM (or ran it to an error).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Args(#[from] RunArgsError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Firmware(#[from] crate::boot::firmware::FirmwareError),
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    #[error("{0}: bad vCPU count")]
    SnapshotCpus(PathBuf),
    #[error(transparent)]
    Migrate(#[from] MigrateError),
    /// `--colo-arbiter`, `--colo-lease`, `--colo-lease-ttl-s`.
    #[error("{0}")]
    Arbiter(String),
    /// An incoming VM's first source, let in before the VM is built.
    #[error("incoming migration: {0}")]
    Incoming(#[source] MigrateError),
    #[error("incoming migration: {0}")]
    Size(#[from] super::incoming::SizeError),
    #[error("cannot start the incoming thread: {0}")]
    Spawn(#[source] std::io::Error),
    #[error(transparent)]
    Vm(#[from] crate::vm_loop::VmError),
}

/// `tandem run`: resolve the options and run the VM they ask for.
pub fn run(args: RunArgs) -> ExitCode {
    let args = match args.resolve() {
        Ok(a) => a,
        Err(e) => return fail(e),
    };
    let host = crate::host_emu::HostKind::detect();
    let cmdline = args
        .cmdline
        .clone()
        .unwrap_or_else(|| config::default_cmdline(host));
    if args.print_cmdline {
        println!("{}", builder::effective_cmdline(&cmdline, host));
        return ExitCode::SUCCESS;
    }
    if let Err(e) = super::confine::start(&args) {
        return fail(e);
    }
    let ended = if let Some(path) = args.restore.clone() {
        restore(&path, args)
    } else if let Some(from) = args.incoming.clone() {
        super::incoming::run(from, args)
    } else if let (Some(_), Some(from)) = (args.colo, args.colo_listen.clone()) {
        super::incoming::run(from, args)
    } else {
        boot(args, cmdline)
    };
    finish(ended)
}

/// The guest memory asked for (default [`DEFAULT_MEM`]), if this host has it.
fn guest_mem(asked: Option<u64>) -> Result<u64, ConfigError> {
    let mem = asked.map_or_else(|| config::parse_mem(DEFAULT_MEM), Ok)?;
    config::check_mem_fits(mem, &format!("{}M", mem >> 20))?;
    Ok(mem)
}

/// The shape the options give (the defaults where they give none).
pub(super) fn asked_shape(args: &RunArgs) -> Result<Shape, ConfigError> {
    Ok(Shape {
        mem_bytes: guest_mem(args.mem)?,
        cpus: args.cpus.unwrap_or(1),
        machine: args.machine.unwrap_or_default(),
    })
}

/// `tandem run`: boot the kernel given (or the default guest), or the
/// firmware.
fn boot(args: RunArgs, cmdline: String) -> Result<VmExit, RunError> {
    let shape = asked_shape(&args)?;
    let (kernel, initrd) = match (&args.firmware, args.kernel.clone()) {
        (Some(_), Some(k)) => (k, args.initrd.clone()),
        (Some(_), None) => (PathBuf::new(), None),
        (None, Some(k)) => (k, args.initrd.clone()),
        (None, None) => {
            let (k, i) = config::default_guest()?;
            (k, Some(args.initrd.clone().unwrap_or(i)))
        }
    };
    let symbols_from = args.firmware.is_none().then_some(kernel.as_path());
    let options = args.vm_options(symbols_from)?;
    let boot = BootParts {
        kernel,
        initrd,
        cmdline,
    };
    Ok(builder::run(&options.into_config(boot, shape))?)
}

/// `tandem run --restore FILE`: verify everything, then build and run.
fn restore(path: &Path, args: RunArgs) -> Result<VmExit, RunError> {
    let mut options = args.vm_options(None)?;
    let firmware = options
        .firmware
        .as_deref()
        .map(crate::boot::firmware::identify)
        .transpose()?;
    let asked = crate::snapshot::Asked {
        mem: args.mem,
        cpus: args.cpus,
        machine: args.machine,
        nets: &options.nets,
        firmware: firmware.as_ref(),
    };
    let mut snap = crate::snapshot::load(path, asked, &mut options.disks)?;
    snap.memory = args.restore_memory.unwrap_or_default();
    let manifest = &snap.state.manifest;
    let shape = Shape {
        mem_bytes: manifest.mem_bytes,
        cpus: u8::try_from(manifest.vcpus).map_err(|_| RunError::SnapshotCpus(path.into()))?,
        machine: crate::device_manager::machine_of(manifest),
    };
    let cfg = options.into_config(BootParts::default(), shape);
    Ok(builder::build(&cfg, Start::Restore(Box::new(snap)))?.run()?)
}

/// The exit status of the VM's end (said on stderr when it is not the
/// guest's own), or of the error that stopped it.
fn finish(ended: Result<VmExit, RunError>) -> ExitCode {
    match ended {
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
                VmExit::Lost(msg) => eprintln!("tandem: the guest is lost: {msg}"),
                other => log::info!("guest ended: {other:?}"),
            }
            ExitCode::from(why.status() as u8)
        }
        Err(e) => fail(e),
    }
}

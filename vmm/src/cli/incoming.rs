//! `tandem run --incoming ADDR` and a COLO secondary (`--colo secondary
//! --colo-listen ADDR`, also an incoming VM): bind ADDR, build the VM
//! paused, and let the incoming thread (`migrate::dest`) fill and start it.
//!
//! Its size: with `--mem` given the VM is built at once with it and
//! `--cpus` (default 1), and the control API serves while it waits; the
//! incoming thread checks the source against it (as before). Without
//! `--mem`, the first source let in is accepted here and its manifest read
//! before the VM is built ([`source_shape`]): the VM takes the source's
//! memory size, and its vCPU count unless `--cpus` is given, as
//! `--restore` takes the snapshot's; the source's size must be one tandem
//! gives a guest and this host holds. A `--cpus` given is kept even when
//! it is not the source's: the VM is built as asked and the incoming
//! thread's manifest check refuses the source (before any memory moves),
//! naming that difference with every other (machine, firmware image,
//! devices) in one message. The open stream then goes to the incoming
//! thread.
//!
//! Runs on the main thread before the VM runs. Never does: allocate guest
//! memory beyond the size asked for or the source declared, or build the
//! VM before that size is known.

use std::fmt::Display;

use migration::Manifest;

use super::run::{asked_shape, RunError};
use super::run_args::{BootParts, RunArgs, Shape};
use crate::builder::{self, Start};
use crate::config::{self, ConfigError, Machine};
use crate::migrate::dest::{self, Accepted};
use crate::streams::Endpoint;
use crate::vstate::exit::VmExit;

/// The smallest guest memory tandem gives (as `--mem`).
const MIN_MEM: u64 = 16 << 20;
/// Guest memory is whole pages of this size.
const PAGE: u64 = 4096;

/// Why an incoming VM cannot take the source's size.
#[derive(Debug, thiserror::Error)]
pub enum SizeError {
    #[error("the source's guest has {} of memory: not whole 4 KiB pages of at least 16 MiB", size(*.0))]
    BadMem(u64),
    #[error("the source's guest: {0}")]
    Host(#[source] ConfigError),
}

/// The incoming VM: sized (from the options, else from the source), built
/// and handed to the incoming thread; runs it to its end.
pub fn run(from: Endpoint, args: RunArgs) -> Result<VmExit, RunError> {
    // A size given is checked first, as a boot's.
    let given = match args.mem {
        Some(_) => Some(asked_shape(&args)?),
        None => None,
    };
    let options = args.vm_options(None)?;
    let transport = crate::streams::Transport::from_config(&options.streams)
        .map_err(super::run_args::RunArgsError::Tls)?;
    let streams = transport.name(&from);
    let listener = dest::listen(&from, &transport)?;
    let (shape, mut accepted) = match given {
        Some(shape) => (shape, None),
        None => {
            let accepted = dest::accept(&listener, &from).map_err(RunError::Incoming)?;
            let machine = args.machine.unwrap_or_default();
            match source_shape(args.cpus, machine, accepted.manifest()) {
                Ok(shape) => (shape, Some(accepted)),
                Err(e) => return Err(refused(Some(accepted), e).into()),
            }
        }
    };
    let secondary = args.colo.is_some();
    let start = if secondary {
        Start::Secondary
    } else {
        Start::Incoming
    };
    let cfg = options.into_config(BootParts::default(), shape);
    let vm = builder::build(&cfg, start).map_err(|e| refused(accepted.take(), e))?;
    let then = if secondary {
        let arbiter = crate::colo::arbiter::ArbiterSpec::from_options(
            args.colo_arbiter.as_deref(),
            args.colo_lease.as_deref().map(super::absolute),
            args.colo_lease_ttl_s,
            &from,
        )
        .map_err(|e| RunError::Arbiter(refused(accepted.take(), e)))?;
        let side = crate::colo::secondary::side(&from, &arbiter, streams);
        vm.set_colo(side.clone());
        Some(crate::colo::secondary::then(side, arbiter, vm.transport()))
    } else {
        None
    };
    let spawned = match accepted {
        Some(a) => dest::spawn_accepted(vm.handle(), listener, from, then, a),
        None => dest::spawn_then(vm.handle(), listener, from, then),
    };
    spawned.map_err(RunError::Spawn)?;
    Ok(vm.run()?)
}

/// `e`, after telling the source `accepted` (if any) why it is refused.
fn refused<E: Display>(accepted: Option<Accepted>, e: E) -> E {
    if let Some(a) = accepted {
        drop(a.refuse(e.to_string()));
    }
    e
}

/// The shape of an incoming VM given no `--mem`, whose source's VM is
/// `theirs`: the source's memory size, which must be one tandem gives a
/// guest and this host holds; `cpus` if given (the stream's check refuses
/// it, with every other difference, when it is not the source's), else
/// the source's count; `machine` as given (compared the same way).
pub fn source_shape(
    cpus: Option<u8>,
    machine: Machine,
    theirs: &Manifest,
) -> Result<Shape, SizeError> {
    let mem_bytes = theirs.mem_bytes;
    if mem_bytes < MIN_MEM || !mem_bytes.is_multiple_of(PAGE) {
        return Err(SizeError::BadMem(mem_bytes));
    }
    let shown = format!("{}M", mem_bytes >> 20);
    config::check_mem_fits(mem_bytes, &shown).map_err(SizeError::Host)?;
    let cpus = match cpus {
        Some(asked) => asked,
        None => config::check_cpus(u64::from(theirs.vcpus), config::max_cpus())
            .map_err(SizeError::Host)?,
    };
    Ok(Shape {
        mem_bytes,
        cpus,
        machine,
    })
}

/// `bytes` as a size: MiB when whole, else bytes.
fn size(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(mem_bytes: u64, vcpus: u32) -> Manifest {
        Manifest {
            tandem_version: String::new(),
            mem_bytes,
            vcpus,
            devices: Vec::new(),
            firmware: None,
        }
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn takes_the_sources_size_when_none_is_given() {
        let s = source_shape(None, Machine::Pci, &source(256 * MIB, 2)).unwrap();
        assert_eq!(
            (s.mem_bytes, s.cpus, s.machine),
            (256 * MIB, 2, Machine::Pci)
        );
        let s = source_shape(None, Machine::Legacy, &source(128 * MIB, 1)).unwrap();
        assert_eq!((s.mem_bytes, s.cpus), (128 * MIB, 1));
    }

    #[test]
    fn a_given_cpus_is_kept_when_it_is_the_sources() {
        let s = source_shape(Some(4), Machine::Legacy, &source(256 * MIB, 4));
        assert_eq!(s.map(|s| (s.mem_bytes, s.cpus)).unwrap(), (256 * MIB, 4));
    }

    /// The stream's manifest check refuses it, naming it with every
    /// other difference (not this early check, which would name it alone).
    #[test]
    fn a_given_cpus_that_differs_is_left_to_the_streams_check() {
        let s = source_shape(Some(1), Machine::Pci, &source(256 * MIB, 2)).unwrap();
        assert_eq!((s.mem_bytes, s.cpus), (256 * MIB, 1));
    }

    #[test]
    fn a_size_tandem_does_not_give_is_refused() {
        for mem in [0, MIB, 16 * MIB + 1] {
            let e = source_shape(None, Machine::Legacy, &source(mem, 1)).unwrap_err();
            assert!(matches!(e, SizeError::BadMem(m) if m == mem), "{e}");
        }
        for cpus in [0, u32::from(config::max_cpus()) + 1, u32::MAX] {
            let e = source_shape(None, Machine::Legacy, &source(128 * MIB, cpus));
            assert!(matches!(e, Err(SizeError::Host(_))), "{cpus}: {e:?}");
        }
    }

    #[test]
    fn a_size_this_host_cannot_hold_is_refused() {
        // More than any host's memory (1 EiB), in whole pages.
        let e = source_shape(None, Machine::Legacy, &source(1 << 60, 1)).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, SizeError::Host(ConfigError::MemTooBig { .. })),
            "{text}"
        );
        assert!(
            text.starts_with("the source's guest: memory size"),
            "{text}"
        );
    }

    /// Without --mem the source is let in and its manifest read
    /// before any VM exists; a refusal reaches the source as its reason.
    #[test]
    fn the_source_is_accepted_first_and_told_why_it_is_refused() {
        use migration::protocol::{self, Message};
        let path =
            std::env::temp_dir().join(format!("tandem-incoming-{}.sock", std::process::id()));
        let from: Endpoint = format!("unix:{}", path.display()).parse().unwrap();
        let transport = crate::streams::Transport::new(None, false).unwrap();
        let listener = dest::listen(&from, &transport).unwrap();
        let to = from.clone();
        let sender = std::thread::spawn(move || {
            let timeout = std::time::Duration::from_secs(10);
            let mut conn = transport.connect(&to, timeout).unwrap();
            let hello = Message::Hello {
                version: protocol::VERSION,
            };
            protocol::write_message(&mut conn, &hello).unwrap();
            let config = Message::Config(source(16 * MIB + 1, 2));
            protocol::write_message(&mut conn, &config).unwrap();
            protocol::read_message(&mut conn).unwrap()
        });
        let accepted = dest::accept(&listener, &from).unwrap();
        assert_eq!(accepted.manifest().mem_bytes, 16 * MIB + 1);
        let e = source_shape(Some(2), Machine::Legacy, accepted.manifest());
        let e = refused(Some(accepted), e.unwrap_err());
        let why = "the source's guest has 16777217 bytes of memory: not whole 4 KiB pages \
                   of at least 16 MiB";
        assert_eq!(e.to_string(), why);
        assert_eq!(sender.join().unwrap(), Message::Abandon(why.into()));
        let _ = std::fs::remove_file(&path);
    }
}

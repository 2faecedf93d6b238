//! The process's confinement: one seccomp filter per thread kind
//! ([`Kind`], its rules in [`rules`]), installed by each thread on itself
//! ([`enter`]) before it touches guest memory or untrusted input, with
//! `no_new_privs` set first; the SIGSYS handler ([`sigsys`]) that turns
//! a denied call into one line naming the thread and the call; and
//! Landlock on the files the process may open ([`landlock`]).
//!
//! The mode ([`Mode`]: on, log, off) is chosen once by `tandem run`
//! ([`start`]); until then [`enter`] does nothing, so the library's own
//! tests and tools run unconfined. Filters stack: a thread spawned by a
//! confined one keeps its parent's filter and adds its own, so a parent's
//! list holds its children's (their kinds' lists are narrower).
//!
//! Runs on every thread of a `tandem run` process, once, at its start.
//! Never does: allocate or lock in the signal handler; let a thread run
//! unconfined once the mode is on (a filter that cannot be installed ends
//! the thread's start with an error).

mod ioctls;
pub mod landlock;
pub mod names;
mod rules;
mod sigsys;

use std::sync::OnceLock;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};
use serde::Deserialize;

/// What a thread's filter does with a system call outside its list.
#[derive(clap::ValueEnum, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// End tandem with one line naming the thread and the call.
    #[default]
    On,
    /// Let the call through; the kernel logs it (dmesg, audit type 1326).
    Log,
    /// No filters.
    Off,
}

/// The kinds of thread, each with its own filter ([`rules`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The main thread: start-up, the control API, the VM's end; also the
    /// list every thread it starts inherits.
    Vmm,
    /// A vCPU: `KVM_RUN` and the MMIO/PIO exits it emulates.
    Vcpu,
    /// The devices' event loop: queues, taps, disks, timers.
    Devices,
    /// Standard input to the serial port.
    Console,
    /// Migration and COLO streams: the migration and incoming threads,
    /// COLO's checkpoint, proxy and page threads, the TLS pump.
    Stream,
    /// Small helpers: the vCPU kicker, the guest profiler's sampler, the
    /// check of a mapped restore's pages.
    Helper,
}

/// Why a thread could not be confined.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("seccomp filter for the {kind:?} thread: {source}")]
    Filter {
        kind: Kind,
        #[source]
        source: seccompiler::BackendError,
    },
    #[error("seccomp filter for thread '{thread}': {source}")]
    Install {
        thread: String,
        #[source]
        source: seccompiler::Error,
    },
    #[error("cannot install the SIGSYS handler: {0}")]
    Handler(#[source] std::io::Error),
}

/// The mode, once `tandem run` has chosen it.
static MODE: OnceLock<Mode> = OnceLock::new();

/// The thread (by name) that is to make a denied call once confined,
/// from `TANDEM_SECCOMP_TEST_DENY` (the test of the SIGSYS line).
static DENY_TEST: OnceLock<Option<String>> = OnceLock::new();

/// Chooses the process's mode (once; later calls keep the first), installs
/// the SIGSYS handler, and confines the calling thread as the VMM thread.
pub fn start(mode: Mode) -> Result<(), SandboxError> {
    let mode = *MODE.get_or_init(|| mode);
    warm_allocator();
    DENY_TEST.get_or_init(|| std::env::var("TANDEM_SECCOMP_TEST_DENY").ok());
    match mode {
        Mode::Off => return Ok(()),
        Mode::Log => log::warn!(
            "seccomp: log mode: calls outside a thread's list are let through and \
             logged by the kernel (dmesg: 'audit: type=1326 ... comm=THREAD syscall=N')"
        ),
        Mode::On => sigsys::install().map_err(SandboxError::Handler)?,
    }
    enter(Kind::Vmm)
}

/// Makes glibc's allocator do now, before any filter, the one thing it
/// does lazily that opens a file: the first time a thread's own arena
/// shrinks (`shrink_heap`), it reads `/proc/sys/vm/overcommit_memory`
/// and keeps the answer for the process. From a confined thread that is
/// an `openat` its filter denies (seen: a COLO secondary's vCPU ended
/// tandem so). A thread that frees 1 MiB of small blocks shrinks its
/// arena at once (the trim threshold starts at 128 KiB and only rises
/// after large blocks are freed, which tandem has not done yet here).
/// Keeping every thread on the main arena instead (`M_ARENA_MAX` 1)
/// halved the migration's send rate.
fn warm_allocator() {
    let warm = std::thread::Builder::new()
        .name("tandem-warm".into())
        .spawn(|| {
            let pieces: Vec<Box<[u8]>> = (0..256)
                .map(|i| std::hint::black_box(vec![i as u8; 4000].into_boxed_slice()))
                .collect();
            for p in pieces.into_iter().rev() {
                drop(std::hint::black_box(p));
            }
        });
    if !matches!(warm.map(|t| t.join()), Ok(Ok(()))) {
        log::warn!("seccomp: could not warm the allocator up before the filters");
    }
}

/// The mode chosen ([`Mode::Off`] before [`start`]).
pub fn mode() -> Mode {
    MODE.get().copied().unwrap_or(Mode::Off)
}

/// Confines the calling thread with `kind`'s filter (nothing when the
/// mode is off or not chosen). Call first thing in a new thread.
pub fn enter(kind: Kind) -> Result<(), SandboxError> {
    let action = match mode() {
        Mode::Off => return Ok(()),
        Mode::Log => SeccompAction::Log,
        Mode::On => SeccompAction::Trap,
    };
    let thread = std::thread::current()
        .name()
        .unwrap_or("tandem")
        .to_string();
    sigsys::name_this_thread(&thread);
    let program = program(kind, action)?;
    seccompiler::apply_filter(&program).map_err(|source| SandboxError::Install {
        thread: thread.clone(),
        source,
    })?;
    if DENY_TEST.get().and_then(Option::as_deref) == Some(thread.as_str()) {
        // SAFETY: personality(0xffffffff) only reads the persona; the
        // filter traps it here (the test of the SIGSYS line).
        unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffffu32) };
    }
    Ok(())
}

/// [`enter`], for a thread that has no one to return an error to: a filter
/// that cannot be installed ends tandem with one line (status 1) rather
/// than let the thread run unconfined.
pub fn confine(kind: Kind) {
    if let Err(e) = enter(kind) {
        eprintln!("tandem: error: {e}");
        std::process::exit(1);
    }
}

/// `kind`'s filter as a BPF program, calls outside its list getting
/// `otherwise`.
fn program(kind: Kind, otherwise: SeccompAction) -> Result<BpfProgram, SandboxError> {
    let filter = SeccompFilter::new(
        rules::of(kind),
        otherwise,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(|source| SandboxError::Filter { kind, source })?;
    filter
        .try_into()
        .map_err(|source| SandboxError::Filter { kind, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_compiles() {
        for kind in [
            Kind::Vmm,
            Kind::Vcpu,
            Kind::Devices,
            Kind::Console,
            Kind::Stream,
            Kind::Helper,
        ] {
            let p = program(kind, SeccompAction::Trap).unwrap();
            assert!(p.len() > 10, "{kind:?}");
        }
    }

    #[test]
    fn a_confined_thread_is_refused_a_call_outside_its_list() {
        // Errno instead of Trap, so that the test process lives on.
        let p = program(Kind::Helper, SeccompAction::Errno(libc::EPERM as u32)).unwrap();
        let r = std::thread::spawn(move || {
            seccompiler::apply_filter(&p).unwrap();
            // SAFETY: socket(2) with valid arguments; refused here.
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
            let err = std::io::Error::last_os_error().raw_os_error();
            // SAFETY: getpid has no arguments; allowed for every kind.
            let pid = unsafe { libc::getpid() };
            (fd, err, pid)
        })
        .join()
        .unwrap();
        assert_eq!(r.0, -1);
        assert_eq!(r.1, Some(libc::EPERM));
        assert_eq!(r.2, std::process::id() as i32);
    }

    /// A vCPU's filter takes KVM's requests one by one: a VM or a memory
    /// slot cannot be made from it, a listed request goes through.
    #[test]
    fn a_vcpu_may_not_make_a_vm() {
        use std::os::fd::AsRawFd;
        let kvm = std::fs::File::open("/dev/kvm").expect("/dev/kvm");
        let p = program(Kind::Vcpu, SeccompAction::Errno(libc::EPERM as u32)).unwrap();
        let fd = kvm.as_raw_fd();
        let r = std::thread::spawn(move || {
            seccompiler::apply_filter(&p).unwrap();
            let call = |req: u64, arg: u64| {
                // SAFETY: KVM requests on /dev/kvm whose argument is a
                // number, not a pointer; the refused ones never run.
                let rc = unsafe { libc::ioctl(fd, req, arg) };
                (rc, std::io::Error::last_os_error().raw_os_error())
            };
            let create_vm = call(0xae01, 0);
            let api_version = call(0xae00, 0);
            let check = call(0xae03, u64::from(kvm_bindings::KVM_CAP_IRQCHIP));
            (create_vm, api_version, check)
        })
        .join()
        .unwrap();
        assert_eq!(r.0, (-1, Some(libc::EPERM)), "KVM_CREATE_VM");
        assert_eq!(r.1, (-1, Some(libc::EPERM)), "KVM_GET_API_VERSION");
        assert!(r.2 .0 >= 0, "KVM_CHECK_EXTENSION: {:?}", r.2);
    }
}

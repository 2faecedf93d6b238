//! Each thread kind's system calls: groups of calls (what any Rust thread
//! needs, starting a thread, files, sockets, event loops) combined per
//! [`Kind`], with `ioctl` narrowed to the requests the kind uses (one by
//! one for the vCPU, device, console and helper threads, [`super::ioctls`];
//! by request type for the VMM and stream threads, which make and restore
//! the VM: KVM's, the tap's and terminal's, the socket interface's) and
//! `prctl` to the operations the standard library and seccomp need.
//!
//! Pure data, read when a thread is confined. Never does: allow what
//! starts a program, changes credentials or namespaces, loads kernel code,
//! or reads another process (execve, setuid, unshare, mount, bpf,
//! ptrace, process_vm_readv, ...): no kind lists them.

use std::collections::BTreeMap;

use seccompiler::{SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};

use super::ioctls;
use super::Kind;

/// What every thread does: memory, locks, time, signals, its own end,
/// reading and writing descriptors it was given.
const BASE: &[i64] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_gettimeofday,
    libc::SYS_getrandom,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_mprotect,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_tgkill,
    libc::SYS_restart_syscall,
    libc::SYS_sched_getaffinity,
    libc::SYS_rseq,
    libc::SYS_set_robust_list,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_fcntl,
    libc::SYS_fstat,
    libc::SYS_statx,
    libc::SYS_newfstatat,
    libc::SYS_lseek,
];

/// Starting threads (the standard library's spawn); a thread's children
/// install their own filters under this one's.
const SPAWN: &[i64] = &[libc::SYS_clone, libc::SYS_clone3, libc::SYS_seccomp];

/// Starting a thread that keeps this one's filter (a vCPU's ACPI
/// power-off grace timer, started on the console's power-off line).
const SPAWN_INHERITING: &[i64] = &[libc::SYS_clone, libc::SYS_clone3];

/// Event loops: epoll, eventfds, timers.
const EVENTS: &[i64] = &[
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_eventfd2,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
];

/// Reading and writing files already open (disk images, journals).
const FILE_IO: &[i64] = &[
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_fallocate,
    libc::SYS_ftruncate,
];

/// Opening, making and removing files (snapshots, metrics, sockets' paths,
/// locks, certificates).
const FILES: &[i64] = &[
    libc::SYS_open,
    libc::SYS_openat,
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_getdents64,
    libc::SYS_getcwd,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_chmod,
    libc::SYS_fchmod,
    libc::SYS_flock,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_pipe2,
    libc::SYS_memfd_create,
    libc::SYS_statfs,
    libc::SYS_fstatfs,
    libc::SYS_sendfile,
    libc::SYS_copy_file_range,
];

/// Making and managing sockets: the API socket, streams, the COLO proxy's
/// datagrams (their sends and receives are [`DATAGRAMS`]).
const SOCKETS: &[i64] = &[
    libc::SYS_socket,
    libc::SYS_socketpair,
    libc::SYS_connect,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_shutdown,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
];

/// Sends and receives on sockets already open (also a device's COLO
/// backend).
const DATAGRAMS: &[i64] = &[
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_sendmmsg,
    libc::SYS_recvmmsg,
];

/// What the VMM thread does beside: signal handlers (the vCPU kick is set
/// up once), the host's identity and limits, scheduling.
const PROCESS: &[i64] = &[
    libc::SYS_rt_sigaction,
    libc::SYS_uname,
    libc::SYS_sysinfo,
    libc::SYS_prlimit64,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_sched_setaffinity,
    libc::SYS_getpriority,
    libc::SYS_setpriority,
    libc::SYS_umask,
];

/// `ioctl` request types (bits 8-15 of the request).
const IOCTL_KVM: u64 = 0xAE;
/// `TUN*` (a tap's) and the terminal's `TC*`/`TIOC*`/`FIO*`: both 'T'.
const IOCTL_TTY_TUN: u64 = b'T' as u64;
/// The socket interface's `SIOC*` (a tap's link and MTU).
const IOCTL_SOCKET: u64 = 0x89;
/// Block devices' `BLK*` (a disk that is a device, not a file).
const IOCTL_BLOCK: u64 = 0x12;
/// A userfaultfd's `UFFDIO_*` (post-copy's destination).
const IOCTL_UFFD: u64 = 0xAA;

/// Post-copy's destination: a userfaultfd over guest RAM.
const POSTCOPY: &[i64] = &[libc::SYS_userfaultfd];

/// `prctl` operations: a thread's name (the standard library names each
/// new thread), `no_new_privs` (set before each filter).
const PRCTL_OPS: &[u64] = &[
    libc::PR_SET_NAME as u64,
    libc::PR_GET_NAME as u64,
    libc::PR_SET_NO_NEW_PRIVS as u64,
];

/// A kind's `ioctl` requests, one by one (besides its types).
fn requests(kind: Kind) -> Vec<u64> {
    let mut r = match kind {
        Kind::Vcpu => [ioctls::VCPU_KVM, &[ioctls::TUN_SET_OFFLOAD]].concat(),
        Kind::Devices => vec![ioctls::TUN_SET_OFFLOAD],
        Kind::Vmm | Kind::Stream | Kind::Console | Kind::Helper => Vec::new(),
    };
    r.extend_from_slice(ioctls::TERMINAL);
    r
}

/// A kind's calls: the groups it uses, and its `ioctl` types (any
/// request of these types).
fn lists(kind: Kind) -> (Vec<&'static [i64]>, &'static [u64]) {
    use Kind::*;
    match kind {
        // The VMM thread's filter stays on the threads it starts, under
        // their own: what a stream thread does, it allows too.
        Vmm => (
            vec![
                BASE, SPAWN, EVENTS, FILE_IO, FILES, SOCKETS, DATAGRAMS, PROCESS, POSTCOPY,
            ],
            &[
                IOCTL_KVM,
                IOCTL_TTY_TUN,
                IOCTL_SOCKET,
                IOCTL_BLOCK,
                IOCTL_UFFD,
            ],
        ),
        Stream => (
            vec![
                BASE, SPAWN, EVENTS, FILE_IO, FILES, SOCKETS, DATAGRAMS, POSTCOPY,
            ],
            &[IOCTL_KVM, IOCTL_TTY_TUN, IOCTL_SOCKET, IOCTL_UFFD],
        ),
        Vcpu => (vec![BASE, EVENTS, SPAWN_INHERITING], &[]),
        Devices => (vec![BASE, EVENTS, FILE_IO, DATAGRAMS], &[]),
        Console => (vec![BASE], &[]),
        Helper => (vec![BASE], &[]),
    }
}

/// `kind`'s rules, in seccompiler's form: a call with no conditions is
/// allowed outright; `ioctl` and `prctl` only with the values listed (the
/// request types first, then the requests: `KVM_RUN` leads a vCPU's).
pub fn of(kind: Kind) -> BTreeMap<i64, Vec<SeccompRule>> {
    let (groups, types) = lists(kind);
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in groups.into_iter().flatten() {
        rules.insert(*nr, Vec::new());
    }
    let ioctl: Vec<SeccompRule> = types
        .iter()
        .map(|&ty| masked(1, 0xff00, ty << 8))
        .chain(requests(kind).into_iter().map(|req| equal(1, req)))
        .collect();
    // An empty list would allow every request.
    if !ioctl.is_empty() {
        rules.insert(libc::SYS_ioctl, ioctl);
    }
    let prctl = PRCTL_OPS.iter().map(|&op| equal(0, op)).collect();
    rules.insert(libc::SYS_prctl, prctl);
    rules
}

/// A rule: argument `arg`'s low 32 bits, masked with `mask`, equal `value`.
fn masked(arg: u8, mask: u64, value: u64) -> SeccompRule {
    let cond = SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(mask),
        value,
    );
    rule(cond)
}

/// A rule: argument `arg` (its low 32 bits) equals `value`.
fn equal(arg: u8, value: u64) -> SeccompRule {
    let cond = SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, value);
    rule(cond)
}

/// One condition as a rule. The conditions here are constants whose
/// argument index is below 6, which is all `SeccompCondition::new` checks.
fn rule(cond: Result<SeccompCondition, seccompiler::BackendError>) -> SeccompRule {
    match cond.and_then(|c| SeccompRule::new(vec![c])) {
        Ok(r) => r,
        Err(e) => unreachable!("a constant seccomp condition is refused: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_kind_lists_a_call_that_escapes() {
        let escapes = [
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_ptrace,
            libc::SYS_setuid,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_mount,
            libc::SYS_bpf,
            libc::SYS_process_vm_readv,
            libc::SYS_init_module,
            libc::SYS_personality,
        ];
        for kind in [
            Kind::Vmm,
            Kind::Stream,
            Kind::Vcpu,
            Kind::Devices,
            Kind::Console,
            Kind::Helper,
        ] {
            let rules = of(kind);
            for nr in escapes {
                assert!(!rules.contains_key(&nr), "{kind:?} lists {nr}");
            }
        }
    }

    #[test]
    fn narrow_kinds_list_requests_not_types() {
        for kind in [Kind::Vcpu, Kind::Devices, Kind::Console, Kind::Helper] {
            let (_, types) = lists(kind);
            assert!(types.is_empty(), "{kind:?}");
            assert!(!of(kind)[&libc::SYS_ioctl].is_empty(), "{kind:?}");
        }
        assert_eq!(requests(Kind::Vcpu)[0], ioctls::KVM_RUN);
    }

    #[test]
    fn a_vcpu_may_not_open_files_or_sockets() {
        let rules = of(Kind::Vcpu);
        for nr in [libc::SYS_openat, libc::SYS_socket, libc::SYS_seccomp] {
            assert!(!rules.contains_key(&nr), "{nr}");
        }
    }
}

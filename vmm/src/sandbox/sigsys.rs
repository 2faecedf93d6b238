//! The SIGSYS handler: a call a thread's filter denies (the kernel traps it
//! and signals that thread) ends tandem with one line on stderr naming the
//! thread and the call, and exit status 4.
//!
//! The handler runs on the thread that made the call, inside the signal.
//! Never does: allocate, lock, or make a call that a filter could deny
//! (only write(2) and exit_group(2), which every kind allows); the thread's
//! name is kept beforehand in a thread-local buffer for it.

use std::cell::Cell;
use std::fmt::Write as _;

use super::names;

/// The exit status of a process ended by a denied call.
pub const EXIT_DENIED: i32 = 4;

/// Room for a thread's name (Linux keeps 15 bytes of it).
const NAME_LEN: usize = 16;

thread_local! {
    /// This thread's name, kept for the handler.
    static NAME: Cell<([u8; NAME_LEN], usize)> = const { Cell::new(([0; NAME_LEN], 0)) };
}

/// Keeps `name` (its first 16 bytes) for this thread's SIGSYS line.
pub fn name_this_thread(name: &str) {
    let mut buf = [0u8; NAME_LEN];
    let n = name.len().min(NAME_LEN);
    buf[..n].copy_from_slice(&name.as_bytes()[..n]);
    NAME.with(|c| c.set((buf, n)));
}

/// Installs the handler for the whole process.
pub fn install() -> std::io::Result<()> {
    // SAFETY: a zeroed sigaction is a valid start; the fields set below
    // are a handler with the SA_SIGINFO signature and its flags.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = on_sigsys as *const () as usize;
    act.sa_flags = libc::SA_SIGINFO;
    // SAFETY: `act` is fully initialised and outlives the call; the old
    // action is not asked for.
    let rc = unsafe { libc::sigaction(libc::SIGSYS, &act, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A fixed buffer that `write!` fills without allocating.
struct Line {
    buf: [u8; 320],
    len: usize,
}

impl std::fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let room = self.buf.len() - self.len;
        let n = s.len().min(room);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

/// The line for a denied call `nr` on thread `thread`.
fn line(thread: &str, nr: i64) -> Line {
    let mut line = Line {
        buf: [0; 320],
        len: 0,
    };
    let call = names::name(nr).unwrap_or("unknown");
    // Writing into `Line` never fails (it cuts at its end).
    let _ = writeln!(
        line,
        "tandem: seccomp: thread '{thread}' made system call {call} ({nr}), which its \
         filter denies; tandem stops (docs/sandbox.md: find every such call with --seccomp log)"
    );
    line
}

/// The number of the system call a SIGSYS names: `si_syscall`, after the
/// three ints, their padding and `si_call_addr` in x86_64's `siginfo_t`.
///
/// # Safety
/// `info` points to the `siginfo_t` of a SIGSYS.
unsafe fn syscall_of(info: *const libc::siginfo_t) -> i64 {
    // SAFETY: the caller's; offset 24 is within the 128-byte siginfo_t.
    let nr = unsafe { std::ptr::read_unaligned(info.cast::<u8>().add(24).cast::<i32>()) };
    i64::from(nr)
}

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes the SIGSYS's siginfo.
    let nr = unsafe { syscall_of(info) };
    let (buf, n) = NAME.with(Cell::get);
    let thread = std::str::from_utf8(&buf[..n]).unwrap_or("?");
    let line = line(thread, nr);
    // SAFETY: write(2) from a valid buffer of `len` bytes, then the
    // process's end; both are async-signal-safe and allowed everywhere.
    unsafe {
        libc::write(2, line.buf.as_ptr().cast(), line.len);
        libc::_exit(EXIT_DENIED);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_names_the_thread_and_the_call() {
        let l = line("vcpu0", libc::SYS_personality);
        let text = std::str::from_utf8(&l.buf[..l.len]).unwrap();
        assert!(
            text.starts_with("tandem: seccomp: thread 'vcpu0' made system call personality (135)")
        );
        assert!(text.ends_with('\n'));
    }

    #[test]
    fn a_long_name_is_cut_not_overrun() {
        name_this_thread("a-thread-name-longer-than-sixteen");
        let (buf, n) = NAME.with(Cell::get);
        assert_eq!(n, NAME_LEN);
        assert_eq!(&buf[..4], b"a-th");
    }
}

//! The serial console on the user's terminal: stdin in raw mode (restored on
//! every way out), a reader thread that feeds the guest's UART, the Ctrl-A
//! escape, and a watcher of the guest's output for the kernel's own panic and
//! power-off messages (a guest without ACPI has no other way to say either).

use std::io::{self, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use devices::serial::Serial;

use crate::vstate::exit::{ExitSignal, VmExit};

/// Input waiting for the guest beyond this makes the reader thread wait.
const MAX_PENDING_INPUT: usize = 1 << 20;
const CTRL_A: u8 = 0x01;

static SAVED_TERMIOS: Mutex<Option<libc::termios>> = Mutex::new(None);

/// Puts stdin in raw mode if it is a terminal, and installs handlers that
/// restore it on SIGTERM, SIGHUP and SIGINT. Returns whether it did.
pub fn enter_raw_mode() -> bool {
    // SAFETY: isatty only inspects the descriptor.
    if unsafe { libc::isatty(libc::STDIN_FILENO) } != 1 {
        return false;
    }
    // SAFETY: termios is plain old data; tcgetattr fills it or fails.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor and pointer.
    if unsafe { libc::tcgetattr(libc::STDIN_FILENO, &mut t) } != 0 {
        return false;
    }
    *devices::sync::lock(&SAVED_TERMIOS) = Some(t);
    let mut raw = t;
    raw.c_lflag &= !(libc::ICANON | libc::ECHO | libc::ISIG | libc::IEXTEN);
    raw.c_iflag &= !(libc::ICRNL | libc::IXON | libc::INLCR | libc::IGNCR);
    raw.c_cc[libc::VMIN] = 1;
    raw.c_cc[libc::VTIME] = 0;
    // SAFETY: valid descriptor and pointer.
    unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &raw) };
    for sig in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT] {
        // SAFETY: the handler only calls async-signal-safe functions.
        unsafe { libc::signal(sig, on_fatal_signal as *const () as libc::sighandler_t) };
    }
    true
}

/// Restores the terminal if `enter_raw_mode` changed it.
pub fn restore_terminal() {
    if let Ok(saved) = SAVED_TERMIOS.try_lock() {
        if let Some(t) = saved.as_ref() {
            // SAFETY: valid descriptor and pointer.
            unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, t) };
        }
    }
}

extern "C" fn on_fatal_signal(sig: libc::c_int) {
    restore_terminal();
    // SAFETY: _exit is async-signal-safe.
    unsafe { libc::_exit(128 + sig) };
}

/// The console escape: Ctrl-A x quits, Ctrl-A Ctrl-A sends one Ctrl-A, and
/// Ctrl-A followed by anything else sends both bytes.
#[derive(Default)]
pub struct Escape {
    armed: bool,
}

impl Escape {
    /// Filters `input` into `out`; returns true when the user asked to quit.
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> bool {
        for &b in input {
            if self.armed {
                self.armed = false;
                match b {
                    b'x' | b'X' => return true,
                    CTRL_A => out.push(CTRL_A),
                    _ => out.extend_from_slice(&[CTRL_A, b]),
                }
            } else if b == CTRL_A {
                self.armed = true;
            } else {
                out.push(b);
            }
        }
        false
    }
}

/// Reads stdin until EOF and feeds the guest's UART. EOF ends only this
/// thread: the guest goes on running.
pub fn spawn_input<W: Write + Send + 'static>(
    serial: Arc<Mutex<Serial<W>>>,
    exit: Arc<ExitSignal>,
    escape: bool,
) -> io::Result<()> {
    std::thread::Builder::new()
        .name("console-in".into())
        .spawn(move || {
            crate::sandbox::confine(crate::sandbox::Kind::Console);
            let mut esc = Escape::default();
            let mut buf = [0u8; 4096];
            let mut bytes = Vec::with_capacity(buf.len());
            loop {
                // SAFETY: reading into a buffer we own, within its length.
                let n =
                    unsafe { libc::read(libc::STDIN_FILENO, buf.as_mut_ptr().cast(), buf.len()) };
                if n == 0 {
                    log::debug!("console: end of input; the guest keeps running");
                    return;
                }
                if n < 0 {
                    let e = io::Error::last_os_error();
                    if e.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    log::debug!("console: cannot read input: {e}");
                    return;
                }
                bytes.clear();
                let input = &buf[..n as usize];
                if escape {
                    if esc.feed(input, &mut bytes) {
                        exit.signal(VmExit::Quit);
                        return;
                    }
                } else {
                    bytes.extend_from_slice(input);
                }
                loop {
                    let mut s = devices::sync::lock(&serial);
                    if s.pending_input() < MAX_PENDING_INPUT {
                        s.queue_input(&bytes);
                        break;
                    }
                    drop(s);
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        })?;
    Ok(())
}

const PANIC_MARK: &str = "Kernel panic - not syncing";
const PANIC_END_MARK: &str = "---[ end Kernel panic";
const POWER_OFF_MARKS: [&str; 2] = ["reboot: Power down", "reboot: System halted"];
const MAX_LINE: usize = 512;

/// The guest's console output: copied to `out`, and watched line by line.
pub struct ConsoleOut<W: Write> {
    out: W,
    line: Vec<u8>,
    exit: Arc<ExitSignal>,
}

impl<W: Write> ConsoleOut<W> {
    /// Output to `out`, reporting panics and power-off to `exit`.
    pub fn new(out: W, exit: Arc<ExitSignal>) -> Self {
        ConsoleOut {
            out,
            line: Vec::with_capacity(MAX_LINE),
            exit,
        }
    }

    fn end_of_line(&mut self) {
        let line = String::from_utf8_lossy(&self.line);
        let line = line.trim();
        // The end marker repeats the panic message, so it is checked first.
        if line.contains(PANIC_END_MARK) {
            let msg = self
                .exit
                .panic_line()
                .unwrap_or_else(|| PANIC_MARK.to_string());
            self.exit.signal(VmExit::Panic(msg));
        } else if let Some(at) = line.find(PANIC_MARK) {
            self.exit.note_panic(line[at..].to_string());
        } else if POWER_OFF_MARKS.iter().any(|m| line.ends_with(m)) {
            self.exit.console_power_off();
        }
        self.line.clear();
    }
}

impl<W: Write> Write for ConsoleOut<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        for &b in buf {
            match b {
                b'\n' => self.end_of_line(),
                b'\r' => {}
                _ if self.line.len() < MAX_LINE => self.line.push(b),
                _ => {}
            }
        }
        // A closed or broken stdout must not stop the guest.
        let _ = self.out.write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let _ = self.out.flush();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_quits_and_passes_everything_else() {
        let mut e = Escape::default();
        let mut out = vec![];
        assert!(!e.feed(b"ab\x01\x01c\x01", &mut out));
        assert!(!e.feed(b"z", &mut out));
        assert_eq!(out, b"ab\x01c\x01z");
        out.clear();
        assert!(e.feed(b"q\x01x", &mut out));
        assert_eq!(out, b"q");
    }

    #[test]
    fn watcher_reports_panic_after_its_end_marker_and_power_off() {
        let exit = Arc::new(ExitSignal::new().unwrap());
        let mut c = ConsoleOut::new(Vec::new(), exit.clone());
        c.write_all(b"[    1.0] Kernel panic - not syncing: Attempted to kill init!\r\n")
            .unwrap();
        c.write_all(b"trace...\r\n[ 1.1] ---[ end Kernel panic - not syncing: x ]---\r\n")
            .unwrap();
        assert_eq!(
            exit.wait(),
            VmExit::Panic("Kernel panic - not syncing: Attempted to kill init!".into())
        );
        assert!(c.out.starts_with(b"[    1.0] Kernel panic"));

        let exit = Arc::new(ExitSignal::new().unwrap());
        let mut c = ConsoleOut::new(Vec::new(), exit.clone());
        c.write_all(b"hello\n[   70.1] reboot: Power down\r\n")
            .unwrap();
        assert_eq!(exit.wait(), VmExit::PowerOff);
    }

    #[test]
    fn long_lines_are_bounded() {
        let exit = Arc::new(ExitSignal::new().unwrap());
        let mut c = ConsoleOut::new(io::sink(), exit);
        c.write_all(&vec![b'a'; 10 * MAX_LINE]).unwrap();
        assert_eq!(c.line.len(), MAX_LINE);
    }
}

//! How a VM ends, and how the thread that notices tells the main thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm_sys_util::eventfd::EventFd;

/// Why the VM stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmExit {
    /// The guest rebooted (i8042 reset, triple fault, or a reset system event).
    Reboot,
    /// The guest powered off or halted.
    PowerOff,
    /// The user quit from the console (Ctrl-A x).
    Quit,
    /// A `shutdown` request on the control API.
    Shutdown,
    /// The guest kernel panicked; the panic line.
    Panic(String),
    /// A vCPU could not go on; what happened.
    Fatal(String),
    /// The guest was migrated to this address and runs there now.
    Migrated(String),
    /// An incoming migration failed before the guest ran here; why.
    IncomingFailed(String),
    /// A COLO secondary that must not serve (its state is behind what the
    /// client saw, or the pair never protected it); why.
    Retired(String),
    /// A COLO side that fenced itself and then learned from the arbiter
    /// that it lost the lease; why.
    Fenced(String),
    /// A post-copy migration broke after the switch: neither side holds
    /// the whole guest; why.
    Lost(String),
}

impl VmExit {
    /// The process exit status: 0 when the guest ended itself normally or the
    /// user quit, 2 for a guest panic, 3 for a fatal vCPU error. (1 is for
    /// errors before the guest runs.)
    pub fn status(&self) -> i32 {
        match self {
            VmExit::Reboot
            | VmExit::PowerOff
            | VmExit::Quit
            | VmExit::Shutdown
            | VmExit::Migrated(_) => 0,
            VmExit::IncomingFailed(_)
            | VmExit::Retired(_)
            | VmExit::Fenced(_)
            | VmExit::Lost(_) => 1,
            VmExit::Panic(_) => 2,
            VmExit::Fatal(_) => 3,
        }
    }
}

/// Set once by whoever sees the end first; the main thread waits on it.
pub struct ExitSignal {
    reason: Mutex<Option<VmExit>>,
    panic_line: Mutex<Option<String>>,
    evt: EventFd,
    /// An ACPI machine: the guest powers off through ACPI, and its
    /// console's power-off line is only a fallback.
    acpi: AtomicBool,
}

/// How long an ACPI machine's guest has, after its console printed the
/// power-off line, to power off through ACPI before the line is taken as
/// the power-off (a kernel without ACPI).
pub const ACPI_POWER_OFF_GRACE: Duration = Duration::from_secs(2);

impl ExitSignal {
    /// A new signal; fails only if no eventfd can be made.
    pub fn new() -> std::io::Result<ExitSignal> {
        Ok(ExitSignal {
            reason: Mutex::new(None),
            panic_line: Mutex::new(None),
            evt: EventFd::new(0)?,
            acpi: AtomicBool::new(false),
        })
    }

    /// Marks the machine as one that powers off through ACPI.
    pub fn expect_acpi_power_off(&self) {
        self.acpi.store(true, Ordering::Relaxed);
    }

    /// The guest's console printed the kernel's power-off line. Without
    /// ACPI that is the power-off. With ACPI the power-off comes from the
    /// guest's sleep-state write; the line counts only if none comes
    /// within [`ACPI_POWER_OFF_GRACE`] (said with a warning).
    pub fn console_power_off(self: &Arc<Self>) {
        if !self.acpi.load(Ordering::Relaxed) {
            self.signal(VmExit::PowerOff);
            return;
        }
        let me = self.clone();
        let waiter = std::thread::Builder::new()
            .name("acpi-grace".into())
            // Started by a vCPU thread (the console's power-off line), whose
            // filter it keeps (docs/sandbox.md).
            .spawn(move || {
                std::thread::sleep(ACPI_POWER_OFF_GRACE);
                if devices::sync::lock(&me.reason).is_none() {
                    log::warn!(
                        "the guest printed its power-off line but made no ACPI power-off \
                         within {} s: taking the line as the power-off",
                        ACPI_POWER_OFF_GRACE.as_secs()
                    );
                    me.signal(VmExit::PowerOff);
                }
            });
        if waiter.is_err() {
            self.signal(VmExit::PowerOff);
        }
    }

    /// A clone of the eventfd: a write with no reason recorded means reset
    /// (this is what the i8042 gets).
    pub fn reset_evt(&self) -> std::io::Result<EventFd> {
        self.evt.try_clone()
    }

    /// Records `why` (the first reason wins) and wakes the main thread.
    pub fn signal(&self, why: VmExit) {
        let mut r = devices::sync::lock(&self.reason);
        if r.is_none() {
            *r = Some(why);
        }
        drop(r);
        if let Err(e) = self.evt.write(1) {
            log::error!("cannot wake the main thread: {e}");
        }
    }

    /// Notes that the guest kernel announced a panic: a reset that follows
    /// is reported as the panic, not as a reboot.
    pub fn note_panic(&self, line: String) {
        devices::sync::lock(&self.panic_line).get_or_insert(line);
    }

    /// The panic line, if the guest announced one.
    pub fn panic_line(&self) -> Option<String> {
        devices::sync::lock(&self.panic_line).clone()
    }

    /// Blocks until the VM ends and returns why.
    pub fn wait(&self) -> VmExit {
        loop {
            match self.evt.read() {
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return VmExit::Fatal(format!("cannot wait for the VM: {e}"));
                }
            }
        }
        self.reason()
    }

    /// The eventfd that becomes readable when the VM ends (for epoll).
    pub fn as_raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.evt.as_raw_fd()
    }

    /// Why the VM ended, once its eventfd fired.
    pub fn reason(&self) -> VmExit {
        let reason = devices::sync::lock(&self.reason).take();
        match (reason, self.panic_line()) {
            (Some(VmExit::Reboot) | None, Some(p)) => VmExit::Panic(p),
            (Some(r), _) => r,
            (None, None) => VmExit::Reboot,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_reason_wins_and_reset_after_panic_is_a_panic() {
        let s = ExitSignal::new().unwrap();
        s.signal(VmExit::PowerOff);
        s.signal(VmExit::Fatal("x".into()));
        assert_eq!(s.wait(), VmExit::PowerOff);

        let s = ExitSignal::new().unwrap();
        s.reset_evt().unwrap().write(1).unwrap();
        assert_eq!(s.wait(), VmExit::Reboot);

        let s = ExitSignal::new().unwrap();
        s.note_panic("Kernel panic - not syncing: x".into());
        s.reset_evt().unwrap().write(1).unwrap();
        assert_eq!(s.wait().status(), 2);
    }

    #[test]
    fn acpi_machines_take_the_console_line_only_after_the_grace() {
        let s = Arc::new(ExitSignal::new().unwrap());
        s.console_power_off();
        assert_eq!(s.wait(), VmExit::PowerOff);

        let s = Arc::new(ExitSignal::new().unwrap());
        s.expect_acpi_power_off();
        let t = std::time::Instant::now();
        s.console_power_off();
        assert!(devices::sync::lock(&s.reason).is_none());
        assert_eq!(s.wait(), VmExit::PowerOff);
        assert!(t.elapsed() >= ACPI_POWER_OFF_GRACE);
    }
}

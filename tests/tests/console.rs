//! The console shell the tests drive (the run's base guest, restored)
//! outlives its background jobs: a job that ends while the shell waits for
//! its next command leaves the same shell, with its variables, reading
//! the next one. Busybox ash with console echo off would take the EINTR
//! of its SIGCHLD handler for the end of input and exit (see
//! `TestVm::wait_ready`), and every test that starts a job (`nc`, the
//! migration's stream) could lose its shell, and the command sent next.

use std::time::Duration;

use tandem_tests::base::{HOST_IP0, PREFIX};
use tandem_tests::netns::NetNs;
use tandem_tests::TestVm;

const CMD: Duration = tandem_tests::CMD_TIMEOUT;

#[test]
fn the_console_shell_outlives_its_background_jobs() {
    let ns = NetNs::new("console");
    ns.add_tap("tap0", &format!("{HOST_IP0}/{PREFIX}"));
    let mut vm = TestVm::restore_base(&ns, ["tap0", "tap1"], &[]);
    let shell = vm.ok("echo $$", CMD);
    vm.ok("kept=yes; sleep 1 & job=$!", CMD);
    // The job ends while the shell waits at its prompt.
    std::thread::sleep(Duration::from_secs(3));
    let out = vm.ok("echo \"$$ $kept\"; wait $job; echo \"job $?\"", CMD);
    assert!(out.contains(&format!("{shell} yes")), "{out}");
    assert!(out.contains("job 0"), "{out}");
    assert!(!vm.console().contains("BusyBox"), "{}", vm.console());
}

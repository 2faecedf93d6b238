//! A confined thread may free memory: glibc opens
//! `/proc/sys/vm/overcommit_memory` the first time a thread's own arena
//! shrinks, an `openat` a vCPU's filter denies (it once ended a COLO
//! secondary). `sandbox::start` makes a thread of its own shrink an arena
//! first, before any filter, so the answer is known and nothing is opened
//! later.
//!
//! Its own process, without the test harness: the harness's threads
//! would have shrunk arenas before `start`, and the check must be the
//! first shrink in the process. A denied call ends the process with the
//! sandbox's one line (status 4), which fails the test.

use std::process::ExitCode;

use vmm::sandbox::{self, Kind, Mode};

fn main() -> ExitCode {
    if let Err(e) = sandbox::start(Mode::On) {
        eprintln!("sandbox_malloc: {e}");
        return ExitCode::FAILURE;
    }
    let vcpu = std::thread::Builder::new().name("vcpu0".into()).spawn(|| {
        sandbox::confine(Kind::Vcpu);
        // 2 MiB in pieces under the mmap threshold, freed from the
        // top: the heap's free top passes the trim threshold.
        let pieces: Vec<Vec<u8>> = (0..512).map(|i| vec![i as u8; 4000]).collect();
        let sum: usize = pieces.iter().map(|p| usize::from(p[0])).sum();
        for p in pieces.into_iter().rev() {
            drop(p);
        }
        sum
    });
    match vcpu.map(|t| t.join()) {
        Ok(Ok(_)) => {
            println!("sandbox_malloc: a confined thread freed 2 MiB and opened nothing: ok");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("sandbox_malloc: the confined thread failed");
            ExitCode::FAILURE
        }
    }
}

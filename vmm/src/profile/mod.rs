//! The guest profiler: where a guest's vCPUs spend their time, sampled from
//! outside the guest.
//!
//! A sampler thread ticks at the rate asked (default 1000 Hz). At each tick
//! it marks every vCPU as wanted and kicks its thread (the pause kick: a
//! signal that makes `KVM_RUN` return, with `immediate_exit` so a kick that
//! lands outside `KVM_RUN` is not lost). The vCPU thread, at its next clean
//! point, reads its registers (`KVM_GET_REGS`, `KVM_GET_SREGS`), and for a
//! kernel-mode sample follows the frame pointers through guest memory
//! ([`stack`]); a user-mode sample is counted as `[user]`. Samples are
//! aggregated per vCPU (identical chains counted once) and symbolized only
//! when the profile ends ([`report`], [`symbols`]).
//!
//! Threads: the sampler thread only sets flags and sends signals; each vCPU
//! thread takes its own samples and locks only its own sample set (the VMM
//! thread locks it once, at the end); the VMM thread starts and stops.
//! A sample never stops the VM: any read that fails ends the chain.

pub mod report;
pub mod stack;
pub mod symbols;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devices::GuestMemoryMmap;
use kvm_ioctls::VcpuFd;
use serde::Serialize;

use crate::pause::ThreadKick;
use stack::{ChainEnd, Paging};
use symbols::{Symbols, SymbolsError};

/// The default sampling rate.
pub const DEFAULT_HZ: u32 = 1000;
/// The highest rate taken (each sample is an exit of every vCPU).
pub const MAX_HZ: u32 = 10_000;
/// How many functions the table shows.
pub const TOP: usize = 30;
/// Distinct chains kept per vCPU; samples beyond are counted as dropped.
const MAX_STACKS: usize = 50_000;
/// The frame a user-mode sample holds (no kernel address is 0).
pub const USER_FRAME: u64 = 0;

/// Profiler errors (each a one-line message for the user).
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("a profile is already running (stop it first)")]
    Running,
    #[error("no profile is running")]
    NotRunning,
    #[error("sampling rate must be 1 to {MAX_HZ} Hz, not {0}")]
    Rate(u32),
    #[error("cannot start the sampler thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Symbols(#[from] SymbolsError),
    #[error("cannot write the profile to {path}: {err}")]
    Write { path: PathBuf, err: std::io::Error },
}

/// Checks a sampling rate given by the user.
pub fn check_hz(hz: u32) -> Result<u32, ProfileError> {
    if (1..=MAX_HZ).contains(&hz) {
        Ok(hz)
    } else {
        Err(ProfileError::Rate(hz))
    }
}

/// One vCPU's samples.
#[derive(Default)]
struct SampleSet {
    /// Chain (leaf first) -> samples.
    stacks: HashMap<Box<[u64]>, u64>,
    user: u64,
    kernel: u64,
    /// Samples whose registers could not be read.
    failed: u64,
    /// Samples not kept because `stacks` was full.
    dropped: u64,
    /// How kernel chains ended: complete, depth limit, bad frame.
    ends: [u64; 3],
    /// Time spent taking samples on the vCPU thread.
    cost_ns: u64,
}

impl SampleSet {
    fn add(&mut self, chain: Vec<u64>) {
        if let Some(n) = self.stacks.get_mut(chain.as_slice()) {
            *n += 1;
        } else if self.stacks.len() < MAX_STACKS {
            self.stacks.insert(chain.into_boxed_slice(), 1);
        } else {
            self.dropped += 1;
        }
    }

    fn merge(&mut self, other: SampleSet) {
        for (k, v) in other.stacks {
            *self.stacks.entry(k).or_default() += v;
        }
        self.user += other.user;
        self.kernel += other.kernel;
        self.failed += other.failed;
        self.dropped += other.dropped;
        for (a, b) in self.ends.iter_mut().zip(other.ends) {
            *a += b;
        }
        self.cost_ns += other.cost_ns;
    }
}

/// The per-vCPU part.
#[derive(Default)]
struct VcpuSlot {
    /// Set by the sampler, taken by the vCPU thread at its next clean point.
    want: AtomicBool,
    kick: Arc<ThreadKick>,
    set: Mutex<SampleSet>,
}

/// A running profile (VMM thread only).
struct Session {
    hz: u32,
    started: Instant,
    stop: Arc<AtomicBool>,
    ticks: Arc<AtomicU64>,
    thread: JoinHandle<()>,
}

/// The profiler of one VM: shared by its vCPU threads, the sampler and the
/// VMM thread.
pub struct Profiler {
    vcpus: Vec<VcpuSlot>,
    session: Mutex<Option<Session>>,
}

impl Profiler {
    /// A stopped profiler for vCPUs whose threads are kicked through `kicks`.
    pub fn new(kicks: Vec<Arc<ThreadKick>>) -> Profiler {
        Profiler {
            vcpus: kicks
                .into_iter()
                .map(|kick| VcpuSlot {
                    kick,
                    ..Default::default()
                })
                .collect(),
            session: Mutex::new(None),
        }
    }

    /// Starts sampling every vCPU `hz` times a second.
    pub fn start(self: &Arc<Self>, hz: u32) -> Result<(), ProfileError> {
        let hz = check_hz(hz)?;
        let mut session = devices::sync::lock(&self.session);
        if session.is_some() {
            return Err(ProfileError::Running);
        }
        for v in &self.vcpus {
            *devices::sync::lock(&v.set) = SampleSet::default();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let ticks = Arc::new(AtomicU64::new(0));
        let me = self.clone();
        let (stop2, ticks2) = (stop.clone(), ticks.clone());
        let thread = std::thread::Builder::new()
            .name("profiler".into())
            .spawn(move || {
                crate::sandbox::confine(crate::sandbox::Kind::Helper);
                me.sample_loop(hz, &stop2, &ticks2)
            })
            .map_err(ProfileError::Thread)?;
        *session = Some(Session {
            hz,
            started: Instant::now(),
            stop,
            ticks,
            thread,
        });
        log::info!("guest profile started at {hz} Hz");
        Ok(())
    }

    /// Whether a profile is running.
    pub fn running(&self) -> bool {
        devices::sync::lock(&self.session).is_some()
    }

    /// The sampler thread: marks and kicks every vCPU once per period.
    fn sample_loop(&self, hz: u32, stop: &AtomicBool, ticks: &AtomicU64) {
        let period = Duration::from_secs(1) / hz;
        let mut next = Instant::now() + period;
        while !stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
            for v in &self.vcpus {
                v.want.store(true, Ordering::Relaxed);
            }
            for v in &self.vcpus {
                v.kick.kick();
            }
            ticks.fetch_add(1, Ordering::Relaxed);
            next += period;
            // A late tick is not made up for: the rate stays the one asked.
            let now = Instant::now();
            if next < now {
                next = now + period;
            }
        }
    }

    /// Called by vCPU `id`'s thread at each clean point (outside `KVM_RUN`,
    /// its last exit handled): takes a sample if one is wanted.
    pub fn on_vcpu_exit(&self, id: usize, fd: &VcpuFd, mem: &GuestMemoryMmap) {
        let Some(slot) = self.vcpus.get(id) else {
            return;
        };
        // A plain load first: the common case (no sample wanted) writes nothing.
        if !slot.want.load(Ordering::Relaxed) || !slot.want.swap(false, Ordering::Relaxed) {
            return;
        }
        let start = Instant::now();
        let sample = take_sample(fd, mem);
        let mut set = devices::sync::lock(&slot.set);
        match sample {
            None => set.failed += 1,
            Some((chain, None)) => {
                set.user += 1;
                set.add(chain);
            }
            Some((chain, Some(end))) => {
                set.kernel += 1;
                set.ends[end as usize] += 1;
                set.add(chain);
            }
        }
        set.cost_ns += start.elapsed().as_nanos() as u64;
    }

    /// Stops the running profile and returns its samples.
    pub fn stop(&self) -> Result<Profile, ProfileError> {
        let session = devices::sync::lock(&self.session)
            .take()
            .ok_or(ProfileError::NotRunning)?;
        session.stop.store(true, Ordering::Relaxed);
        if session.thread.join().is_err() {
            log::error!("the profiler's sampler thread panicked");
        }
        let seconds = session.started.elapsed().as_secs_f64();
        let mut all = SampleSet::default();
        for v in &self.vcpus {
            all.merge(std::mem::take(&mut *devices::sync::lock(&v.set)));
        }
        Ok(Profile {
            hz: session.hz,
            seconds,
            ticks: session.ticks.load(Ordering::Relaxed),
            vcpus: self.vcpus.len(),
            set: all,
        })
    }
}

/// Reads one sample: the chain (leaf first) and, for a kernel sample, how
/// its chain ended; `None` when the registers cannot be read.
fn take_sample(fd: &VcpuFd, mem: &GuestMemoryMmap) -> Option<(Vec<u64>, Option<ChainEnd>)> {
    let regs = fd.get_regs().ok()?;
    let sregs = fd.get_sregs().ok()?;
    if sregs.cs.selector & 3 == 3 {
        return Some((vec![USER_FRAME], None));
    }
    let paging = Paging {
        cr0: sregs.cr0,
        cr3: sregs.cr3,
        cr4: sregs.cr4,
        efer: sregs.efer,
    };
    if !paging.long_mode() {
        // Early boot, before 64-bit paging: the IP alone.
        return Some((vec![regs.rip], Some(ChainEnd::Complete)));
    }
    let (chain, end) = stack::kernel_chain(mem, &paging, regs.rip, regs.rbp, regs.rsp);
    Some((chain, Some(end)))
}

/// The samples of one profile, not yet symbolized.
pub struct Profile {
    pub hz: u32,
    pub seconds: f64,
    /// Sampler ticks (each asks every vCPU for a sample).
    pub ticks: u64,
    pub vcpus: usize,
    set: SampleSet,
}

/// What a finished profile says, for the API answer and the log.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub file: PathBuf,
    pub hz: u32,
    pub seconds: f64,
    pub samples: u64,
    pub user_samples: u64,
    pub kernel_samples: u64,
    pub failed_samples: u64,
    pub dropped_samples: u64,
    /// Kernel chains that ended at rbp 0 or user mode / at the depth
    /// limit / at a frame that could not be followed.
    pub chains_complete: u64,
    pub chains_depth_limit: u64,
    pub chains_bad_frame: u64,
    /// Mean time a vCPU thread spent taking one sample (register reads and
    /// the stack walk; the exit itself is not in it).
    pub sample_cost_us: f64,
    pub symbols: Option<PathBuf>,
    pub top: Vec<report::Row>,
}

impl Profile {
    /// Symbolizes the samples with `symbols` (an ELF vmlinux or a
    /// System.map; addresses stay hex without), writes the folded stacks to
    /// `file` and returns the summary with the table.
    pub fn write(self, file: &Path, symbols: Option<&Path>) -> Result<Summary, ProfileError> {
        let syms = symbols.map(Symbols::load).transpose()?;
        let stacks = report::symbolize(&self.set.stacks, syms.as_ref());
        let text = report::folded(&stacks);
        write_atomic(file, &text).map_err(|err| ProfileError::Write {
            path: file.to_path_buf(),
            err,
        })?;
        let s = &self.set;
        let samples = s.user + s.kernel;
        Ok(Summary {
            file: file.to_path_buf(),
            hz: self.hz,
            seconds: self.seconds,
            samples,
            user_samples: s.user,
            kernel_samples: s.kernel,
            failed_samples: s.failed,
            dropped_samples: s.dropped,
            chains_complete: s.ends[ChainEnd::Complete as usize],
            chains_depth_limit: s.ends[ChainEnd::Depth as usize],
            chains_bad_frame: s.ends[ChainEnd::BadFrame as usize],
            sample_cost_us: if samples + s.failed == 0 {
                0.0
            } else {
                s.cost_ns as f64 / 1000.0 / (samples + s.failed) as f64
            },
            symbols: symbols.map(Path::to_path_buf),
            top: report::table(&stacks, TOP),
        })
    }
}

impl Summary {
    /// The summary and table as text, for a terminal.
    pub fn text(&self) -> String {
        format!(
            "guest profile: {} samples in {:.1} s at {} Hz ({} user, {} kernel, {} unreadable, \
             {} dropped; {:.1} us per sample on the vCPU thread) -> {}\n{}",
            self.samples,
            self.seconds,
            self.hz,
            self.user_samples,
            self.kernel_samples,
            self.failed_samples,
            self.dropped_samples,
            self.sample_cost_us,
            self.file.display(),
            report::table_text(&self.top)
        )
    }
}

fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_checked() {
        assert!(check_hz(0).is_err());
        assert!(check_hz(MAX_HZ + 1).is_err());
        assert_eq!(check_hz(1000).unwrap(), 1000);
    }

    #[test]
    fn a_full_set_counts_drops_and_merges() {
        let mut a = SampleSet::default();
        for i in 0..(MAX_STACKS as u64 + 5) {
            a.add(vec![i + 1]);
        }
        assert_eq!((a.stacks.len(), a.dropped), (MAX_STACKS, 5));
        a.add(vec![1]);
        assert_eq!(a.stacks[&[1u64][..]], 2, "a known chain still counts");
        let mut b = SampleSet::default();
        b.add(vec![1]);
        b.user = 3;
        a.merge(b);
        assert_eq!((a.stacks[&[1u64][..]], a.user), (3, 3));
    }

    #[test]
    fn start_stop_without_vcpus_and_twice_is_refused() {
        let p = Arc::new(Profiler::new(Vec::new()));
        assert!(matches!(p.stop(), Err(ProfileError::NotRunning)));
        p.start(100).unwrap();
        assert!(matches!(p.start(100), Err(ProfileError::Running)));
        std::thread::sleep(Duration::from_millis(50));
        let prof = p.stop().unwrap();
        assert!(prof.ticks >= 1, "ticks {}", prof.ticks);
        assert!(!p.running());
        let file = std::env::temp_dir().join(format!("tandem-prof-{}", std::process::id()));
        let s = prof.write(&file, None).unwrap();
        assert_eq!(s.samples, 0);
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "");
        std::fs::remove_file(&file).unwrap();
    }
}

//! Post-copy at the destination: before the guest runs here, the pages
//! the source says are stale or absent are dropped and all of guest RAM is
//! registered with a userfaultfd ([`prepare`]); once it runs, a missing
//! page the guest (or a device) touches faults, is asked of the source at
//! once, and waits; the source's pages are placed as they come, asked for
//! or not, until the source says every one was sent ([`fetch`]).
//!
//! Runs on the incoming thread (the source's pages), with one scoped
//! `postcopy-faults` thread reading the faults and asking for their pages.
//! Everything read is hostile: spans and batches are checked against this
//! VM's layout; only a page still missing is placed. Never does: touch
//! guest memory from the faults thread (it would fault on itself), leave
//! guest RAM registered once every page is here, or place a page that is
//! not missing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use migration::protocol::colo::{self, Span};
use migration::protocol::postcopy::Stalls;
use migration::protocol::{self, Message, ProtocolError, PAGE_SIZE};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::super::MigrateError;
use crate::streams::endpoint::Conn;
use crate::vstate::uffd::Uffd;
use devices::GuestMemoryMmap;

/// How often the faults thread looks whether the fetch is over.
const FAULT_POLL: Duration = Duration::from_millis(50);
const PAGE: u64 = PAGE_SIZE;

/// One region of guest RAM: where it is in the guest and here, and the
/// index of its first page among all regions'.
#[derive(Clone, Copy)]
struct Region {
    gpa: u64,
    hva: u64,
    pages: u64,
    first: u64,
}

/// Which pages are still missing (a bit per page of guest RAM).
struct Missing {
    regions: Vec<Region>,
    bits: Vec<AtomicU64>,
    left: AtomicU64,
}

impl Missing {
    fn new(mem: &GuestMemoryMmap) -> Missing {
        let mut regions = Vec::new();
        let mut first = 0;
        for r in mem.iter() {
            let pages = r.len() / PAGE;
            regions.push(Region {
                gpa: r.start_addr().0,
                hva: r.as_ptr() as u64,
                pages,
                first,
            });
            first += pages;
        }
        let bits = (0..first.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        Missing {
            regions,
            bits,
            left: AtomicU64::new(0),
        }
    }

    /// The page at `gpa`: its index and its address here.
    fn at_gpa(&self, gpa: u64) -> Option<(u64, u64)> {
        self.regions
            .iter()
            .find(|r| gpa >= r.gpa && gpa < r.gpa + r.pages * PAGE)
            .map(|r| {
                let page = (gpa - r.gpa) / PAGE;
                (r.first + page, r.hva + page * PAGE)
            })
    }

    /// The guest address of the page at `hva` here.
    fn gpa_of(&self, hva: u64) -> Option<u64> {
        self.regions
            .iter()
            .find(|r| hva >= r.hva && hva < r.hva + r.pages * PAGE)
            .map(|r| r.gpa + (hva - r.hva) / PAGE * PAGE)
    }

    fn set(&self, index: u64) {
        let old = self.bits[(index / 64) as usize].fetch_or(1 << (index % 64), Ordering::SeqCst);
        if old & (1 << (index % 64)) == 0 {
            self.left.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn is_missing(&self, index: u64) -> bool {
        self.bits[(index / 64) as usize].load(Ordering::SeqCst) & (1 << (index % 64)) != 0
    }

    fn clear(&self, index: u64) {
        let old =
            self.bits[(index / 64) as usize].fetch_and(!(1 << (index % 64)), Ordering::SeqCst);
        if old & (1 << (index % 64)) != 0 {
            self.left.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn left(&self) -> u64 {
        self.left.load(Ordering::SeqCst)
    }
}

/// Guest RAM under a userfaultfd, and which of its pages are missing.
pub struct Fetch {
    uffd: Uffd,
    missing: Missing,
    layout: Vec<(u64, u64)>,
}

impl Fetch {
    /// Pages still missing.
    pub fn left(&self) -> u64 {
        self.missing.left()
    }
}

/// Before the guest runs here: the pages of `spans` (checked against
/// `layout`) are dropped (their copies here are stale) and every page of
/// guest RAM that is not here from now on faults into a userfaultfd.
pub fn prepare(
    mem: &GuestMemoryMmap,
    spans: &[Span],
    layout: &[(u64, u64)],
) -> Result<Fetch, MigrateError> {
    colo::check_spans(spans, layout)?;
    let uffd = Uffd::new().map_err(|e| {
        MigrateError::Join(format!(
            "this destination cannot take post-copy: userfaultfd: {e} (it needs root, or \
             vm.unprivileged_userfaultfd 1)"
        ))
    })?;
    let missing = Missing::new(mem);
    for s in spans {
        for i in 0..u64::from(s.pages) {
            let gpa = s.gpa + i * PAGE;
            let (index, _) = missing
                .at_gpa(gpa)
                .ok_or(ProtocolError::OutsideMemory { gpa, pages: 1 })?;
            missing.set(index);
        }
        let (_, hva) = missing.at_gpa(s.gpa).ok_or(ProtocolError::OutsideMemory {
            gpa: s.gpa,
            pages: s.pages,
        })?;
        let len = u64::from(s.pages) * PAGE;
        // SAFETY: `[hva, hva + len)` is guest RAM mapped by this process
        // (the span was checked against the layout, the address is its
        // region's); dropping it only makes its pages read as missing.
        let r =
            unsafe { libc::madvise(hva as *mut libc::c_void, len as usize, libc::MADV_DONTNEED) };
        if r < 0 {
            return Err(MigrateError::Stream(std::io::Error::last_os_error()));
        }
    }
    for r in &missing.regions {
        uffd.register(r.hva, r.pages * PAGE)
            .map_err(MigrateError::Stream)?;
    }
    Ok(Fetch {
        uffd,
        missing,
        layout: layout.to_vec(),
    })
}

/// What the two threads share: faults waiting, by page, and their waits.
struct Waits {
    since: Mutex<HashMap<u64, Instant>>,
    waited_us: Mutex<Vec<u64>>,
    faults: AtomicU64,
    requested: AtomicU64,
    background: AtomicU64,
}

/// With the guest running here: serves its faults and places the source's
/// pages from `main` until the source's `Commit` and every page is here;
/// then unregisters guest RAM and returns what the guest waited.
pub fn fetch(f: &Fetch, main: &mut Conn) -> Result<Stalls, MigrateError> {
    let mut asks = main.try_clone().map_err(MigrateError::Stream)?;
    let waits = Waits {
        since: Mutex::new(HashMap::new()),
        waited_us: Mutex::new(Vec::new()),
        faults: AtomicU64::new(0),
        requested: AtomicU64::new(0),
        background: AtomicU64::new(0),
    };
    let done = AtomicBool::new(false);
    let (placed, faults) = std::thread::scope(|s| {
        let faults = std::thread::Builder::new()
            .name("postcopy-faults".into())
            .spawn_scoped(s, || serve_faults(f, &mut asks, &waits, &done));
        let placed = place(f, main, &waits);
        // Every page here (or the source gone): no fault waits on one now.
        for r in &f.missing.regions {
            let _ = f.uffd.unregister(r.hva, r.pages * PAGE);
        }
        done.store(true, Ordering::SeqCst);
        let faults = match faults {
            Ok(h) => h
                .join()
                .unwrap_or_else(|_| Err(MigrateError::Join("the faults thread panicked".into()))),
            Err(e) => Err(MigrateError::Stream(e)),
        };
        (placed, faults)
    });
    placed?;
    faults?;
    Ok(stalls(&waits))
}

/// The faults thread: a missing page's fault asks the source for it (once);
/// any other page faults only because nothing was ever there: zeroes.
fn serve_faults(
    f: &Fetch,
    asks: &mut Conn,
    waits: &Waits,
    done: &AtomicBool,
) -> Result<(), MigrateError> {
    while !done.load(Ordering::SeqCst) {
        let Some(addr) = f.uffd.wait(FAULT_POLL).map_err(MigrateError::Stream)? else {
            continue;
        };
        let hva = addr & !(PAGE - 1);
        let Some(gpa) = f.missing.gpa_of(hva) else {
            continue;
        };
        let missing = f
            .missing
            .at_gpa(gpa)
            .is_some_and(|(index, _)| f.missing.is_missing(index));
        if !missing {
            // Placed since (the copy woke the waiter) or never here.
            f.uffd.zero(hva, PAGE).map_err(MigrateError::Stream)?;
            continue;
        }
        waits.faults.fetch_add(1, Ordering::SeqCst);
        let first = {
            let mut since = devices::sync::lock(&waits.since);
            let first = !since.contains_key(&gpa);
            since.entry(gpa).or_insert_with(Instant::now);
            first
        };
        if first {
            waits.requested.fetch_add(1, Ordering::SeqCst);
            protocol::write_message(asks, &Message::PageRequest(gpa))?;
        }
    }
    Ok(())
}

/// The incoming thread: the source's batches, each missing page placed
/// (waking its waiters), up to `Commit`.
fn place(f: &Fetch, main: &mut Conn, waits: &Waits) -> Result<(), MigrateError> {
    loop {
        match protocol::read_message(main)? {
            Message::Memory(batch) => {
                batch.check(&f.layout)?;
                for (r, data) in batch.iter() {
                    for i in 0..u64::from(r.pages) {
                        let gpa = r.gpa + i * PAGE;
                        let bytes =
                            data.map(|d| &d[(i * PAGE) as usize..((i + 1) * PAGE) as usize]);
                        place_page(f, gpa, bytes, waits)?;
                    }
                }
            }
            Message::Commit if f.left() == 0 => return Ok(()),
            Message::Commit => {
                return Err(MigrateError::Join(format!(
                    "the source says it sent every page; {} are not here",
                    f.left()
                )))
            }
            Message::Abandon(why) => return Err(ProtocolError::Abandoned(why).into()),
            other => {
                return Err(ProtocolError::Unexpected {
                    expected: "Memory or Commit",
                    got: other.command().name(),
                }
                .into())
            }
        }
    }
}

/// One page from the source (`None`: zero), placed if still missing.
fn place_page(
    f: &Fetch,
    gpa: u64,
    bytes: Option<&[u8]>,
    waits: &Waits,
) -> Result<(), MigrateError> {
    let Some((index, hva)) = f.missing.at_gpa(gpa) else {
        return Err(ProtocolError::OutsideMemory { gpa, pages: 1 }.into());
    };
    if !f.missing.is_missing(index) {
        return Ok(());
    }
    match bytes {
        Some(b) => f.uffd.copy(hva, b),
        None => f.uffd.zero(hva, PAGE),
    }
    .map_err(MigrateError::Stream)?;
    f.missing.clear(index);
    match devices::sync::lock(&waits.since).get(&gpa) {
        Some(t) => devices::sync::lock(&waits.waited_us).push(t.elapsed().as_micros() as u64),
        None => {
            waits.background.fetch_add(1, Ordering::SeqCst);
        }
    }
    Ok(())
}

/// The waits as `Done` carries them.
fn stalls(w: &Waits) -> Stalls {
    let mut us = devices::sync::lock(&w.waited_us).clone();
    us.sort_unstable();
    let at = |q: f64| {
        us.get(((us.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0)
    };
    Stalls {
        faults: w.faults.load(Ordering::SeqCst),
        requested: w.requested.load(Ordering::SeqCst),
        background: w.background.load(Ordering::SeqCst),
        p50_us: at(0.5),
        p99_us: at(0.99),
        max_us: us.last().copied().unwrap_or(0),
    }
}

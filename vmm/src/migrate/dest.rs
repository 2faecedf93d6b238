//! The incoming side of a migration (`tandem run --incoming ADDR`):
//! receives a guest into a VM that was built paused and has never run, and
//! runs it once the source hands it over.
//!
//! Runs on its own thread ("incoming"), started before the VMM thread's
//! loop. It checks the source's manifest against this VM's before any
//! memory moves, each memory batch against this VM's layout before it is
//! written, and the final state with the snapshot loader's checks before it
//! is applied. Any failure ends the process with one line and status 1
//! (nothing of the guest ran here). Never does: run the guest before `Go`,
//! or write or allocate beyond the memory this VM was started with.

use std::io::{Cursor, Read, Write};
use std::time::{Duration, Instant};

use migration::protocol::{self, Command, Message};
use vm_memory::{Bytes, GuestAddress};

use devices::GuestMemoryMmap;
use migration::Manifest;

use super::joined::{self, Alone, Joiner, Listening};
use super::postcopy;
use super::{MigrateError, Refusal};
use crate::boot::layout;
use crate::streams::endpoint::{Conn, Endpoint, Listener};
use crate::streams::transport::Transport;
use crate::vm::VmHandle;
use crate::vstate::exit::VmExit;
use crate::vstate::vm_state::VmState;

/// How long the destination waits for the next message once the source
/// is connected.
const IO_TIMEOUT: Duration = Duration::from_secs(60);

/// Binds `from` (so a bad address is a start-up error) and returns what
/// [`spawn`] waits on.
pub fn listen(from: &Endpoint, transport: &Transport) -> Result<Listener, MigrateError> {
    transport
        .listen(from)
        .map_err(|e| MigrateError::Listen(from.to_string(), e))
}

/// Starts the incoming thread: it accepts one source on `listener`,
/// receives the guest into `vm` and resumes it, or ends the VM with
/// [`VmExit::IncomingFailed`].
pub fn spawn(vm: VmHandle, listener: Listener, from: Endpoint) -> std::io::Result<()> {
    spawn_then(vm, listener, from, None)
}

/// What runs on the incoming thread once the guest runs here, with the
/// stream and the listener (a COLO secondary's loop, which takes its
/// network link there).
pub type Then = Box<dyn FnOnce(&VmHandle, Conn, &Listener) + Send>;

/// [`spawn`], then `then` (instead of the self-announce) when given. With
/// `then`, the guest is left paused: `then` resumes it (a COLO secondary
/// starts its dirty log first, so that no write of its guest goes
/// unseen).
pub fn spawn_then(
    vm: VmHandle,
    listener: Listener,
    from: Endpoint,
    then: Option<Then>,
) -> std::io::Result<()> {
    spawn_from(vm, listener, from, then, None)
}

/// A source let in with its VM's manifest read ([`accept`]), on the main
/// thread before this VM is built: a destination given no --mem or
/// --cpus takes the source's.
pub struct Accepted {
    conn: Conn,
    theirs: Manifest,
}

impl Accepted {
    /// The source's VM.
    pub fn manifest(&self) -> &Manifest {
        &self.theirs
    }

    /// Refuses the source, telling it why; returns the error for this side.
    pub fn refuse(
        mut self,
        why: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> MigrateError {
        refuse(&mut self.conn, Refusal::Here(why.into()))
    }
}

/// Waits on `listener` (bound to `from`) for the first source let in and
/// reads its handshake and its VM's manifest (nothing is allocated for it).
pub fn accept(listener: &Listener, from: &Endpoint) -> Result<Accepted, MigrateError> {
    eprintln!("tandem: waiting for a migration on {from}");
    accept_source(listener)
}

/// [`spawn_then`] with the source `accepted` already (by [`accept`]).
pub fn spawn_accepted(
    vm: VmHandle,
    listener: Listener,
    from: Endpoint,
    then: Option<Then>,
    accepted: Accepted,
) -> std::io::Result<()> {
    spawn_from(vm, listener, from, then, Some(accepted))
}

fn spawn_from(
    vm: VmHandle,
    listener: Listener,
    from: Endpoint,
    then: Option<Then>,
    accepted: Option<Accepted>,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("incoming".into())
        .spawn(move || {
            crate::sandbox::confine(crate::sandbox::Kind::Stream);
            if accepted.is_none() {
                eprintln!("tandem: waiting for a migration on {from}");
            }
            match receive(&vm, &listener, accepted, then.is_none()) {
                Ok((pages, conn, resumed_in)) => {
                    log::info!("migration from {from}: {pages} pages received; the guest is here");
                    if let Some(d) = resumed_in {
                        eprintln!(
                            "tandem: the guest came from {from} and runs here (resumed {:.3} ms \
                             after the source's go)",
                            d.as_secs_f64() * 1000.0
                        );
                    }
                    match then {
                        Some(then) => then(&vm, conn, &listener),
                        None => announce(&vm),
                    }
                }
                Err(e @ MigrateError::Lost { .. }) => vm
                    .exit()
                    .signal(VmExit::Lost(format!("incoming migration from {from}: {e}"))),
                Err(e) => vm
                    .exit()
                    .signal(VmExit::IncomingFailed(format!("incoming migration: {e}"))),
            }
        })
        .map(drop)
}

/// The first connection let in: one refused (no certificate the CA
/// signed, or from another address than the peer's) is said on stderr and
/// the wait goes on, so whoever reaches the port first cannot end it.
fn admit_source(listener: &Listener) -> Result<Conn, MigrateError> {
    loop {
        match listener.accept() {
            Ok(conn) => return Ok(conn),
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                eprintln!("tandem: incoming: {e}; still waiting");
            }
            Err(e) => return Err(MigrateError::Stream(e)),
        }
    }
}

/// The first source let in, its stream's timeouts set and its manifest read.
fn accept_source(listener: &Listener) -> Result<Accepted, MigrateError> {
    let mut conn = admit_source(listener)?;
    conn.set_timeouts(IO_TIMEOUT)
        .map_err(MigrateError::Stream)?;
    let theirs = receive_config(&mut conn)?;
    Ok(Accepted { conn, theirs })
}

/// The whole receive (from the source `accepted` already, else the first
/// let in), up to the guest running here (or ready to, paused, unless
/// `resume`); returns the pages written, the stream, and (when it resumed
/// the guest) how long that took after `Go` arrived: the part of the
/// downtime the source cannot see.
fn receive(
    vm: &VmHandle,
    listener: &Listener,
    accepted: Option<Accepted>,
    resume: bool,
) -> Result<(u64, Conn, Option<Duration>), MigrateError> {
    let Accepted { mut conn, theirs } = match accepted {
        Some(a) => a,
        None => accept_source(listener)?,
    };
    let mut joiner = Listening {
        listener,
        timeout: IO_TIMEOUT,
    };
    let (state, pages, spans) =
        receive_checked(&mut conn, &theirs, vm.manifest(), vm.memory(), &mut joiner)?;
    // The source released the disks' locks before it sent the state.
    if let Err(e) = vm.hold_disk_locks(true) {
        let _ = vm.hold_disk_locks(false);
        return Err(refuse(&mut conn, e.into()));
    }
    if let Err(e) = vm.apply_state(&state) {
        let _ = vm.hold_disk_locks(false);
        return Err(refuse(&mut conn, e.into()));
    }
    let fetch = match spans.map(|spans| prepare_postcopy(vm, &spans, resume)) {
        None => None,
        Some(Ok(f)) => Some(f),
        Some(Err(e)) => {
            let _ = vm.hold_disk_locks(false);
            return Err(refuse(&mut conn, Refusal::Here(Box::new(e))));
        }
    };
    protocol::write_message(&mut conn, &Message::Ready)?;
    protocol::expect(&mut conn, Command::Go)?;
    let go = Instant::now();
    if !resume {
        return Ok((pages, conn, None));
    }
    vm.resume()?;
    let resumed_in = go.elapsed();
    if let Some(f) = fetch {
        // Announced now, not once every page is here.
        let v = vm.clone();
        let _ = std::thread::Builder::new()
            .name("announce".into())
            .spawn(move || announce(&v));
        fetch_postcopy(&f, &mut conn)?;
    }
    Ok((pages, conn, Some(resumed_in)))
}

/// Before the guest runs here in post-copy: the pages of `spans` will be
/// fetched on demand (not into a COLO secondary, whose guest stays paused).
fn prepare_postcopy(
    vm: &VmHandle,
    spans: &[migration::protocol::colo::Span],
    resume: bool,
) -> Result<postcopy::fetch::Fetch, MigrateError> {
    if !resume {
        return Err(MigrateError::Join(
            "a COLO secondary takes no post-copy".into(),
        ));
    }
    let layout = layout::ram_ranges(vm.manifest().mem_bytes);
    postcopy::fetch::prepare(vm.memory(), spans, &layout)
}

/// With the guest running here: fetches its missing pages, tells the
/// source what the guest waited, and says so; a failure loses the guest.
fn fetch_postcopy(f: &postcopy::fetch::Fetch, conn: &mut Conn) -> Result<(), MigrateError> {
    let t = Instant::now();
    let missing = f.left();
    eprintln!(
        "tandem: post-copy: the guest runs here; {missing} of its pages are still at the source"
    );
    let lost = |e: MigrateError| MigrateError::Lost {
        missing: f.left(),
        source: Box::new(e),
    };
    let stalls = postcopy::fetch::fetch(f, conn).map_err(lost)?;
    protocol::write_message(conn, &Message::Done(stalls)).map_err(|e| lost(e.into()))?;
    let ms = |us: u64| us as f64 / 1000.0;
    eprintln!(
        "tandem: post-copy: all {missing} pages here after {:.0} ms; {} faults waited for the \
         link (p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms)",
        t.elapsed().as_secs_f64() * 1000.0,
        stalls.faults,
        ms(stalls.p50_us),
        ms(stalls.p99_us),
        ms(stalls.max_us)
    );
    Ok(())
}

/// The part of a receive that needs no KVM (what the fuzz target runs):
/// the handshake, the source's manifest checked against `ours`, every
/// memory batch checked against our layout and written into `mem`, and
/// the final state image checked as a snapshot restore checks it. Returns
/// the state to apply and the pages written.
pub fn receive_guest<S: Read + Write>(
    conn: &mut S,
    ours: &Manifest,
    mem: &GuestMemoryMmap,
) -> Result<(VmState, u64), MigrateError> {
    receive_guest_joined(conn, ours, mem, &mut Alone)
}

/// [`receive_guest`] of a source that may use several streams, which
/// `joiner` gives (what the multi-stream fuzz target runs).
pub fn receive_guest_joined<S: Read + Write, J: Joiner>(
    conn: &mut S,
    ours: &Manifest,
    mem: &GuestMemoryMmap,
    joiner: &mut J,
) -> Result<(VmState, u64), MigrateError> {
    let theirs = receive_config(conn)?;
    receive_checked(conn, &theirs, ours, mem, joiner).map(|(state, pages, _)| (state, pages))
}

/// The handshake and the source's manifest (its `Config`).
fn receive_config<S: Read + Write>(conn: &mut S) -> Result<Manifest, MigrateError> {
    let hello = protocol::read_message(conn)
        .map_err(|e| MigrateError::Refused(Refusal::NotMigration(e)))?;
    protocol::check_hello(&hello)?;
    let Message::Config(theirs) = protocol::expect(conn, Command::Config)? else {
        return Err(MigrateError::Refused(Refusal::NoConfig));
    };
    Ok(theirs)
}

/// [`receive_guest`] after the source's manifest `theirs` was read: the
/// other streams (if the source asks for them) from `joiner`. With
/// post-copy, also the pages still to fetch.
fn receive_checked<S: Read + Write, J: Joiner>(
    conn: &mut S,
    theirs: &Manifest,
    ours: &Manifest,
    mem: &GuestMemoryMmap,
    joiner: &mut J,
) -> Result<(VmState, u64, Option<Vec<migration::protocol::colo::Span>>), MigrateError> {
    if let Err(e) = migration::manifest::check_source(theirs, ours) {
        return Err(refuse(conn, e.into()));
    }
    protocol::write_message(conn, &Message::Accept)?;
    let layout = layout::ram_ranges(ours.mem_bytes);
    let (others, first) = match protocol::read_message(conn)? {
        Message::Streams(s) => match joiner.join(&s) {
            Ok(others) => (others, protocol::read_message(conn)?),
            Err(e) => {
                let _ = protocol::write_message(conn, &Message::Abandon(e.to_string()));
                return Err(e);
            }
        },
        m => (Vec::new(), m),
    };
    let got = joined::receive(conn, first, others, &layout, mem, IO_TIMEOUT)?;
    let checked =
        crate::snapshot::load_image_for(Cursor::new(got.image), "the migration stream", ours);
    match checked {
        Ok(r) => Ok((r.state, got.pages, got.postcopy)),
        Err(e) => Err(refuse(conn, e.into())),
    }
}

/// Tells the source why, and returns the error for this side.
fn refuse<S: Write>(conn: &mut S, why: Refusal) -> MigrateError {
    let _ = protocol::write_message(conn, &Message::Abandon(why.to_string()));
    MigrateError::Refused(why)
}

/// Writes one checked batch into guest memory; a zero range is written
/// only where memory is not zero already (a never-touched page stays
/// unbacked).
pub(crate) fn write_batch(
    mem: &GuestMemoryMmap,
    batch: &protocol::MemoryBatch,
) -> Result<u64, MigrateError> {
    let mut page = vec![0u8; protocol::PAGE_SIZE as usize];
    let zero = vec![0u8; protocol::PAGE_SIZE as usize];
    for (r, data) in batch.iter() {
        match data {
            Some(bytes) => mem
                .write_slice(bytes, GuestAddress(r.gpa))
                .map_err(|e| MigrateError::Write(r.gpa, e))?,
            None => {
                for i in 0..u64::from(r.pages) {
                    let gpa = GuestAddress(r.gpa + i * protocol::PAGE_SIZE);
                    mem.read_slice(&mut page, gpa)
                        .map_err(|e| MigrateError::Read(gpa.0, e))?;
                    if !migration::memory::is_zero(&page) {
                        mem.write_slice(&zero, gpa)
                            .map_err(|e| MigrateError::Write(gpa.0, e))?;
                    }
                }
            }
        }
    }
    Ok(batch.pages())
}

/// Self-announce rounds after the switch-over, as delays from the last
/// (QEMU's self-announce does the same, 5 rounds from 50 ms apart).
const ANNOUNCE: [Duration; 3] = [
    Duration::ZERO,
    Duration::from_millis(50),
    Duration::from_millis(150),
];

/// Each NIC announces the guest's MAC from here, so that a bridge or a
/// switch learns its new port before the guest next talks.
/// A NIC whose tap is down (the kernel refuses writes to it with EIO) is
/// said once, not warned about each round: nothing behind it can learn.
pub(crate) fn announce(vm: &VmHandle) {
    let mut down: std::collections::HashSet<String> = std::collections::HashSet::new();
    for delay in ANNOUNCE {
        std::thread::sleep(delay);
        for slot in vm.virtio().iter() {
            if down.contains(slot.id()) {
                continue;
            }
            match slot.announce() {
                Some(Err(e)) if e.raw_os_error() == Some(libc::EIO) => {
                    log::info!("{}: no self-announce: its tap is down", slot.id());
                    down.insert(slot.id().to_string());
                }
                Some(Err(e)) => log::warn!("{}: self-announce not sent: {e}", slot.id()),
                Some(Ok(_)) => log::debug!("{}: self-announce sent", slot.id()),
                None => {}
            }
        }
    }
}

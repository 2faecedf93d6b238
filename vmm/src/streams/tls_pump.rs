//! The TLS pump: one thread (named "tls") per TLS stream, moving bytes
//! between the caller's end of a `UnixStream` pair (plaintext) and the
//! TCP connection (TLS records), so the rest of the VMM keeps an ordinary
//! `Conn::Unix` it can use blocking or non-blocking and poll.
//!
//! Owns: the `TcpStream`, the rustls `Connection` (handshake already done)
//! and the pump's end of the pair, all non-blocking, driven by one
//! `libc::poll` loop.
//!
//! Bounds:
//! - memory: rustls holds at most [`TLS_QUEUE`] of ciphertext for the
//!   network (its buffer limit; no plaintext is taken from the caller
//!   while it is full) and 16 KiB of decrypted plaintext (rustls stops
//!   wanting to read the network until that is taken); the pump holds at
//!   most one [`CHUNK`] each way. Plaintext is never dropped while its
//!   reader is there: a partial write is kept and retried.
//! - time: poll wakes at least every [`TICK`]. The caller closing its end
//!   (EOF) sends `close_notify` and gives the network [`LINGER_NET`] to
//!   take what is queued; the network ending (EOF, error, bad record)
//!   shuts the caller's writes at once and gives the caller
//!   [`LINGER_CALLER`] to read what was already decrypted, then shuts its
//!   end both ways.
//!
//! Never does: panic on I/O, block outside poll, or outlive both ends.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rustls::Connection;

/// Ciphertext rustls may queue for the network: past it the pump stops
/// taking plaintext from the caller (rustls' buffer limit).
pub const TLS_QUEUE: usize = 1 << 20;
/// Plaintext moved by one read, either way.
const CHUNK: usize = 64 * 1024;
/// The longest poll wait, so deadlines are looked at.
const TICK: Duration = Duration::from_millis(500);
/// Once the caller has closed: how long queued records and `close_notify`
/// get to reach the network.
const LINGER_NET: Duration = Duration::from_secs(5);
/// Once the network has ended: how long the caller gets to read what was
/// already decrypted for it.
const LINGER_CALLER: Duration = Duration::from_secs(30);
/// Rounds of moving bytes between two polls (the rest waits one poll).
const ROUNDS: usize = 64;

/// Starts the pump for `tls` (its handshake done) over `tcp`, the caller
/// holding the other end of `far`.
pub fn spawn(tls: Connection, tcp: TcpStream, far: UnixStream) -> io::Result<()> {
    tcp.set_read_timeout(None)?;
    tcp.set_write_timeout(None)?;
    tcp.set_nonblocking(true)?;
    far.set_nonblocking(true)?;
    let pump = Pump::new(tls, tcp, far);
    std::thread::Builder::new()
        .name("tls".into())
        .spawn(move || {
            crate::sandbox::confine(crate::sandbox::Kind::Stream);
            pump.run()
        })
        .map(drop)
}

/// Bytes on their way, and where the next ones go.
struct Buf {
    data: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Buf {
    fn new() -> Buf {
        Buf {
            data: vec![0; CHUNK].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    fn pending(&self) -> &[u8] {
        self.data.get(self.start..self.end).unwrap_or_default()
    }

    fn is_empty(&self) -> bool {
        self.start >= self.end
    }

    fn consume(&mut self, n: usize) {
        self.start = self.start.saturating_add(n).min(self.end);
    }

    fn clear(&mut self) {
        self.start = 0;
        self.end = 0;
    }

    /// Refills the (empty) buffer from `r`.
    fn fill(&mut self, r: &mut dyn Read) -> io::Result<usize> {
        self.clear();
        let n = r.read(&mut self.data)?.min(self.data.len());
        self.end = n;
        Ok(n)
    }
}

struct Pump {
    tls: Connection,
    tcp: TcpStream,
    unix: UnixStream,
    /// Plaintext from the caller that rustls has not taken yet.
    up: Buf,
    /// Plaintext for the caller that its end has not taken yet.
    down: Buf,
    /// The network may still be read (no EOF or error yet).
    net_in: bool,
    /// The network may still be written (no error yet).
    net_out: bool,
    /// The caller may still send (no EOF yet).
    caller_in: bool,
    /// The caller may still receive (its end not closed).
    caller_out: bool,
    /// The peer's stream has ended and all of it was taken from rustls.
    peer_done: bool,
    close_sent: bool,
    /// The caller's end is closed both ways (poll said so).
    caller_hup: bool,
    /// When the pump stops, whatever is left.
    deadline: Option<Instant>,
    /// Bytes moved, to tell a round that did something.
    moved: u64,
    /// Why the peer's stream ended, for the log.
    why: String,
}

impl Pump {
    fn new(mut tls: Connection, tcp: TcpStream, unix: UnixStream) -> Pump {
        tls.set_buffer_limit(Some(TLS_QUEUE));
        Pump {
            tls,
            tcp,
            unix,
            up: Buf::new(),
            down: Buf::new(),
            net_in: true,
            net_out: true,
            caller_in: true,
            caller_out: true,
            peer_done: false,
            close_sent: false,
            caller_hup: false,
            deadline: None,
            moved: 0,
            why: String::new(),
        }
    }

    fn run(mut self) {
        // Records read with the handshake's last flight.
        if let Err(e) = self.tls.process_new_packets() {
            self.net_failed(format!("TLS: {e}"));
        }
        let why = loop {
            self.step();
            if let Some(why) = self.finished() {
                break why;
            }
            if let Err(e) = self.wait() {
                break format!("poll: {e}");
            }
        };
        self.close();
        log::debug!("tls: stream ended: {why}");
    }

    /// Moves what can be moved without blocking.
    fn step(&mut self) {
        for _ in 0..ROUNDS {
            let before = self.moved;
            self.read_net();
            self.deliver();
            self.take_plaintext();
            self.write_net();
            if self.moved == before {
                break;
            }
        }
    }

    /// Why the pump is done, if it is.
    fn finished(&self) -> Option<String> {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Some(format!("gave up closing ({})", self.why));
        }
        if self.peer_done {
            // Done once the caller has it all, or cannot read any more.
            let delivered = self.down.is_empty() || !self.caller_out || self.caller_hup;
            return delivered.then(|| format!("peer: {}", self.why));
        }
        let flushed = !self.tls.wants_write() || !self.net_out;
        (!self.caller_in && self.close_sent && flushed).then(|| "closed by this side".into())
    }

    /// Reads records from the network into rustls.
    fn read_net(&mut self) {
        while self.net_in && self.tls.wants_read() {
            match self.tls.read_tls(&mut self.tcp) {
                Ok(0) => {
                    self.net_in = false;
                    self.why = "EOF".into();
                }
                Ok(n) => self.count(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.net_failed(e.to_string());
                    return;
                }
            }
            if let Err(e) = self.tls.process_new_packets() {
                // The alert it queued, if the network takes it.
                let _ = self.tls.write_tls(&mut self.tcp);
                self.net_failed(format!("TLS: {e}"));
                return;
            }
        }
    }

    /// Moves decrypted plaintext to the caller's end.
    fn deliver(&mut self) {
        loop {
            if self.down.is_empty() {
                if self.peer_done {
                    return;
                }
                match self.down.fill(&mut self.tls.reader()) {
                    Ok(0) => return self.peer_ended("close_notify"),
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if !self.net_in {
                            self.peer_ended("no more records");
                        }
                        return;
                    }
                    Err(e) => return self.peer_ended(&e.to_string()),
                }
            }
            if !self.caller_out {
                // Nobody reads it any more.
                self.down.clear();
                continue;
            }
            match send(&self.unix, self.down.pending()) {
                Ok(0) => return,
                Ok(n) => {
                    self.down.consume(n);
                    self.count(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.caller_out = false;
                    self.linger(LINGER_NET);
                }
            }
        }
    }

    /// Takes plaintext from the caller's end while rustls has room.
    fn take_plaintext(&mut self) {
        loop {
            while !self.up.is_empty() {
                match self.tls.writer().write(self.up.pending()) {
                    Ok(0) => break,
                    Ok(n) => {
                        self.up.consume(n);
                        self.count(n);
                    }
                    Err(_) => {
                        self.up.clear();
                        self.caller_ended();
                    }
                }
            }
            if !self.up.is_empty() || !self.caller_in {
                break;
            }
            match self.up.fill(&mut self.unix) {
                Ok(0) => self.caller_ended(),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => self.caller_ended(),
            }
        }
        if !self.caller_in && self.up.is_empty() && !self.close_sent {
            self.tls.send_close_notify();
            self.close_sent = true;
        }
    }

    /// Writes queued records to the network.
    fn write_net(&mut self) {
        while self.net_out && self.tls.wants_write() {
            match self.tls.write_tls(&mut self.tcp) {
                Ok(0) => return,
                Ok(n) => self.count(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => self.net_failed(e.to_string()),
            }
        }
    }

    /// Waits in poll for what the next step can use, [`TICK`] at most.
    fn wait(&mut self) -> io::Result<()> {
        let mut net = 0;
        if self.net_in && self.tls.wants_read() {
            net |= libc::POLLIN;
        }
        if self.net_out && self.tls.wants_write() {
            net |= libc::POLLOUT;
        }
        let mut caller = 0;
        if self.caller_in && !self.caller_hup && self.up.is_empty() {
            caller |= libc::POLLIN;
        }
        if self.caller_out && !self.caller_hup && !self.down.is_empty() {
            caller |= libc::POLLOUT;
        }
        // A descriptor with nothing asked of it is left out (-1), so a
        // hang-up there cannot spin the loop.
        let entry = |fd: i32, events: i16| libc::pollfd {
            fd: if events == 0 { -1 } else { fd },
            events,
            revents: 0,
        };
        let mut fds = [
            entry(self.tcp.as_raw_fd(), net),
            entry(self.unix.as_raw_fd(), caller),
        ];
        let mut wait = TICK;
        if let Some(d) = self.deadline {
            wait = wait.min(d.saturating_duration_since(Instant::now()));
        }
        let ms = i32::try_from(wait.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: `fds` is a live, writable array of two `pollfd` for the
        // whole call and its length is passed with it; poll only writes
        // their `revents`.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::Interrupted => Ok(()),
                _ => Err(e),
            };
        }
        if fds[1].revents & (libc::POLLHUP | libc::POLLERR) != 0 {
            // Closed both ways: what it wrote is still read, without poll.
            self.caller_hup = true;
            self.linger(LINGER_NET);
        }
        Ok(())
    }

    fn count(&mut self, n: usize) {
        self.moved = self
            .moved
            .wrapping_add(u64::try_from(n).unwrap_or(u64::MAX));
    }

    /// Sets the deadline `d` from now, unless one comes sooner.
    fn linger(&mut self, d: Duration) {
        let end = Instant::now() + d;
        self.deadline = Some(self.deadline.map_or(end, |old| old.min(end)));
    }

    /// The network failed: nothing more is read or written there.
    fn net_failed(&mut self, why: String) {
        self.net_in = false;
        self.net_out = false;
        self.why = why;
    }

    /// All the peer sent has been taken from rustls: the caller's writes
    /// fail from now on, its reads get what is left, then EOF.
    fn peer_ended(&mut self, why: &str) {
        self.peer_done = true;
        if self.why.is_empty() {
            self.why = why.to_string();
        }
        let _ = self.unix.shutdown(Shutdown::Read);
        self.linger(LINGER_CALLER);
    }

    /// The caller will send nothing more: `close_notify` once rustls has
    /// taken the rest.
    fn caller_ended(&mut self) {
        self.caller_in = false;
        self.linger(LINGER_NET);
    }

    /// Last words: `close_notify` if not sent, then both ends shut.
    fn close(&mut self) {
        if self.net_out && !self.close_sent {
            self.tls.send_close_notify();
            let _ = self.tls.write_tls(&mut self.tcp);
        }
        let _ = self.tcp.shutdown(Shutdown::Both);
        let _ = self.unix.shutdown(Shutdown::Both);
    }
}

/// Writes to the caller's end without SIGPIPE (its end may be closed).
fn send(unix: &UnixStream, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a live slice of `buf.len()` readable bytes for the
    // call, and the descriptor is owned by `unix`, open for the call.
    let n = unsafe {
        libc::send(
            unix.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_pump_buffer_keeps_what_a_partial_write_left() {
        let mut b = Buf::new();
        let data: Vec<u8> = (0..100u8).collect();
        assert_eq!(b.fill(&mut data.as_slice()).expect("fill"), 100);
        b.consume(30);
        assert_eq!(b.pending(), &data[30..]);
        b.consume(60);
        assert_eq!(b.pending(), &data[90..]);
        assert!(!b.is_empty());
        b.consume(1000);
        assert!(b.is_empty() && b.pending().is_empty());
        // A reader that claims more than the buffer holds cannot overrun it.
        struct Liar;
        impl Read for Liar {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Ok(usize::MAX)
            }
        }
        assert_eq!(b.fill(&mut Liar).expect("fill"), CHUNK);
        assert_eq!(b.pending().len(), CHUNK);
    }
}

//! Where a migration or COLO stream goes: `tcp:HOST:PORT` or
//! `unix:PATH`, the connected stream either way ([`Conn`]), and the
//! listener that lets in one peer ([`Listener`]).
//!
//! Used by the migration thread and the COLO primary (connect), and the
//! incoming side and the COLO secondary (listen, accept). Everything runs
//! on the caller's thread, except that a TLS stream ([`super::tls`]) is
//! carried by its own pump thread and reaches the caller as a
//! [`Conn::Unix`], used like any other (blocking or not, polled).
//!
//! A listener serves one peer: the first connection it lets in (after its
//! handshake, with TLS) fixes the peer's IP address; a connection from
//! another is closed at once and refused with an error. With TLS, a peer
//! without a certificate the CA signed is refused before its first byte.
//!
//! Never does: retry a connection, pick an address the user did not give,
//! or decide by itself whether TLS is needed (that is the caller's, with
//! [`Endpoint::needs_tls`]).

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::tls::Tls;

/// A migration address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `tcp:HOST:PORT`.
    Tcp(String),
    /// `unix:PATH`.
    Unix(PathBuf),
}

/// An address that is not `tcp:HOST:PORT` or `unix:PATH` (as given).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadEndpoint {
    #[error("'{0}': expected tcp:HOST:PORT")]
    Tcp(String),
    #[error("'{0}': expected tcp:HOST:PORT or unix:PATH")]
    Other(String),
}

impl FromStr for Endpoint {
    type Err = BadEndpoint;

    fn from_str(s: &str) -> Result<Endpoint, BadEndpoint> {
        if let Some(addr) = s.strip_prefix("tcp:") {
            match addr.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                    Ok(Endpoint::Tcp(addr.to_string()))
                }
                _ => Err(BadEndpoint::Tcp(s.to_string())),
            }
        } else if let Some(path) = s.strip_prefix("unix:").filter(|p| !p.is_empty()) {
            Ok(Endpoint::Unix(PathBuf::from(path)))
        } else {
            Err(BadEndpoint::Other(s.to_string()))
        }
    }
}

/// In a `--config` file: the same string as on the command line.
impl<'de> serde::Deserialize<'de> for Endpoint {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Endpoint, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// A connected migration stream: a TLS one is `Unix`, to its pump.
#[derive(Debug)]
pub enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    /// Read and write timeouts: a peer that stops answering ends the
    /// migration instead of hanging it.
    pub fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
            Conn::Unix(s) => {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
        }
    }

    /// Non-blocking reads and writes (`WouldBlock`), or blocking again.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_nonblocking(on),
            Conn::Unix(s) => s.set_nonblocking(on),
        }
    }

    /// Its descriptor, for poll.
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        match self {
            Conn::Tcp(s) => s.as_raw_fd(),
            Conn::Unix(s) => s.as_raw_fd(),
        }
    }

    /// Whether a read would not block within `wait`: bytes, end of stream
    /// or an error are there.
    pub fn readable_within(&self, wait: Duration) -> io::Result<bool> {
        let mut p = libc::pollfd {
            fd: self.raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(wait.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd for the length given; the descriptor
        // is this stream's, open while `self` lives.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        match r {
            r if r < 0 => {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    Ok(false)
                } else {
                    Err(e)
                }
            }
            0 => Ok(false),
            _ => Ok(p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0),
        }
    }

    /// A second handle on the same stream (one thread reads while another
    /// writes).
    pub fn try_clone(&self) -> io::Result<Conn> {
        Ok(match self {
            Conn::Tcp(s) => Conn::Tcp(s.try_clone()?),
            Conn::Unix(s) => Conn::Unix(s.try_clone()?),
        })
    }

    /// Ends both directions (wakes a read blocked on the other side).
    pub fn shutdown(&self) {
        let _ = match self {
            Conn::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Conn::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.write(buf),
            Conn::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Endpoint {
    /// Connects, waiting at most `timeout` (TCP).
    pub fn connect(&self, timeout: Duration) -> io::Result<Conn> {
        self.connect_secure(timeout, None)
    }

    /// [`Endpoint::connect`], then with `tls` the handshake (at most
    /// `timeout` more): the peer's certificate must name this address's
    /// host. The stream is then a [`Conn::Unix`] to the TLS pump.
    pub fn connect_secure(&self, timeout: Duration, tls: Option<&Tls>) -> io::Result<Conn> {
        match (self, tls) {
            (Endpoint::Unix(_), Some(_)) => Err(not_for_unix()),
            (Endpoint::Unix(path), None) => UnixStream::connect(path).map(Conn::Unix),
            (Endpoint::Tcp(addr), tls) => {
                let tcp = connect_tcp(addr, timeout)?;
                match tls {
                    None => Ok(Conn::Tcp(tcp)),
                    Some(tls) => tls.connect(tcp, self.host(), timeout).map(Conn::Unix),
                }
            }
        }
    }

    /// Listens (a stale Unix socket file is replaced).
    pub fn listen(&self) -> io::Result<Listener> {
        self.listen_secure(None)
    }

    /// [`Endpoint::listen`]; with `tls`, every connection accepted must
    /// pass the handshake (a client certificate the CA signed).
    pub fn listen_secure(&self, tls: Option<Tls>) -> io::Result<Listener> {
        let socket = match (self, &tls) {
            (Endpoint::Unix(_), Some(_)) => return Err(not_for_unix()),
            (Endpoint::Tcp(addr), _) => Socket::Tcp(TcpListener::bind(addr.as_str())?),
            (Endpoint::Unix(path), None) => {
                if std::fs::symlink_metadata(path)
                    .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                {
                    std::fs::remove_file(path)?;
                }
                Socket::Unix(UnixListener::bind(path)?, path.clone())
            }
        };
        Ok(Listener {
            socket,
            tls,
            peer: OnceLock::new(),
        })
    }

    /// Whether the stream leaves this host: a `tcp:` address whose host
    /// is not loopback (127.0.0.0/8, ::1, localhost).
    pub fn needs_tls(&self) -> bool {
        match self {
            Endpoint::Unix(_) => false,
            Endpoint::Tcp(_) => {
                let host = self.host();
                let bare = host
                    .strip_prefix('[')
                    .and_then(|h| h.strip_suffix(']'))
                    .unwrap_or(host);
                !(bare.eq_ignore_ascii_case("localhost")
                    || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback()))
            }
        }
    }

    /// The host part of a `tcp:` address (as written, `[v6]` kept).
    fn host(&self) -> &str {
        match self {
            Endpoint::Tcp(addr) => addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h),
            Endpoint::Unix(_) => "",
        }
    }
}

fn not_for_unix() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "TLS is for tcp: addresses")
}

/// The first address of `addr` that answers within `timeout`.
fn connect_tcp(addr: &str, timeout: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    for a in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// How long [`Listener::accept`] gives a TLS handshake.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(10);
/// The least [`Listener::accept_within`] gives a handshake that starts
/// near its deadline.
const HANDSHAKE_MIN: Duration = Duration::from_secs(2);

/// A bound migration address, waiting for its one source: the first
/// connection accepted (after its handshake, with TLS) fixes the peer's
/// IP address, and a connection from any other is refused.
pub struct Listener {
    socket: Socket,
    tls: Option<Tls>,
    peer: OnceLock<IpAddr>,
}

enum Socket {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

/// A connection accepted, before it is let in.
enum Accepted {
    Tcp(TcpStream, SocketAddr),
    Unix(UnixStream),
}

impl Listener {
    /// Waits for the source to connect (with TLS: and to pass the
    /// handshake, within 10 s of connecting).
    pub fn accept(&self) -> io::Result<Conn> {
        let got = self.accept_raw()?;
        self.admit(got, HANDSHAKE_WAIT)
    }

    /// [`Listener::accept`], giving up after `timeout` (`TimedOut`); a
    /// TLS handshake gets what is left of it (2 s at least).
    pub fn accept_within(&self, timeout: Duration) -> io::Result<Conn> {
        let nonblocking = |on| match &self.socket {
            Socket::Tcp(l) => l.set_nonblocking(on),
            Socket::Unix(l, _) => l.set_nonblocking(on),
        };
        nonblocking(true)?;
        let end = Instant::now() + timeout;
        let got = loop {
            match self.accept_raw() {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() > end {
                        break Err(io::ErrorKind::TimedOut.into());
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                other => break other,
            }
        };
        nonblocking(false)?;
        let wait = end
            .saturating_duration_since(Instant::now())
            .max(HANDSHAKE_MIN);
        self.admit(got?, wait)
    }

    fn accept_raw(&self) -> io::Result<Accepted> {
        match &self.socket {
            Socket::Tcp(l) => l.accept().map(|(s, a)| Accepted::Tcp(s, a)),
            Socket::Unix(l, _) => l.accept().map(|(s, _)| Accepted::Unix(s)),
        }
    }

    /// Lets a connection in: from the one peer, through the handshake.
    fn admit(&self, got: Accepted, wait: Duration) -> io::Result<Conn> {
        let (tcp, from) = match got {
            Accepted::Unix(s) => {
                s.set_nonblocking(false)?;
                return Ok(Conn::Unix(s));
            }
            Accepted::Tcp(s, from) => (s, from),
        };
        let ip = from.ip().to_canonical();
        if let Some(&peer) = self.peer.get() {
            if peer != ip {
                let _ = tcp.shutdown(std::net::Shutdown::Both);
                return Err(other_peer(from, peer));
            }
        }
        tcp.set_nonblocking(false)?;
        tcp.set_nodelay(true)?;
        let conn = match &self.tls {
            None => Conn::Tcp(tcp),
            Some(tls) => Conn::Unix(tls.accept(tcp, wait).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("refused {from}: {e}"),
                )
            })?),
        };
        // Two accepts at once: the first to get here is the peer.
        let peer = *self.peer.get_or_init(|| ip);
        if peer != ip {
            conn.shutdown();
            return Err(other_peer(from, peer));
        }
        Ok(conn)
    }
}

fn other_peer(from: SocketAddr, peer: IpAddr) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("refused {from}: this listener's peer is {peer}"),
    )
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Socket::Unix(_, path) = &self.socket {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_or_say_what_is_expected() {
        assert_eq!(
            "tcp:127.0.0.1:4444".parse(),
            Ok(Endpoint::Tcp("127.0.0.1:4444".into()))
        );
        assert_eq!("unix:/tmp/m".parse(), Ok(Endpoint::Unix("/tmp/m".into())));
        for bad in [
            "tcp:host",
            "tcp::1",
            "tcp:h:99999",
            "unix:",
            "file:/x",
            "127.0.0.1:1",
        ] {
            assert!(bad.parse::<Endpoint>().is_err(), "{bad}");
        }
    }

    use crate::streams::tls::testing::Pki;
    use sha2::{Digest, Sha256};

    const WAIT: Duration = Duration::from_secs(5);

    /// A listener on a free loopback port, and the address to dial.
    fn listen(tls: Option<Tls>) -> (Listener, Endpoint) {
        let l = Endpoint::Tcp("127.0.0.1:0".into())
            .listen_secure(tls)
            .expect("listen");
        let Socket::Tcp(t) = &l.socket else {
            panic!("a tcp: listener");
        };
        let port = t.local_addr().expect("address").port();
        (l, Endpoint::Tcp(format!("127.0.0.1:{port}")))
    }

    /// `to.connect_secure` on another thread while `l` accepts:
    /// (accepted, connected).
    fn connect_accept(
        l: &Listener,
        to: &Endpoint,
        tls: Option<&Tls>,
    ) -> (io::Result<Conn>, io::Result<Conn>) {
        std::thread::scope(|s| {
            let c = s.spawn(|| to.connect_secure(WAIT, tls));
            let a = l.accept_within(WAIT);
            (a, c.join().expect("client thread"))
        })
    }

    /// A TLS stream over loopback: (server's end, client's end).
    fn tls_pair(pki: &Pki) -> (Listener, Conn, Conn) {
        let (l, to) = listen(Some(Pki::tls(&pki.server)));
        let (a, c) = connect_accept(&l, &to, Some(&Pki::tls(&pki.client)));
        let (a, c) = (a.expect("accept"), c.expect("connect"));
        a.set_timeouts(Duration::from_secs(60)).expect("timeouts");
        c.set_timeouts(Duration::from_secs(60)).expect("timeouts");
        (l, a, c)
    }

    /// Reads into `buf`: 0 at EOF, an error kind otherwise.
    fn read_some(c: &mut Conn, buf: &mut [u8]) -> Result<usize, io::ErrorKind> {
        c.read(buf).map_err(|e| e.kind())
    }

    /// `len` bytes no two seeds share.
    fn pattern(seed: u64, len: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()[0]
            })
            .collect()
    }

    const BIG: usize = 16 << 20;

    /// Sends `pattern(seed)` while reading `BIG` bytes; their SHA-256.
    fn exchange(mut conn: Conn, seed: u64) -> Vec<u8> {
        let Conn::Unix(s) = &conn else {
            panic!("a TLS stream is a Unix one");
        };
        let mut w = s.try_clone().expect("clone");
        let data = pattern(seed, BIG);
        std::thread::scope(|sc| {
            sc.spawn(move || w.write_all(&data).expect("send"));
            let mut hash = Sha256::new();
            let mut buf = vec![0; 100_000];
            let mut got = 0;
            while got < BIG {
                let n = conn.read(&mut buf).expect("receive");
                assert_ne!(n, 0, "EOF after {got} bytes");
                hash.update(&buf[..n]);
                got += n;
            }
            hash.finalize().to_vec()
        })
    }

    #[test]
    fn tls_carries_16_mib_each_way_at_once() {
        let pki = Pki::new();
        let (_l, a, c) = tls_pair(&pki);
        let t0 = Instant::now();
        let (at_server, at_client) = std::thread::scope(|s| {
            let server = s.spawn(|| exchange(a, 1));
            let client = s.spawn(|| exchange(c, 2));
            (server.join(), client.join())
        });
        eprintln!("16 MiB each way over TLS: {:?}", t0.elapsed());
        let sum = |seed| Sha256::digest(pattern(seed, BIG)).to_vec();
        assert_eq!(at_server.expect("server"), sum(2));
        assert_eq!(at_client.expect("client"), sum(1));
    }

    #[test]
    fn tls_buffers_a_bounded_amount_for_a_peer_that_does_not_read() {
        let pki = Pki::new();
        let (_l, mut a, mut c) = tls_pair(&pki);
        c.set_nonblocking(true).expect("non-blocking");
        let chunk = pattern(3, 64 << 10);
        let (mut sent, mut stalls) = (0, 0);
        // Written until the stream stays full (the pumps drain meanwhile).
        while stalls < 3 {
            match c.write(&chunk) {
                Ok(n) => (sent, stalls) = (sent + n, 0),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    stalls += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("after {sent} bytes: {e}"),
            }
            assert!(sent < 64 << 20, "{sent} bytes taken, none read");
        }
        let mut buf = vec![0; 1 << 20];
        let mut got = 0;
        while got < sent {
            got += a.read(&mut buf).expect("read");
        }
        assert_eq!(got, sent);
    }

    /// Waits until `c` is readable (or `WAIT`).
    fn poll_in(c: &Conn) -> bool {
        let mut fd = libc::pollfd {
            fd: c.raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd for the call, its count given.
        let n = unsafe { libc::poll(&mut fd, 1, 5000) };
        n == 1 && fd.revents & libc::POLLIN != 0
    }

    #[test]
    fn tls_conn_works_non_blocking_and_polled() {
        let pki = Pki::new();
        let (_l, mut a, mut c) = tls_pair(&pki);
        a.set_nonblocking(true).expect("non-blocking");
        let mut buf = [0; 16];
        assert_eq!(read_some(&mut a, &mut buf), Err(io::ErrorKind::WouldBlock));
        c.write_all(b"ping").expect("write");
        let mut got = Vec::new();
        while got.len() < 4 {
            assert!(poll_in(&a), "nothing to read after {got:?}");
            match read_some(&mut a, &mut buf) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(io::ErrorKind::WouldBlock) => {}
                Err(e) => panic!("{e:?}"),
            }
        }
        assert_eq!(got, b"ping");
        assert_eq!(read_some(&mut a, &mut buf), Err(io::ErrorKind::WouldBlock));
        assert_eq!(a.write(b"pong").expect("write"), 4);
        c.read_exact(&mut buf[..4]).expect("read");
        assert_eq!(&buf[..4], b"pong");
    }

    #[test]
    fn tls_refuses_a_client_the_ca_did_not_sign() {
        let pki = Pki::new();
        let (l, to) = listen(Some(Pki::tls(&pki.server)));
        let (a, c) = connect_accept(&l, &to, Some(&Pki::tls(&pki.rogue)));
        let e = a.expect_err("a client of another CA let in");
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
        assert!(e.to_string().contains("refused 127.0.0.1:"), "{e}");
        // TLS 1.3: the client may think it is in, and then reads EOF.
        if let Ok(mut c) = c {
            c.set_timeouts(WAIT).expect("timeouts");
            let _ = c.write_all(b"a VM of my choosing");
            assert!(!matches!(read_some(&mut c, &mut [0; 8]), Ok(1..)));
        }
        // It did not become the peer: the right one still gets in.
        let (a, c) = connect_accept(&l, &to, Some(&Pki::tls(&pki.client)));
        assert!(a.is_ok() && c.is_ok(), "{:?} {:?}", a.err(), c.err());
    }

    #[test]
    fn tls_client_refuses_a_server_the_ca_did_not_sign() {
        let pki = Pki::new();
        let (l, to) = listen(Some(Pki::tls(&pki.rogue)));
        let (a, c) = connect_accept(&l, &to, Some(&Pki::tls(&pki.client)));
        let e = c.expect_err("a server of another CA trusted");
        assert!(e.to_string().contains("127.0.0.1"), "{e}");
        assert!(a.is_err(), "the server got a stream");
    }

    #[test]
    fn tls_refuses_a_client_without_a_certificate() {
        use rustls::pki_types::{pem::PemObject, CertificateDer};
        let pki = Pki::new();
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&pki.client.ca).expect("CA file") {
            roots.add(cert.expect("CA")).expect("root");
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let (l, to) = listen(Some(Pki::tls(&pki.server)));
        let Endpoint::Tcp(addr) = &to else {
            panic!("tcp:");
        };
        let (a, sent) = std::thread::scope(|s| {
            let c = s.spawn(|| -> io::Result<()> {
                let mut tcp = TcpStream::connect(addr.as_str())?;
                tcp.set_read_timeout(Some(WAIT))?;
                let name = "127.0.0.1".try_into().expect("name");
                let mut tls =
                    rustls::ClientConnection::new(config.into(), name).map_err(io::Error::other)?;
                while tls.is_handshaking() {
                    tls.complete_io(&mut tcp)?;
                }
                tls.writer().write_all(b"a VM of my choosing")?;
                tls.complete_io(&mut tcp)?;
                tls.complete_io(&mut tcp).map(drop)
            });
            (l.accept_within(WAIT), c.join().expect("client thread"))
        });
        let e = a.expect_err("a client without a certificate let in");
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
        assert!(sent.is_err(), "the server took the client's bytes");
    }

    /// A TCP connection to `to` from `ip`.
    fn connect_from(ip: [u8; 4], to: &Endpoint) -> TcpStream {
        let Endpoint::Tcp(addr) = to else {
            panic!("tcp:");
        };
        let to: SocketAddr = addr.parse().expect("address");
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("socket");
        s.bind(&SocketAddr::from((ip, 0)).into()).expect("bind");
        s.connect_timeout(&to.into(), WAIT).expect("connect");
        s.into()
    }

    #[test]
    fn a_listener_takes_exactly_one_peer() {
        let pki = Pki::new();
        let client = Pki::tls(&pki.client);
        for tls in [None, Some(&client)] {
            let (l, to) = listen(tls.map(|_| Pki::tls(&pki.server)));
            let (a, c) = connect_accept(&l, &to, tls);
            assert!(a.is_ok() && c.is_ok(), "{:?} {:?}", a.err(), c.err());

            let (a, other) = std::thread::scope(|s| {
                let c = s.spawn(|| {
                    let tcp = connect_from([127, 0, 0, 2], &to);
                    match tls {
                        Some(t) => t.connect(tcp, "127.0.0.1", WAIT).map(Conn::Unix),
                        None => Ok(Conn::Tcp(tcp)),
                    }
                });
                (l.accept_within(WAIT), c.join().expect("client thread"))
            });
            let e = a.expect_err("a second peer let in");
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
            let msg = e.to_string();
            assert!(
                msg.contains("127.0.0.2:") && msg.contains("peer is 127.0.0.1"),
                "{msg}"
            );
            if let Ok(mut other) = other {
                other.set_timeouts(WAIT).expect("timeouts");
                assert!(!matches!(read_some(&mut other, &mut [0; 8]), Ok(1..)));
            }

            let (a, c) = connect_accept(&l, &to, tls);
            assert!(a.is_ok() && c.is_ok(), "{:?} {:?}", a.err(), c.err());
        }
    }

    #[test]
    fn only_remote_tcp_needs_tls() {
        for (addr, want) in [
            ("tcp:127.0.0.1:1", false),
            ("tcp:127.1.2.3:1", false),
            ("tcp:localhost:1", false),
            ("tcp:LocalHost:1", false),
            ("tcp:[::1]:1", false),
            ("tcp:::1:1", false),
            ("unix:/tmp/m", false),
            ("tcp:10.0.0.2:1", true),
            ("tcp:0.0.0.0:1", true),
            ("tcp:128.0.0.1:1", true),
            ("tcp:[fe80::1]:1", true),
            ("tcp:localhost.example:1", true),
        ] {
            let e: Endpoint = addr.parse().expect(addr);
            assert_eq!(e.needs_tls(), want, "{addr}");
        }
    }

    #[test]
    fn tls_is_refused_for_unix_addresses() {
        let pki = Pki::new();
        let tls = Pki::tls(&pki.client);
        let e = Endpoint::Unix(pki.dir.join("s"));
        let err = e.connect_secure(WAIT, Some(&tls)).expect_err("connect");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
        let Err(err) = e.listen_secure(Some(tls)) else {
            panic!("a unix: listener with TLS");
        };
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
    }

    #[test]
    fn tls_dropping_one_end_is_eof_at_the_other_within_a_second() {
        let pki = Pki::new();
        for drop_server in [false, true] {
            let (_l, a, c) = tls_pair(&pki);
            let (gone, mut kept) = if drop_server { (a, c) } else { (c, a) };
            kept.set_timeouts(WAIT).expect("timeouts");
            let t0 = Instant::now();
            drop(gone);
            assert_eq!(read_some(&mut kept, &mut [0; 8]), Ok(0));
            assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
            // Shut down (kept open): the same.
            let (_l, a, c) = tls_pair(&pki);
            let (gone, mut kept) = if drop_server { (a, c) } else { (c, a) };
            kept.set_timeouts(WAIT).expect("timeouts");
            gone.shutdown();
            assert_eq!(read_some(&mut kept, &mut [0; 8]), Ok(0));
            drop(gone);
        }
    }
}

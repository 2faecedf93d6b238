//! Where a migration stream goes: `tcp:HOST:PORT` or `unix:PATH`, and the
//! connected stream either way.
//!
//! Used by the migration thread (connect) and the incoming side (listen,
//! accept one). Never does: retry a connection, or pick an address the
//! user did not give.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

/// A migration address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `tcp:HOST:PORT`.
    Tcp(String),
    /// `unix:PATH`.
    Unix(PathBuf),
}

impl FromStr for Endpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Endpoint, String> {
        if let Some(addr) = s.strip_prefix("tcp:") {
            match addr.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                    Ok(Endpoint::Tcp(addr.to_string()))
                }
                _ => Err(format!("'{s}': expected tcp:HOST:PORT")),
            }
        } else if let Some(path) = s.strip_prefix("unix:").filter(|p| !p.is_empty()) {
            Ok(Endpoint::Unix(PathBuf::from(path)))
        } else {
            Err(format!("'{s}': expected tcp:HOST:PORT or unix:PATH"))
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

/// A connected migration stream.
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
        match self {
            Endpoint::Tcp(addr) => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
                for a in addr.to_socket_addrs()? {
                    match TcpStream::connect_timeout(&a, timeout) {
                        Ok(s) => {
                            s.set_nodelay(true)?;
                            return Ok(Conn::Tcp(s));
                        }
                        Err(e) => last = e,
                    }
                }
                Err(last)
            }
            Endpoint::Unix(path) => UnixStream::connect(path).map(Conn::Unix),
        }
    }

    /// Listens (a stale Unix socket file is replaced).
    pub fn listen(&self) -> io::Result<Listener> {
        match self {
            Endpoint::Tcp(addr) => TcpListener::bind(addr.as_str()).map(Listener::Tcp),
            Endpoint::Unix(path) => {
                if std::fs::symlink_metadata(path)
                    .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                {
                    std::fs::remove_file(path)?;
                }
                UnixListener::bind(path).map(|l| Listener::Unix(l, path.clone()))
            }
        }
    }
}

/// A bound migration address, waiting for its one source.
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    /// Waits for the source to connect.
    pub fn accept(&self) -> io::Result<Conn> {
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                s.set_nodelay(true)?;
                Ok(Conn::Tcp(s))
            }
            Listener::Unix(l, _) => l.accept().map(|(s, _)| Conn::Unix(s)),
        }
    }

    /// [`Listener::accept`], giving up after `timeout` (`TimedOut`).
    pub fn accept_within(&self, timeout: std::time::Duration) -> io::Result<Conn> {
        let nonblocking = |on| match self {
            Listener::Tcp(l) => l.set_nonblocking(on),
            Listener::Unix(l, _) => l.set_nonblocking(on),
        };
        nonblocking(true)?;
        let end = std::time::Instant::now() + timeout;
        let got = loop {
            match self.accept() {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if std::time::Instant::now() > end {
                        break Err(io::ErrorKind::TimedOut.into());
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                other => break other,
            }
        };
        nonblocking(false)?;
        let conn = got?;
        conn.set_nonblocking(false)?;
        Ok(conn)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
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
}

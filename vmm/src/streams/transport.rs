//! How this VMM's migration and COLO streams cross the network: its TLS
//! identity (`tandem run --tls-cert/--tls-key/--tls-ca`), or plain TCP,
//! and the rule that decides between them.
//!
//! The rule: with an identity, every `tcp:` stream this VMM opens or
//! accepts is TLS with a certificate on both ends (loopback included, so
//! one configuration serves tests and hosts alike); without one, a `tcp:`
//! address off this host (not 127.0.0.0/8, ::1 or localhost) is refused,
//! for listening and for connecting, unless `--insecure` was given. Unix
//! sockets never leave the host and are always plain.
//!
//! Owned by the VM (`VmHandle::transport`), set once at start; used on
//! whatever thread opens the stream (the migration thread, the COLO
//! primary, the incoming thread). Never does: fall back to plain TCP
//! after a failed handshake, or read the files again after start.

use std::io;
use std::time::Duration;

use super::endpoint::{Conn, Endpoint, Listener};
use super::tls::{Tls, TlsError, TlsFiles};

/// A plain stream to or from an address off this host, refused by
/// [`Transport::check`] (the address as the user gave it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0} is off this host and this VMM has no TLS identity: start tandem with \
     --tls-cert, --tls-key and --tls-ca (or --insecure for plain TCP)"
)]
pub struct PlainOffHost(pub String);

/// This VMM's streams' security, fixed at start.
#[derive(Clone, Debug, Default)]
pub struct Transport {
    tls: Option<Tls>,
    insecure: bool,
}

impl Transport {
    /// With `files`, loads them (a bad file is an error now, not at the
    /// first migration); `insecure` allows plain TCP off this host.
    pub fn new(files: Option<&TlsFiles>, insecure: bool) -> Result<Transport, TlsError> {
        Ok(Transport {
            tls: files.map(Tls::load).transpose()?,
            insecure,
        })
    }

    /// [`Transport::new`] from the configuration's data.
    pub fn from_config(c: &crate::config::StreamsConfig) -> Result<Transport, TlsError> {
        Transport::new(c.tls.as_ref(), c.insecure)
    }

    /// Whether streams over TCP are TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// What streams at `at` are (for reports): "tls", or "plain".
    pub fn name(&self, at: &Endpoint) -> &'static str {
        match at {
            Endpoint::Tcp(_) if self.is_tls() => "tls",
            _ => "plain",
        }
    }

    /// Refuses a plain stream to or from `at` off this host, unless
    /// `--insecure`; says what to give instead.
    pub fn check(&self, at: &Endpoint) -> Result<(), PlainOffHost> {
        if self.tls.is_some() || self.insecure || !at.needs_tls() {
            return Ok(());
        }
        Err(PlainOffHost(at.to_string()))
    }

    /// Connects to `to` (at most `timeout`, and as long again for the
    /// handshake), with TLS on a `tcp:` address when this VMM has it.
    pub fn connect(&self, to: &Endpoint, timeout: Duration) -> io::Result<Conn> {
        self.check(to)
            .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e))?;
        let tls = match to {
            Endpoint::Tcp(_) => self.tls.as_ref(),
            Endpoint::Unix(_) => None,
        };
        to.connect_secure(timeout, tls)
    }

    /// Listens on `at`, every connection there through the handshake when
    /// this VMM has TLS and `at` is `tcp:`.
    pub fn listen(&self, at: &Endpoint) -> io::Result<Listener> {
        self.check(at)
            .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e))?;
        let tls = match at {
            Endpoint::Tcp(_) => self.tls.clone(),
            Endpoint::Unix(_) => None,
        };
        at.listen_secure(tls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(s: &str) -> Endpoint {
        s.parse().unwrap()
    }

    #[test]
    fn plain_tcp_off_this_host_needs_insecure() {
        let plain = Transport::default();
        assert!(plain.check(&ep("tcp:127.0.0.1:4444")).is_ok());
        assert!(plain.check(&ep("tcp:localhost:4444")).is_ok());
        assert!(plain.check(&ep("unix:/tmp/x.sock")).is_ok());
        let e = plain.check(&ep("tcp:10.1.2.3:4444")).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("--tls-cert") && e.contains("--insecure"), "{e}");
        let err = plain
            .listen(&ep("tcp:0.0.0.0:0"))
            .err()
            .expect("a plain listener on every address is refused");
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        let insecure = Transport::new(None, true).unwrap();
        assert!(insecure.check(&ep("tcp:10.1.2.3:4444")).is_ok());
        assert_eq!(insecure.name(&ep("tcp:10.1.2.3:4444")), "plain");
    }

    #[test]
    fn missing_files_are_an_error_at_start() {
        let files = TlsFiles {
            cert: "/nonexistent/cert.pem".into(),
            key: "/nonexistent/key.pem".into(),
            ca: "/nonexistent/ca.pem".into(),
        };
        let e = Transport::new(Some(&files), false).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/cert.pem"), "{e}");
    }
}

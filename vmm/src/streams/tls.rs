//! Mutually authenticated TLS for the migration and COLO streams (rustls
//! with ring), as Cloud Hypervisor's migration does it: both ends present
//! a certificate and check the peer's against one CA file.
//!
//! Owns: the client and server configurations built from three PEM files
//! (certificate chain, private key, CA), the same files for both roles.
//! [`Tls::connect`] and [`Tls::accept`] run the handshake on the calling
//! thread, bounded by a timeout, so a peer without a certificate that the
//! CA signed is refused before the caller reads a byte; the session then
//! moves to its pump thread (`tls_pump`: bounds and shutdown there) and
//! the caller gets the local end of a `UnixStream` pair.
//!
//! Checks: the client checks that the server's certificate names the host
//! it dialled (an IP address or DNS SAN); the server takes any client
//! certificate the CA signed, so the CA should sign only this
//! deployment's hosts. TLS 1.3 is preferred, 1.2 accepted.
//!
//! Never does: accept a peer without a certificate, use the system's CA
//! store, or resume a session (each connection is a full handshake). With
//! TLS 1.3 the client's handshake ends before the server has checked the
//! client's certificate: a refusal reaches the client as EOF on its first
//! read.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::client::Resumption;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::{NoServerSessionStorage, VerifierBuilderError, WebPkiClientVerifier};
use rustls::{
    ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection,
};

use super::tls_pump;

pub use crate::config::TlsFiles;

/// Why the TLS files could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{}: no certificate in it", .0.display())]
    NoCertificate(PathBuf),
    #[error("{}: no private key in it", .0.display())]
    NoKey(PathBuf),
    #[error("{}: bad PEM: {source}", path.display())]
    Pem {
        path: PathBuf,
        #[source]
        source: pem::Error,
    },
    #[error("{}: a CA certificate that cannot be used: {source}", path.display())]
    Ca {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("checking client certificates: {0}")]
    Verifier(#[from] VerifierBuilderError),
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// A loaded TLS identity: cheap to clone (the configurations are shared).
#[derive(Clone, Debug)]
pub struct Tls {
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
}

impl Tls {
    /// Reads and checks the files, and builds both configurations.
    pub fn load(files: &TlsFiles) -> Result<Tls, TlsError> {
        let certs = certificates(&files.cert)?;
        let key = private_key(&files.key)?;
        let roots = Arc::new(roots(&files.ca)?);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone()).build()?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key.clone_key())?;
        server.session_storage = Arc::new(NoServerSessionStorage {});
        server.send_tls13_tickets = 0;
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)?;
        client.resumption = Resumption::disabled();
        Ok(Tls {
            client: Arc::new(client),
            server: Arc::new(server),
        })
    }

    /// Client side over a connected `tcp`: the handshake (at most
    /// `timeout`; the server's certificate must name `host`, an IP address
    /// or a DNS name, `[v6]` brackets allowed), then the pump. Returns the
    /// caller's end of the stream.
    pub fn connect(&self, tcp: TcpStream, host: &str, timeout: Duration) -> io::Result<UnixStream> {
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let name = ServerName::try_from(bare.to_string()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("'{host}' as a TLS server name: {e}"),
            )
        })?;
        let tls = ClientConnection::new(self.client.clone(), name).map_err(io::Error::other)?;
        start(tls.into(), tcp, timeout)
            .map_err(|e| io::Error::new(e.kind(), format!("TLS with {host}: {e}")))
    }

    /// Server side: the handshake, which needs a client certificate the
    /// CA signed (at most `timeout`), then the pump. Returns the caller's
    /// end of the stream.
    pub fn accept(&self, tcp: TcpStream, timeout: Duration) -> io::Result<UnixStream> {
        let tls = ServerConnection::new(self.server.clone()).map_err(io::Error::other)?;
        start(tls.into(), tcp, timeout)
    }
}

/// The handshake, then the pump on the far end of a new pair.
fn start(mut tls: Connection, tcp: TcpStream, timeout: Duration) -> io::Result<UnixStream> {
    handshake(&mut tls, &tcp, timeout)?;
    let (near, far) = UnixStream::pair()?;
    tls_pump::spawn(tls, tcp, far)?;
    Ok(near)
}

/// Runs the handshake to its end (and its last flight out), every read
/// and write bounded by what is left of `timeout`.
fn handshake(tls: &mut Connection, tcp: &TcpStream, timeout: Duration) -> io::Result<()> {
    tcp.set_nonblocking(false)?;
    let mut io = Bounded {
        tcp,
        end: Instant::now() + timeout,
    };
    while tls.is_handshaking() || tls.wants_write() {
        io.left()?;
        tls.complete_io(&mut io)?;
    }
    Ok(())
}

/// The TCP stream with a deadline: each read or write waits at most until
/// it, then fails `TimedOut`.
struct Bounded<'a> {
    tcp: &'a TcpStream,
    end: Instant,
}

impl Bounded<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the TLS handshake timed out",
            ))
        } else {
            Ok(left)
        }
    }

    /// A socket timeout (`WouldBlock`) is the deadline.
    fn timed_out(e: io::Error) -> io::Error {
        match e.kind() {
            io::ErrorKind::WouldBlock => {
                io::Error::new(io::ErrorKind::TimedOut, "the TLS handshake timed out")
            }
            _ => e,
        }
    }
}

impl Read for Bounded<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.tcp.set_read_timeout(Some(self.left()?))?;
        let mut tcp = self.tcp;
        tcp.read(buf).map_err(Bounded::timed_out)
    }
}

impl Write for Bounded<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tcp.set_write_timeout(Some(self.left()?))?;
        let mut tcp = self.tcp;
        tcp.write(buf).map_err(Bounded::timed_out)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Every certificate in a PEM file (at least one).
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            path: path.to_path_buf(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.to_path_buf()));
    }
    Ok(certs)
}

/// The first private key in a PEM file.
fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        pem::Error::NoItemsFound => TlsError::NoKey(path.to_path_buf()),
        source => TlsError::Pem {
            path: path.to_path_buf(),
            source,
        },
    })
}

/// The CA file's certificates as trust anchors.
fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in certificates(path)? {
        roots.add(cert).map_err(|source| TlsError::Ca {
            path: path.to_path_buf(),
            source,
        })?;
    }
    Ok(roots)
}

/// Certificates made on the fly for tests: a CA, a server and a client it
/// signed, and a "rogue" host signed by another CA.
#[cfg(test)]
pub(crate) mod testing {
    use super::{Tls, TlsFiles};
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair, KeyUsagePurpose,
    };
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The files, in a temporary directory removed on drop.
    pub(crate) struct Pki {
        pub dir: PathBuf,
        /// SANs 127.0.0.1 and localhost, signed by the CA.
        pub server: TlsFiles,
        /// Signed by the CA.
        pub client: TlsFiles,
        /// SAN 127.0.0.1, signed by another CA (trusts the right one).
        pub rogue: TlsFiles,
    }

    type Ca = CertifiedIssuer<'static, KeyPair>;

    fn authority(name: &str) -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        CertifiedIssuer::self_signed(p, KeyPair::generate().expect("CA key")).expect("CA")
    }

    /// A host certificate for both roles, its files in `dir`.
    fn host(dir: &Path, name: &str, sans: &[&str], by: &Ca, ca: &Path) -> TlsFiles {
        let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
        let mut p = CertificateParams::new(sans).expect("host params");
        p.distinguished_name.push(DnType::CommonName, name);
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().expect("host key");
        let cert = p.signed_by(&key, &**by).expect("host cert");
        let files = TlsFiles {
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
            ca: ca.to_path_buf(),
        };
        std::fs::write(&files.cert, cert.pem()).expect("write cert");
        std::fs::write(&files.key, key.serialize_pem()).expect("write key");
        files
    }

    impl Pki {
        pub(crate) fn new() -> Pki {
            static N: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "tandem-tls-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).expect("temp dir");
            let ca = authority("tandem test CA");
            let other = authority("another CA");
            let ca_file = dir.join("ca.pem");
            std::fs::write(&ca_file, ca.pem()).expect("write CA");
            Pki {
                server: host(&dir, "server", &["127.0.0.1", "localhost"], &ca, &ca_file),
                client: host(&dir, "client", &["client.test"], &ca, &ca_file),
                rogue: host(&dir, "rogue", &["127.0.0.1"], &other, &ca_file),
                dir,
            }
        }

        pub(crate) fn tls(files: &TlsFiles) -> Tls {
            Tls::load(files).expect("load TLS files")
        }
    }

    impl Drop for Pki {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::Pki;
    use super::*;
    use std::net::TcpListener;

    fn load_err(files: &TlsFiles) -> TlsError {
        match Tls::load(files) {
            Ok(_) => panic!("{files:?} loaded"),
            Err(e) => e,
        }
    }

    #[test]
    fn tls_load_errors_name_the_file() {
        let pki = Pki::new();
        let missing = pki.dir.join("nope.pem");
        let e = load_err(&TlsFiles {
            cert: missing.clone(),
            ..pki.server.clone()
        });
        assert!(
            matches!(&e, TlsError::Read { path, .. } if *path == missing),
            "{e}"
        );
        assert!(e.to_string().contains("nope.pem"), "{e}");

        // A certificate where the key should be.
        let e = load_err(&TlsFiles {
            key: pki.server.cert.clone(),
            ..pki.server.clone()
        });
        assert!(
            matches!(&e, TlsError::NoKey(p) if *p == pki.server.cert),
            "{e}"
        );

        let garbage = pki.dir.join("garbage.pem");
        let body = "-----BEGIN CERTIFICATE-----\n@@not base64@@\n-----END CERTIFICATE-----\n";
        std::fs::write(&garbage, body).expect("write");
        let e = load_err(&TlsFiles {
            ca: garbage.clone(),
            ..pki.server.clone()
        });
        assert!(
            matches!(&e, TlsError::Pem { path, .. } if *path == garbage),
            "{e}"
        );
        assert!(std::error::Error::source(&e).is_some(), "{e}");

        let text = pki.dir.join("text.pem");
        std::fs::write(&text, "hello\n").expect("write");
        let e = load_err(&TlsFiles {
            cert: text.clone(),
            ..pki.server.clone()
        });
        assert!(
            matches!(&e, TlsError::NoCertificate(p) if *p == text),
            "{e}"
        );

        // The client's certificate with the server's key.
        let e = load_err(&TlsFiles {
            cert: pki.client.cert.clone(),
            ..pki.server.clone()
        });
        assert!(matches!(e, TlsError::Config(_)), "{e}");

        assert!(Tls::load(&pki.server).is_ok());
    }

    /// A TLS connection over loopback, the client dialling `host`.
    fn pair(
        server: &Tls,
        client: &Tls,
        host: &str,
    ) -> (io::Result<UnixStream>, io::Result<UnixStream>) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let server = server.clone();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().expect("accept");
            server.accept(s, Duration::from_secs(5))
        });
        let tcp = TcpStream::connect(addr).expect("connect");
        let c = client.connect(tcp, host, Duration::from_secs(5));
        (t.join().expect("server thread"), c)
    }

    #[test]
    fn tls_server_certificate_must_name_the_host() {
        let pki = Pki::new();
        let (server, client) = (Pki::tls(&pki.server), Pki::tls(&pki.client));
        for ok in ["127.0.0.1", "localhost"] {
            let (s, c) = pair(&server, &client, ok);
            assert!(s.is_ok() && c.is_ok(), "{ok}: {:?} {:?}", s.err(), c.err());
        }
        let (_, c) = pair(&server, &client, "other.test");
        let e = c.expect_err("a certificate for another name");
        assert!(e.to_string().contains("other.test"), "{e}");
    }

    #[test]
    fn tls_handshake_is_bounded_by_its_timeout() {
        let pki = Pki::new();
        let client = Pki::tls(&pki.client);
        // A listener that never answers.
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let tcp = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let t0 = Instant::now();
        let e = client
            .connect(tcp, "127.0.0.1", Duration::from_millis(300))
            .expect_err("no server");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    }
}

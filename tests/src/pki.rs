//! Certificates for tests of TLS streams, made by `resources/tls-certs.sh`
//! (the openssl CLI, as docs/migration.md shows a user): a CA and a host
//! certificate it signs, in a scratch directory removed on drop.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::base::scratch;
use crate::repo_root;

/// A directory with ca.pem, host.pem and host.key.
pub struct Pki {
    pub dir: PathBuf,
}

impl Pki {
    /// A new CA, and a host certificate it signs naming `addrs`.
    pub fn new(tag: &str, addrs: &[&str]) -> Pki {
        Self::make(tag, None, addrs)
    }

    /// Another host certificate, naming `addrs`, signed by `ca`'s CA.
    pub fn signed_by(ca: &Pki, tag: &str, addrs: &[&str]) -> Pki {
        Self::make(tag, Some(&ca.dir), addrs)
    }

    fn make(tag: &str, ca: Option<&Path>, addrs: &[&str]) -> Pki {
        let dir = scratch(&format!("pki-{tag}"));
        let mut cmd = Command::new(repo_root().join("resources/tls-certs.sh"));
        cmd.arg(&dir);
        if let Some(ca) = ca {
            cmd.arg("--ca-from").arg(ca);
        }
        let out = cmd
            .args(addrs)
            .output()
            .expect("run resources/tls-certs.sh");
        assert!(
            out.status.success(),
            "tls-certs.sh: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Pki { dir }
    }

    /// A file of the directory.
    pub fn file(&self, name: &str) -> String {
        self.dir.join(name).to_string_lossy().into_owned()
    }

    /// `--tls-cert`, `--tls-key`, `--tls-ca` for `tandem run`.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.file("host.pem"),
            "--tls-key".into(),
            self.file("host.key"),
            "--tls-ca".into(),
            self.file("ca.pem"),
        ]
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

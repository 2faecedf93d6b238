//! The disks of a pair must start equal: each side hashes its images
//! (SHA-256, in device order) and the secondary compares the primary's
//! sums with its own before the pair is protected (`Disks` message).
//!
//! Runs on the primary's `colo` thread and the secondary's `incoming`
//! thread, reading the image files by their paths; never writes them.

use std::io::Read;

use migration::{DeviceConfig, Manifest};
use sha2::{Digest, Sha256};

use super::ColoError;

/// The SHA-256 of each disk image of `m`, in device order.
pub fn sums(m: &Manifest) -> Result<Vec<[u8; 32]>, ColoError> {
    m.devices
        .iter()
        .filter_map(|d| match d {
            DeviceConfig::Blk {
                pci: None, path, ..
            } => Some(path),
            _ => None,
        })
        .map(|path| sum(path).map_err(ColoError::io(format!("hashing {path}"))))
        .collect()
}

fn sum(path: &str) -> std::io::Result<[u8; 32]> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().into())
}

/// Why `theirs` (the primary's) and `ours` differ, if they do.
pub fn differ(theirs: &[[u8; 32]], ours: &[[u8; 32]], m: &Manifest) -> Option<String> {
    if theirs.len() != ours.len() {
        return Some(format!(
            "the primary has {} disks, this VM {}",
            theirs.len(),
            ours.len()
        ));
    }
    let ids: Vec<&str> = m
        .devices
        .iter()
        .filter(|d| matches!(d, DeviceConfig::Blk { pci: None, .. }))
        .map(DeviceConfig::id)
        .collect();
    let bad: Vec<&str> = theirs
        .iter()
        .zip(ours)
        .zip(&ids)
        .filter(|((a, b), _)| a != b)
        .map(|(_, id)| *id)
        .collect();
    (!bad.is_empty()).then(|| {
        format!(
            "disk {} is not the primary's image (its SHA-256 differs): give the \
             secondary a copy of the primary's image as it is at colo-start",
            bad.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_images_pass_and_a_changed_byte_is_named() {
        let dir = std::env::temp_dir().join(format!("tandem-disks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.img"), dir.join("b.img"));
        std::fs::write(&a, vec![1u8; 3 << 20]).unwrap();
        std::fs::write(&b, vec![1u8; 3 << 20]).unwrap();
        let m = |p: &std::path::Path| Manifest {
            tandem_version: "t".into(),
            mem_bytes: 1 << 20,
            vcpus: 1,
            firmware: None,
            devices: vec![DeviceConfig::Blk {
                pci: None,
                id: "blk0".into(),
                path: p.display().to_string(),
                readonly: false,
                bytes: 3 << 20,
                serial: "s".into(),
                slot: migration::manifest::MmioSlot { base: 0, irq: 5 },
            }],
        };
        let (ma, mb) = (m(&a), m(&b));
        let (sa, sb) = (sums(&ma).unwrap(), sums(&mb).unwrap());
        assert_eq!(differ(&sa, &sb, &mb), None);
        let mut bytes = vec![1u8; 3 << 20];
        bytes[2 << 20] = 0;
        std::fs::write(&b, bytes).unwrap();
        let why = differ(&sa, &sums(&mb).unwrap(), &mb).unwrap();
        assert!(why.contains("disk blk0"), "{why}");
        assert!(differ(&sa, &[], &mb).is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! A kernel for the firmware to boot (`--firmware F --kernel K`): the
//! bzImage, initrd and command line read from the host's files and split
//! as QEMU's `-kernel` does for its firmware (the real-mode setup, then the
//! rest), for fw_cfg to offer ([`devices::fw_cfg::KernelBlobs`]). OVMF's
//! kernel loader reads them and boots the kernel, through its EFI stub if
//! it has one, else by the legacy boot protocol.
//!
//! Runs once on the main thread while the VM is built. The files are user
//! input: a missing file or one that is not a bzImage is a one-line
//! error, never a panic.

use std::path::{Path, PathBuf};

use devices::fw_cfg::KernelBlobs;

/// Where a bzImage's setup header says how many 512-byte setup sectors
/// follow the boot sector, and where it has its "HdrS" magic.
const SETUP_SECTS: usize = 0x1f1;
const HEADER_MAGIC: usize = 0x202;

/// Why the kernel cannot be offered.
#[derive(Debug, thiserror::Error)]
pub enum FwKernelError {
    #[error("--kernel {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "--kernel {path}: with --firmware the kernel must be a bzImage (the firmware loads it); \
         this file has no Linux boot header"
    )]
    NotBzImage { path: PathBuf },
}

/// The blobs for `kernel`, `initrd` and `cmdline`.
pub fn blobs(
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &str,
) -> Result<KernelBlobs, FwKernelError> {
    let read = |p: &Path| {
        std::fs::read(p).map_err(|source| FwKernelError::Read {
            path: p.to_path_buf(),
            source,
        })
    };
    let image = read(kernel)?;
    let (setup, rest) = split(&image).ok_or_else(|| FwKernelError::NotBzImage {
        path: kernel.to_path_buf(),
    })?;
    Ok(KernelBlobs {
        setup: setup.to_vec(),
        kernel: rest.to_vec(),
        initrd: initrd.map(read).transpose()?.unwrap_or_default(),
        cmdline: cmdline.as_bytes().to_vec(),
    })
}

/// Splits a bzImage after its setup: the boot sector and `setup_sects`
/// sectors (4 when the header says 0, as the boot protocol has it). None
/// if `image` has no boot header or is shorter than its setup.
pub fn split(image: &[u8]) -> Option<(&[u8], &[u8])> {
    if image.get(HEADER_MAGIC..HEADER_MAGIC + 4)? != b"HdrS" {
        return None;
    }
    let sects = match *image.get(SETUP_SECTS)? {
        0 => 4,
        n => usize::from(n),
    };
    let setup = (sects + 1) * 512;
    (setup < image.len()).then(|| image.split_at(setup))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bzimage(sects: u8, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        b[SETUP_SECTS] = sects;
        b[HEADER_MAGIC..HEADER_MAGIC + 4].copy_from_slice(b"HdrS");
        b
    }

    #[test]
    fn splits_after_the_setup_sectors() {
        let b = bzimage(0x1f, 40_000);
        let (setup, rest) = split(&b).unwrap();
        assert_eq!((setup.len(), rest.len()), (0x20 * 512, 40_000 - 0x20 * 512));
        // 0 setup sectors means 4.
        let b = bzimage(0, 10_000);
        assert_eq!(split(&b).unwrap().0.len(), 5 * 512);
        // Not a bzImage, or cut short.
        assert!(split(b"\x7fELF").is_none());
        assert!(split(&vec![0u8; 4096]).is_none());
        assert!(split(&bzimage(0x40, 4096)).is_none());
    }

    #[test]
    fn files_are_read_and_errors_name_them() {
        let dir = std::env::temp_dir().join(format!("tandem-fwk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let k = dir.join("bzImage");
        std::fs::write(&k, bzimage(1, 3000)).unwrap();
        let i = dir.join("initrd");
        std::fs::write(&i, b"cpio").unwrap();
        let b = blobs(&k, Some(&i), "console=ttyS0").unwrap();
        assert_eq!((b.setup.len(), b.kernel.len()), (1024, 3000 - 1024));
        assert_eq!(
            (b.initrd.as_slice(), b.cmdline.as_slice()),
            (&b"cpio"[..], &b"console=ttyS0"[..])
        );
        let e = blobs(&i, None, "").unwrap_err().to_string();
        assert!(e.contains("must be a bzImage"), "{e}");
        let e = blobs(&dir.join("nope"), None, "").unwrap_err().to_string();
        assert!(e.contains("nope"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

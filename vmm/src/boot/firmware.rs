//! Firmware boot (`--firmware`): a BIOS or UEFI image (e.g. Debian's
//! `OVMF.fd`) mapped read-only at the top of the 4 GiB space, where an x86
//! CPU fetches its first instruction after reset (0xFFFF_FFF0, the image's
//! last 16 bytes). The boot vCPU is left in the reset state KVM gives a new
//! vCPU (real mode, CS base 0xFFFF_0000, IP 0xFFF0), so the firmware runs
//! from its reset vector as on a real machine.
//!
//! The image is copied into an anonymous mapping that KVM sees as a
//! read-only slot (`KVM_MEM_READONLY`): the guest reads and executes it;
//! a write to it is an MMIO exit that no device claims (counted, ignored),
//! as a write to a flash chip without its command sequence would be.
//!
//! The image is not part of a saved state: a snapshot or a migration
//! records its size and SHA-256 in the manifest ([`Firmware::id`]), and a
//! restore or an incoming migration is given the same image again.
//!
//! Runs once on the main thread while the VM is built, before any vCPU
//! runs. The file is user input: a missing, empty, misaligned or oversized
//! image is a one-line error, never a panic. It never maps guest RAM.

use std::path::{Path, PathBuf};

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_READONLY};
use kvm_ioctls::VmFd;
use migration::FirmwareId;
use sha2::{Digest, Sha256};
use vm_memory::mmap::MmapRegion;
use vm_memory::VolatileMemory;

use super::layout::{APIC_ADDR, MMIO_GAP_END};

/// The largest image: 16 MiB, from 0xFF00_0000 up (QEMU's pflash limit for
/// OVMF too), clear of the local APIC page and KVM's TSS below it.
pub const MAX_FIRMWARE: u64 = 16 << 20;
/// An image is whole pages (KVM maps pages; OVMF images are 1, 2 or 4 MiB).
const PAGE: u64 = 4096;
/// The KVM memory slot of the image (guest RAM uses the first few).
pub const FIRMWARE_SLOT: u32 = 64;

/// Why a firmware image cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FirmwareError {
    #[error("--firmware {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--firmware {path} is empty")]
    Empty { path: PathBuf },
    #[error(
        "--firmware {path} is {size} bytes: an image is whole 4 KiB pages (OVMF.fd is 2 or 4 MiB)"
    )]
    Misaligned { path: PathBuf, size: u64 },
    #[error("--firmware {path} is {size} bytes, more than the {max} MiB below 4 GiB a firmware may take", max = MAX_FIRMWARE >> 20)]
    TooBig { path: PathBuf, size: u64 },
    #[error("cannot map the firmware: {0}")]
    Map(#[source] vm_memory::mmap::MmapRegionError),
    #[error("KVM refuses the firmware's read-only memory: {0}")]
    Register(#[source] kvm_ioctls::Error),
}

/// A firmware image mapped into a VM. Keep it as long as the VM: KVM reads
/// the guest's flash from this mapping.
pub struct Firmware {
    region: MmapRegion,
    gpa: u64,
    path: PathBuf,
    id: FirmwareId,
}

impl std::fmt::Debug for Firmware {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Firmware")
            .field("path", &self.path)
            .field("gpa", &format_args!("{:#x}", self.gpa))
            .field("bytes", &self.region.size())
            .finish()
    }
}

impl Firmware {
    /// Where the image starts in guest-physical memory.
    pub fn gpa(&self) -> u64 {
        self.gpa
    }

    /// The image's size in bytes.
    pub fn bytes(&self) -> u64 {
        self.region.size() as u64
    }

    /// The file it came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What the VM's manifest records of it (size and SHA-256).
    pub fn id(&self) -> &FirmwareId {
        &self.id
    }

    /// Copies the image's bytes at guest address `gpa` into `buf` (the
    /// vCPU's look at an instruction KVM could not emulate, when it is in
    /// the firmware); false if that range is not all inside the image.
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> bool {
        let Some(offset) = gpa.checked_sub(self.gpa) else {
            return false;
        };
        let Ok(offset) = usize::try_from(offset) else {
            return false;
        };
        match self.region.get_slice(offset, buf.len()) {
            Ok(s) => s.copy_to(buf) == buf.len(),
            Err(_) => false,
        }
    }
}

/// Where an image of `size` bytes goes: its end at 4 GiB. Checks the size.
pub fn placement(path: &Path, size: u64) -> Result<u64, FirmwareError> {
    let path = path.to_path_buf();
    if size == 0 {
        return Err(FirmwareError::Empty { path });
    }
    if size > MAX_FIRMWARE {
        return Err(FirmwareError::TooBig { path, size });
    }
    if !size.is_multiple_of(PAGE) {
        return Err(FirmwareError::Misaligned { path, size });
    }
    let gpa = MMIO_GAP_END - size;
    debug_assert!(gpa > u64::from(APIC_ADDR));
    Ok(gpa)
}

/// Reads the image at `path`, checked, and where it goes.
fn read_image(path: &Path) -> Result<(Vec<u8>, u64), FirmwareError> {
    let read = |source| FirmwareError::Read {
        path: path.to_path_buf(),
        source,
    };
    // The size first: a huge file is refused before it is read.
    let size = std::fs::metadata(path).map_err(read)?.len();
    placement(path, size)?;
    let image = std::fs::read(path).map_err(read)?;
    // The file may have changed between the two looks.
    let gpa = placement(path, image.len() as u64)?;
    Ok((image, gpa))
}

/// What a VM booted from `image` (read from `path`) records of it.
fn identity(path: &Path, image: &[u8]) -> FirmwareId {
    FirmwareId {
        path: path.display().to_string(),
        bytes: image.len() as u64,
        sha256: migration::hex::encode(&Sha256::digest(image)),
    }
}

/// Which image `path` is (`--firmware` given to a restore or an incoming
/// migration, to be checked against the saved VM's before anything is
/// built), with the checks [`load`] makes.
pub fn identify(path: &Path) -> Result<FirmwareId, FirmwareError> {
    let (image, _) = read_image(path)?;
    Ok(identity(path, &image))
}

/// Reads the image at `path` and maps it read-only into `vm` so that it
/// ends at 4 GiB.
pub fn load(vm: &VmFd, path: &Path) -> Result<Firmware, FirmwareError> {
    let (image, gpa) = read_image(path)?;
    let id = identity(path, &image);
    let region = MmapRegion::new(image.len()).map_err(FirmwareError::Map)?;
    // SAFETY: `region` is a fresh private mapping of exactly `image.len()`
    // bytes that nothing else references yet.
    unsafe { std::ptr::copy_nonoverlapping(image.as_ptr(), region.as_ptr(), image.len()) };
    let r = kvm_userspace_memory_region {
        slot: FIRMWARE_SLOT,
        flags: KVM_MEM_READONLY,
        guest_phys_addr: gpa,
        memory_size: image.len() as u64,
        userspace_addr: region.as_ptr() as u64,
    };
    // SAFETY: the range is `region`'s live mapping, which the returned
    // `Firmware` owns and the VM keeps as long as it runs; no other slot
    // aliases it, and KVM only reads it (a read-only slot).
    unsafe { vm.set_user_memory_region(r) }.map_err(FirmwareError::Register)?;
    log::info!(
        "firmware {}: {} KiB at {gpa:#x}",
        path.display(),
        image.len() >> 10
    );
    Ok(Firmware {
        region,
        gpa,
        path: path.to_path_buf(),
        id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_ends_at_4_gib_and_bad_sizes_are_refused() {
        let p = Path::new("fw.fd");
        assert_eq!(placement(p, 2 << 20).unwrap(), 0xffe0_0000);
        assert_eq!(placement(p, 4096).unwrap(), 0xffff_f000);
        assert_eq!(placement(p, MAX_FIRMWARE).unwrap(), 0xff00_0000);
        assert!(matches!(placement(p, 0), Err(FirmwareError::Empty { .. })));
        assert!(matches!(
            placement(p, 4097),
            Err(FirmwareError::Misaligned { .. })
        ));
        assert!(matches!(
            placement(p, MAX_FIRMWARE + PAGE),
            Err(FirmwareError::TooBig { .. })
        ));
        let e = placement(p, 100).unwrap_err().to_string();
        assert!(e.contains("fw.fd") && e.contains("100 bytes"), "{e}");
    }

    #[test]
    fn an_image_maps_read_only_into_a_vm() {
        let kvm = match kvm_ioctls::Kvm::new() {
            Ok(k) => k,
            Err(e) => panic!("/dev/kvm is needed for this test: {e}"),
        };
        let vm = kvm.create_vm().unwrap();
        let dir = std::env::temp_dir().join(format!("tandem-fw-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("fw.fd");
        let mut image = vec![0u8; 64 << 10];
        image[(64 << 10) - 16] = 0xea;
        std::fs::write(&path, &image).unwrap();
        let fw = load(&vm, &path).unwrap();
        assert_eq!(fw.gpa(), 0xffff_0000);
        assert_eq!(fw.bytes(), 64 << 10);
        assert_eq!(fw.id(), &identify(&path).unwrap());
        assert_eq!(fw.id().bytes, 64 << 10);
        assert_eq!(fw.id().sha256.len(), 64);
        std::fs::write(dir.join("other.fd"), vec![0u8; 64 << 10]).unwrap();
        assert_ne!(
            identify(&dir.join("other.fd")).unwrap().sha256,
            fw.id().sha256
        );
        // SAFETY: the mapping is `fw`'s and lives until the end of the test.
        let last = unsafe { *fw.region.as_ptr().add((64 << 10) - 16) };
        assert_eq!(last, 0xea);
        let mut b = [0u8; 2];
        assert!(fw.read(0xffff_fff0, &mut b));
        assert_eq!(b, [0xea, 0]);
        assert!(!fw.read(0xffff_ffff, &mut b), "past 4 GiB");
        assert!(!fw.read(0xfffe_ffff, &mut b), "below the image");
        assert!(matches!(
            load(&vm, &dir.join("absent.fd")),
            Err(FirmwareError::Read { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

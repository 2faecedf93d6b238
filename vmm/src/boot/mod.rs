//! Linux boot on x86_64: loads an ELF vmlinux or a bzImage (linux-loader),
//! the initrd and the command line, and writes boot_params and the MP table.
//! Runs once, before any vCPU starts; every input here is user-controlled and
//! fails with a clear error, never a panic.

pub mod acpi;
pub mod cpu;
pub mod firmware;
pub mod fw_kernel;
pub mod layout;
pub mod mptable;

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use devices::GuestMemoryMmap;
use linux_loader::cmdline::Cmdline;
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::{self, BzImage, Elf, KernelLoader};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use layout::*;

/// Errors from preparing the guest for boot.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot open kernel {path}: {err}")]
    KernelOpen { path: PathBuf, err: std::io::Error },
    #[error("kernel {path} is neither an ELF vmlinux nor a bzImage")]
    KernelFormat { path: PathBuf },
    #[error("cannot load kernel {path}: {err}")]
    KernelLoad { path: PathBuf, err: loader::Error },
    #[error("cannot open initrd {path}: {err}")]
    InitrdOpen { path: PathBuf, err: std::io::Error },
    #[error("initrd {path} ({size} bytes) does not fit in guest memory below {limit:#x} above the kernel")]
    InitrdTooBig {
        path: PathBuf,
        size: u64,
        limit: u64,
    },
    #[error("initrd {path} is not an initramfs (no cpio or compressed-cpio signature)")]
    InitrdFormat { path: PathBuf },
    #[error("initrd {path} is empty")]
    InitrdEmpty { path: PathBuf },
    #[error("cannot read initrd {path}: {source}")]
    InitrdRead {
        path: PathBuf,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("kernel command line is {len} bytes; the boot protocol allows at most {max}")]
    CmdlineTooLong { len: usize, max: usize },
    #[error("invalid kernel command line: {0}")]
    Cmdline(#[source] linux_loader::cmdline::Error),
    #[error("cannot write the kernel command line: {0}")]
    CmdlineLoad(#[source] loader::Error),
    #[error("cannot write boot data to guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    #[error(transparent)]
    Mptable(#[from] mptable::MptableError),
    #[error(transparent)]
    Acpi(#[from] acpi::AcpiError),
    #[error("cannot read random bytes for the guest's RNG seed: {0}")]
    RngSeed(std::io::Error),
}

/// What the vCPUs need from a loaded kernel.
#[derive(Debug, Clone, Copy)]
pub struct BootInfo {
    /// Guest-physical address of the 64-bit entry point.
    pub entry: u64,
    /// Whether the kernel was a bzImage (else an ELF vmlinux).
    pub bzimage: bool,
}

/// What to boot.
pub struct BootSpec<'a> {
    pub kernel: &'a Path,
    pub initrd: Option<&'a Path>,
    pub cmdline: &'a str,
    pub num_cpus: u8,
    /// Whether to describe the machine with ACPI tables (a PCI machine).
    pub acpi: bool,
}

const ELF_MAGIC: [u8; 4] = [0x7f, b'E', b'L', b'F'];
const BZIMAGE_ENTRY_OFFSET: u64 = 0x200;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448;
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;
const DEFAULT_INITRD_ADDR_MAX: u64 = 0x7fff_ffff;
const E820_RAM: u32 = 1;
const E820_RESERVED: u32 = 2;
/// `setup_data` type of a random seed for the guest's RNG (Linux 5.20+).
const SETUP_RNG_SEED: u32 = 9;
/// Bytes of seed: 256 bits, what Linux needs to call its RNG initialized.
const RNG_SEED_LEN: usize = 32;

/// Loads everything into `mem` and returns where to start.
pub fn load(mem: &GuestMemoryMmap, spec: &BootSpec) -> Result<BootInfo, BootError> {
    let (result, bzimage) = load_kernel(mem, spec.kernel)?;
    let mut params = boot_params::default();
    if let Some(hdr) = result.setup_header {
        params.hdr = hdr;
    }
    let cmdline_max = if bzimage && params.hdr.cmdline_size > 0 {
        params.hdr.cmdline_size as usize + 1
    } else {
        CMDLINE_MAX_SIZE
    }
    .min(CMDLINE_MAX_SIZE);
    let cmdline = build_cmdline(spec.cmdline, cmdline_max)?;
    loader::load_cmdline(mem, GuestAddress(CMDLINE_START), &cmdline)
        .map_err(BootError::CmdlineLoad)?;

    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = spec.cmdline.len() as u32;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;

    if let Some(initrd) = spec.initrd {
        let addr_max = if bzimage && params.hdr.initrd_addr_max != 0 {
            u64::from(params.hdr.initrd_addr_max)
        } else {
            DEFAULT_INITRD_ADDR_MAX
        };
        let (addr, size) = load_initrd(mem, initrd, result.kernel_end, addr_max)?;
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
    }
    write_e820(&mut params, mem, spec.acpi);
    params.hdr.setup_data = write_rng_seed(mem)?;
    if spec.acpi {
        params.acpi_rsdp_addr = acpi::write(mem, spec.num_cpus)?;
    }
    mem.write_obj(params, GuestAddress(ZERO_PAGE_START))?;
    // Also on an ACPI machine: a guest booted with `acpi=off` reads it.
    mptable::write(mem, spec.num_cpus)?;

    let entry = if bzimage {
        result.kernel_load.raw_value() + BZIMAGE_ENTRY_OFFSET
    } else {
        result.kernel_load.raw_value()
    };
    Ok(BootInfo { entry, bzimage })
}

/// Loads the kernel (an ELF vmlinux or a bzImage, told apart by its first
/// bytes); returns what the loader found and whether it is a bzImage.
fn load_kernel(
    mem: &GuestMemoryMmap,
    path: &Path,
) -> Result<(loader::KernelLoaderResult, bool), BootError> {
    let kpath = path.to_path_buf();
    let open_err = |err| BootError::KernelOpen {
        path: kpath.clone(),
        err,
    };
    let mut kernel = File::open(path).map_err(open_err)?;
    let mut magic = [0u8; 4];
    let is_elf = kernel.read_exact(&mut magic).is_ok() && magic == ELF_MAGIC;
    kernel.seek(SeekFrom::Start(0)).map_err(open_err)?;
    let start = Some(GuestAddress(HIMEM_START));
    if is_elf {
        let r = Elf::load(mem, None, &mut kernel, start).map_err(|err| BootError::KernelLoad {
            path: kpath.clone(),
            err,
        })?;
        return Ok((r, false));
    }
    let r = BzImage::load(mem, None, &mut kernel, start).map_err(|err| match err {
        loader::Error::Bzimage(
            loader::bzimage::Error::InvalidBzImage
            | loader::bzimage::Error::ReadBzImageHeader
            | loader::bzimage::Error::Underflow,
        ) => BootError::KernelFormat {
            path: kpath.clone(),
        },
        err => BootError::KernelLoad {
            path: kpath.clone(),
            err,
        },
    })?;
    Ok((r, true))
}

/// The e820 map: low RAM below the EBDA, the EBDA and legacy hole
/// reserved, then guest RAM from 1 MiB on. With ACPI, also the tables'
/// area and ECAM, reserved (Linux uses ECAM only where the firmware
/// reserved it).
fn write_e820(params: &mut boot_params, mem: &GuestMemoryMmap, acpi: bool) {
    let mut e820 = vec![
        (0, EBDA_START, E820_RAM),
        (EBDA_START, 0xa_0000 - EBDA_START, E820_RESERVED),
    ];
    if acpi {
        e820.push((ACPI_START, ACPI_END - ACPI_START, E820_RESERVED));
    }
    for (base, size) in ram_ranges(mem.iter().map(|r| r.len()).sum()) {
        let start = base.max(HIMEM_START);
        if base + size > start {
            e820.push((start, base + size - start, E820_RAM));
        }
    }
    if acpi {
        e820.push((PCI_ECAM_START, devices::pci::ECAM_BUS_BYTES, E820_RESERVED));
    }
    for (i, (addr, size, type_)) in e820.iter().enumerate() {
        params.e820_table[i] = boot_e820_entry {
            addr: *addr,
            size: *size,
            r#type: *type_,
        };
    }
    params.e820_entries = e820.len() as u8;
}

/// Writes a `setup_data` entry with 32 bytes from the host's RNG and
/// returns its address. Linux mixes it into its RNG early at boot and, when
/// it trusts the boot loader (`CONFIG_RANDOM_TRUST_BOOTLOADER`, or
/// `random.trust_bootloader=on`), counts its RNG initialized at once: no
/// boot-time wait for entropy (on this host, a `getrandom()` early in user
/// space otherwise spins the kernel's jitter-entropy loop for seconds under
/// emulation). QEMU passes the same seed.
fn write_rng_seed(mem: &GuestMemoryMmap) -> Result<u64, BootError> {
    let mut seed = [0u8; RNG_SEED_LEN];
    let mut got = 0;
    while got < seed.len() {
        // SAFETY: the buffer is valid for writes of the length given.
        let n = unsafe { libc::getrandom(seed[got..].as_mut_ptr().cast(), seed.len() - got, 0) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(BootError::RngSeed(err));
            }
            continue;
        }
        got += n as usize;
    }
    // struct setup_data { u64 next; u32 type; u32 len; u8 data[]; }
    let mut entry = Vec::with_capacity(16 + RNG_SEED_LEN);
    entry.extend_from_slice(&0u64.to_le_bytes());
    entry.extend_from_slice(&SETUP_RNG_SEED.to_le_bytes());
    entry.extend_from_slice(&(RNG_SEED_LEN as u32).to_le_bytes());
    entry.extend_from_slice(&seed);
    mem.write_slice(&entry, GuestAddress(SETUP_DATA_START))?;
    Ok(SETUP_DATA_START)
}

fn build_cmdline(s: &str, max: usize) -> Result<Cmdline, BootError> {
    if s.len() + 1 > max {
        return Err(BootError::CmdlineTooLong {
            len: s.len(),
            max: max - 1,
        });
    }
    let mut c = Cmdline::new(max).map_err(BootError::Cmdline)?;
    if !s.trim().is_empty() {
        c.insert_str(s).map_err(BootError::Cmdline)?;
    }
    Ok(c)
}

/// Whether `head` starts like something Linux unpacks as an initramfs: a
/// cpio archive (newc, crc, odc) or one compressed in a format Linux knows.
pub fn is_initramfs(head: &[u8]) -> bool {
    const MAGICS: [&[u8]; 10] = [
        b"070701",                             // cpio newc
        b"070702",                             // cpio newc with CRC
        b"070707",                             // cpio odc
        &[0x1f, 0x8b],                         // gzip
        b"BZh",                                // bzip2
        &[0x5d, 0x00, 0x00],                   // lzma
        &[0xfd, b'7', b'z', b'X', b'Z', 0x00], // xz
        &[0x89, b'L', b'Z', b'O'],             // lzo
        &[0x02, 0x21, 0x4c, 0x18],             // lz4 (legacy frame)
        &[0x28, 0xb5, 0x2f, 0xfd],             // zstd
    ];
    MAGICS.iter().any(|m| head.starts_with(m))
}

/// Places the initrd page-aligned as high as possible below `addr_max` and
/// the end of low RAM, above the kernel.
fn load_initrd(
    mem: &GuestMemoryMmap,
    path: &Path,
    kernel_end: u64,
    addr_max: u64,
) -> Result<(u64, u64), BootError> {
    let p = path.to_path_buf();
    let mut f = File::open(path).map_err(|err| BootError::InitrdOpen {
        path: p.clone(),
        err,
    })?;
    let size = f
        .metadata()
        .map_err(|err| BootError::InitrdOpen {
            path: p.clone(),
            err,
        })?
        .len();
    if size == 0 {
        return Err(BootError::InitrdEmpty { path: p });
    }
    let mut head = [0u8; 6];
    let got = f.read(&mut head).map_err(|e| BootError::InitrdRead {
        path: p.clone(),
        source: e.into(),
    })?;
    if !is_initramfs(&head[..got]) {
        return Err(BootError::InitrdFormat { path: p });
    }
    f.seek(SeekFrom::Start(0))
        .map_err(|e| BootError::InitrdRead {
            path: p.clone(),
            source: e.into(),
        })?;
    let low_end = mem
        .iter()
        .map(|r| r.start_addr().raw_value() + r.len())
        .filter(|&end| end <= MMIO_GAP_START)
        .max()
        .unwrap_or(0);
    let limit = low_end.min(addr_max + 1);
    let too_big = || BootError::InitrdTooBig {
        path: p.clone(),
        size,
        limit,
    };
    let addr = limit.checked_sub(size).ok_or_else(too_big)? & !0xfff;
    if addr < kernel_end.max(HIMEM_START) {
        return Err(too_big());
    }
    let len = usize::try_from(size).map_err(|_| too_big())?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut f, len)
        .map_err(|e| BootError::InitrdRead {
            path: p.clone(),
            source: e.into(),
        })?;
    Ok((addr, size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initramfs_signatures() {
        assert!(is_initramfs(b"070701000000"));
        assert!(is_initramfs(&[0x1f, 0x8b, 8, 0]));
        assert!(!is_initramfs(b"ZZZZZZ"));
        assert!(!is_initramfs(b""));
        assert!(!is_initramfs(b"0707"));
    }

    #[test]
    fn cmdline_limit_is_the_boot_protocol_one() {
        assert!(build_cmdline(&"a".repeat(CMDLINE_MAX_SIZE - 1), CMDLINE_MAX_SIZE).is_ok());
        assert!(matches!(
            build_cmdline(&"a".repeat(CMDLINE_MAX_SIZE), CMDLINE_MAX_SIZE),
            Err(BootError::CmdlineTooLong {
                len: 2048,
                max: 2047
            })
        ));
        assert!(build_cmdline("", CMDLINE_MAX_SIZE).is_ok());
    }
}

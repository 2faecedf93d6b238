//! Fixtures built once per fuzzing process (a disk image, a tap, a small
//! guest memory) and the virtio-mmio devices built on them for each input.
//!
//! A net device runs on a [`NullBackend`] (virtio-net's `NetBackend` seam):
//! the register targets never carry traffic, and a real tap would cost
//! ~17 ms and root per process.

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use devices::virtio::block::device::BlockState;
use devices::virtio::block::disk::DiskFile;
use devices::virtio::block::{Block, BlockConfig};
use devices::virtio::mmio::{Interrupt, MmioTransport};
use devices::virtio::net::backend::NetBackend;
use devices::virtio::net::device::NetState;
use devices::virtio::net::{Net, NetConfig};
use devices::virtio::pci::{Hooks, PciTransport};
use devices::virtio::VirtioDevice;
use devices::GuestMemoryMmap;
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Size of the small guest memory of the register targets.
pub const SMALL_MEM: u64 = 0x10000;
/// Size of the disk image.
pub const DISK_BYTES: u64 = 0x10000;

/// 64 KiB of guest memory, shared by every input (devices on it never run
/// their handlers, so nothing writes it).
pub fn small_memory() -> &'static GuestMemoryMmap {
    static MEM: OnceLock<GuestMemoryMmap> = OnceLock::new();
    MEM.get_or_init(|| {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), SMALL_MEM as usize)])
            .expect("64 KiB of guest memory")
    })
}

/// A 64 KiB disk image (an unlinked temporary file).
fn disk_file() -> &'static File {
    static DISK: OnceLock<File> = OnceLock::new();
    DISK.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("tandem-fuzz-{}.img", std::process::id()));
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("create the disk image");
        std::fs::remove_file(&path).expect("unlink the disk image");
        file.set_len(DISK_BYTES).expect("size the disk image");
        file
    })
}

/// The process's tap, `tfz<pid>` (it goes away with the process).
/// A backend with nothing to receive that takes every frame sent.
pub struct NullBackend(EventFd);

impl NullBackend {
    pub fn new() -> NullBackend {
        NullBackend(eventfd())
    }
}

impl Default for NullBackend {
    fn default() -> Self {
        NullBackend::new()
    }
}

impl NetBackend for NullBackend {
    fn name(&self) -> &str {
        "fuzz0"
    }

    fn read_frame(&mut self, _buf: &mut [u8]) -> std::io::Result<usize> {
        Err(std::io::ErrorKind::WouldBlock.into())
    }

    fn write_frame(&mut self, frame: &[u8]) -> std::io::Result<usize> {
        Ok(frame.len())
    }

    fn rx_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    fn tx_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    fn set_offload(&mut self, _flags: u32) -> std::io::Result<()> {
        Ok(())
    }
}

fn eventfd() -> EventFd {
    EventFd::new(EFD_NONBLOCK).expect("an eventfd")
}

/// A transport in front of `device` on `mem`, with one notify eventfd per
/// queue.
fn transport(device: Box<dyn VirtioDevice>, mem: &GuestMemoryMmap) -> MmioTransport {
    let interrupt = Arc::new(Interrupt::new(eventfd()));
    let evts = device.queue_max_sizes().iter().map(|_| eventfd()).collect();
    MmioTransport::new(device, mem.clone(), interrupt, evts).expect("a transport")
}

/// A transport in front of a fresh virtio-blk device on the disk image, and
/// the device's state (whether it runs).
pub fn block(
    mem: &GuestMemoryMmap,
    id: &str,
    readonly: bool,
) -> (MmioTransport, Arc<Mutex<BlockState>>) {
    let file = disk_file().try_clone().expect("dup the disk image");
    let disk = DiskFile::from_file(file, "fuzz.img".as_ref(), readonly).expect("the disk image");
    let block = Block::new(BlockConfig::with_id(id), disk, eventfd());
    let state = block.state();
    (transport(Box::new(block), mem), state)
}

/// A virtio-pci function in front of a fresh virtio-blk device on the
/// disk image (MSI-X: a vector for its queue and one for configuration
/// changes; KVM's side is [`crate::pci::NoKvm`]), and the device's state.
pub fn pci_block(mem: &GuestMemoryMmap) -> (PciTransport, Arc<Mutex<BlockState>>) {
    let file = disk_file().try_clone().expect("dup the disk image");
    let disk = DiskFile::from_file(file, "fuzz.img".as_ref(), false).expect("the disk image");
    let block = Block::new(BlockConfig::with_id("fuzz"), disk, eventfd());
    let state = block.state();
    let interrupt = Arc::new(Interrupt::msix(vec![eventfd(), eventfd()], 1));
    let hooks = Hooks {
        routes: Box::new(crate::pci::NoKvm),
        notify: Box::new(crate::pci::NoKvm),
    };
    let t = PciTransport::new(
        Box::new(block),
        mem.clone(),
        interrupt,
        vec![eventfd()],
        0xe000_0000,
        hooks,
    )
    .expect("a virtio-pci function");
    (t, state)
}

/// A transport in front of a fresh virtio-net device on the process's tap,
/// and the device's state (whether it runs).
pub fn net(
    mem: &GuestMemoryMmap,
    mac: [u8; 6],
    rsc: bool,
) -> (MmioTransport, Arc<Mutex<NetState>>) {
    let config = NetConfig {
        tap: "fuzz0".to_string(),
        mac,
        sndbuf: None,
        rsc: rsc.then_some(Duration::from_micros(300)),
    };
    let net = Net::with_backend(config, Box::new(NullBackend::new()), eventfd());
    let state = net.state();
    (transport(Box::new(net), mem), state)
}

//! tandem's emulated devices.
//!
//! Devices here know nothing of KVM or threads: they are driven through the
//! port-I/O bus by whichever vCPU thread exits on their ports, and they report
//! to the VMM through eventfds and small callback traits. Everything a guest
//! writes to them is untrusted: no access panics, whatever its offset or size.

pub mod acpi_pm;
pub mod bus;
pub mod fw_cfg;
pub mod i8042;
pub mod pci;
pub mod piix4_pm;
pub mod rtc;
pub mod serial;
pub mod sync;
pub mod virtio;

pub use bus::{Bus, BusDevice, BusError, MovableDevice};

/// Guest memory, as the VMM and every device see it: anonymous mappings
/// with a dirty bitmap per region (vm-memory's `AtomicBitmap`, one bit per
/// 4 KiB page) that every write through vm-memory's accessors marks. Live
/// migration and COLO read it beside KVM's dirty log, which only sees the
/// vCPUs' writes.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<vm_memory::bitmap::AtomicBitmap>;

//! tandem's emulated devices.
//!
//! Devices here know nothing of KVM or threads: they are driven through the
//! port-I/O bus by whichever vCPU thread exits on their ports, and they report
//! to the VMM through eventfds and small callback traits. Everything a guest
//! writes to them is untrusted: no access panics, whatever its offset or size.

pub mod bus;
pub mod i8042;
pub mod serial;
pub mod virtio;

pub use bus::{Bus, BusDevice, BusError};

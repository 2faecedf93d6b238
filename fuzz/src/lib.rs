//! What the fuzz targets in `fuzz_targets/` share: fixtures that are costly
//! to build (guest memory, a disk image, a tap), the devices built on them,
//! and drivers that turn fuzzer bytes into guest actions.
//!
//! Runs inside one libFuzzer process, one input at a time; fixtures are
//! built once per process and never written by the code under test in a way
//! that carries over from one input to the next (guest memory that a target
//! writes is cleared by that target first).

pub mod checkpoint;
pub mod fixtures;
pub mod frames;
pub mod mmio;
pub mod pci;
pub mod postcopy;
pub mod restore;
pub mod stream;
pub mod virtq;

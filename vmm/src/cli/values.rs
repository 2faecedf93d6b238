//! The command line's own names for the domain's choices (`--machine`,
//! `--mode`, `--colo-queue-full`, `dirty-log ACTION`): small clap enums,
//! each mapped onto its domain type by a value parser, so that the core
//! (`config`, `migrate`, `colo`, `api`) knows nothing of clap.
//!
//! Runs on the main thread while the command line is parsed. Never does:
//! name a choice differently from the domain type's serde name (the API
//! and the `--config` file take the same words; the tests check it).

use clap::builder::{EnumValueParser, TypedValueParser};
use clap::ValueEnum;

use crate::api::DirtyLogAction;
use crate::colo::QueueFullPolicy;
use crate::config::Machine;
use crate::migrate::Mode;

/// `--machine`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum MachineArg {
    /// Legacy ports and virtio-mmio only.
    Legacy,
    /// Also PCI bus 0 with a host bridge (configuration ports 0xCF8/0xCFC).
    Pci,
}

impl From<MachineArg> for Machine {
    fn from(m: MachineArg) -> Machine {
        match m {
            MachineArg::Legacy => Machine::Legacy,
            MachineArg::Pci => Machine::Pci,
        }
    }
}

/// `tandem ctl migrate --mode`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeArg {
    /// The dedicated migration thread, beside the device loop.
    Thread,
    /// In slices from the device thread's event loop, between device
    /// events (how QEMU's I/O thread did it).
    Inline,
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Mode {
        match m {
            ModeArg::Thread => Mode::Thread,
            ModeArg::Inline => Mode::Inline,
        }
    }
}

/// `--colo-queue-full`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueFullArg {
    /// Drop the frame and count it (the measured better).
    Drop,
    /// Drop it and take a checkpoint (only to measure the difference).
    Checkpoint,
}

impl From<QueueFullArg> for QueueFullPolicy {
    fn from(p: QueueFullArg) -> QueueFullPolicy {
        match p {
            QueueFullArg::Drop => QueueFullPolicy::Drop,
            QueueFullArg::Checkpoint => QueueFullPolicy::Checkpoint,
        }
    }
}

/// `tandem ctl dirty-log ACTION`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirtyLogArg {
    Start,
    Read,
    Stop,
}

impl From<DirtyLogArg> for DirtyLogAction {
    fn from(a: DirtyLogArg) -> DirtyLogAction {
        match a {
            DirtyLogArg::Start => DirtyLogAction::Start,
            DirtyLogArg::Read => DirtyLogAction::Read,
            DirtyLogArg::Stop => DirtyLogAction::Stop,
        }
    }
}

/// A value parser that takes `A`'s names (and shows them, with their
/// help, in `--help`) and gives the domain type `T`.
pub fn parser<A, T>() -> impl TypedValueParser<Value = T>
where
    A: ValueEnum + Clone + Send + Sync + 'static,
    T: From<A> + Clone + Send + Sync + 'static,
{
    EnumValueParser::<A>::new().map(T::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Serialize;

    /// Each name the command line takes is the domain type's serde name
    /// for the value it maps onto (what the API and `--config` take).
    fn same_names<A, T>()
    where
        A: ValueEnum + Clone,
        T: From<A> + Serialize,
    {
        for a in A::value_variants() {
            let name = a.to_possible_value().map(|p| p.get_name().to_string());
            let serde = serde_json::to_value(T::from(a.clone())).unwrap();
            assert_eq!(serde.as_str(), name.as_deref());
        }
    }

    #[test]
    fn names_are_the_domain_types_serde_names() {
        same_names::<ModeArg, Mode>();
        same_names::<QueueFullArg, QueueFullPolicy>();
        same_names::<DirtyLogArg, DirtyLogAction>();
    }

    #[test]
    fn machine_names_are_the_config_files() {
        for a in MachineArg::value_variants() {
            let name = a.to_possible_value().unwrap().get_name().to_string();
            let m: Machine = serde_json::from_value(serde_json::json!(name)).unwrap();
            assert_eq!(m, Machine::from(*a));
        }
    }
}

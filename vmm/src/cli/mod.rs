//! The `tandem` command line: its clap definition ([`Cli`]), `tandem run`
//! ([`run`]: boot, restore or incoming ([`incoming`]), from [`run_args`]) and `tandem
//! ctl` ([`ctl`]: one control-API request per verb, the migration client
//! [`migrate_client`] with its jitter [`probe`] and plots). [`values`]
//! maps the command line's names onto the domain's types.
//!
//! Runs on the main thread of the `tandem` process (a `tandem ctl` process
//! runs nothing else). Never does: get imported by the core, `migrate`,
//! `colo` or the API (the arrows point from here to them); panic on user
//! input (every mistake is one line and exit status 1).

pub mod confine;
pub mod ctl;
pub mod incoming;
pub mod migrate_client;
pub mod probe;
pub mod run;
pub mod run_args;
pub mod values;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use run_args::RunArgs;

#[derive(Parser)]
#[command(
    name = "tandem",
    version,
    about = "tandem: a KVM virtual machine monitor",
    long_about = "tandem: a KVM virtual machine monitor.\n\n\
        Runs a guest on /dev/kvm with its serial console on your terminal: a Linux \
        kernel (ELF vmlinux or bzImage) or a BIOS/UEFI firmware image (OVMF), with \
        virtio-net and virtio-blk devices on a legacy or a PCI machine. A running VM \
        is driven through its control API (`tandem run --api-sock`, `tandem ctl`): \
        pause and resume, snapshots (continued with `tandem run --restore`) and \
        revert, live migration to another tandem (`tandem run --incoming`) with a \
        report of what the guest felt (jitter probe and plot), COLO fault-tolerant \
        pairs (a secondary kept in lockstep by checkpoints, taking over when the \
        primary is lost) on one host or across hosts (etcd lease, TLS), and a guest \
        profiler."
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a VM with its serial console on this terminal: boot a kernel or
    /// firmware, continue a snapshot (--restore), or receive a migrated
    /// guest (--incoming) or a COLO primary's (--colo secondary).
    #[command(after_help = run::AFTER_HELP)]
    Run(Box<RunArgs>),
    /// Send a request to a running VM's control API and print the answer
    /// (JSON). Exit status 0 when the request succeeded, 1 otherwise.
    Ctl(ctl::CtlArgs),
}

/// `tandem`'s whole command line: the clap definition with what is
/// generated from it (`tandem ctl --help`'s list of verbs).
pub fn command() -> clap::Command {
    Cli::command().mut_subcommand("ctl", |c| {
        let verbs = ctl::verbs_line(&c);
        c.after_help(format!(
            "Verbs: {verbs}.\n\n\
             Each verb's options: tandem ctl VERB --help.\n\
             Example: tandem ctl --api-sock /tmp/vm.sock pause"
        ))
    })
}

/// The `tandem` program: parse the command line and run what it asks.
pub fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp_millis()
        .init();
    let cli = match parse_cli() {
        Ok(c) => c,
        Err(code) => return code,
    };
    match cli.command {
        Command::Run(args) => run::run(*args),
        Command::Ctl(ctl) => ctl::run(ctl),
    }
}

/// One line on stderr and exit status 1.
pub(crate) fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("tandem: error: {msg}");
    ExitCode::from(1)
}

/// `path` made absolute (as it is, if that fails).
pub(crate) fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The command line, or the exit code of `--help`, `--version` or a
/// one-line error.
fn parse_cli() -> Result<Cli, ExitCode> {
    let parsed = command()
        .try_get_matches()
        .and_then(|mut m| Cli::from_arg_matches_mut(&mut m));
    match parsed {
        Ok(c) => Ok(c),
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                e.exit();
            }
            let sub = std::env::args().nth(1).filter(|a| a == "run" || a == "ctl");
            eprintln!("tandem: {}", one_line(&e.to_string(), sub.as_deref()));
            Err(ExitCode::from(1))
        }
    }
}

/// clap's error as one line: its first line without its usage block (and
/// the names it lists on the next lines, e.g. missing options), and where
/// to read more.
fn one_line(text: &str, sub: Option<&str>) -> String {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let mut first = lines.next().unwrap_or("invalid arguments").to_string();
    while first.ends_with(':') {
        match lines.next() {
            Some(l) if !l.starts_with("Usage:") => first = format!("{first} {l}"),
            _ => break,
        }
    }
    let help = sub.map_or("tandem --help".to_string(), |s| {
        format!("tandem {s} --help")
    });
    format!("{first} (see '{help}')")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_definition_is_consistent() {
        command().debug_assert();
    }

    #[test]
    fn ctl_help_lists_every_verb() {
        let mut cmd = command();
        let ctl = cmd.find_subcommand_mut("ctl").unwrap();
        let help = ctl.render_long_help().to_string();
        let verbs = help.split("Verbs: ").nth(1).unwrap();
        for v in ctl.get_subcommands().filter(|v| v.get_name() != "help") {
            assert!(verbs.contains(v.get_name()), "{} not listed", v.get_name());
        }
        for v in [
            "colo-start",
            "colo-reprotect",
            "colo-status",
            "migrate ADDR",
        ] {
            assert!(verbs.contains(v), "{v} not listed");
        }
    }

    #[test]
    fn top_help_says_what_tandem_does() {
        let help = command().render_long_help().to_string();
        for what in [
            "firmware",
            "snapshot",
            "migration",
            "COLO",
            "tandem ctl",
            "profiler",
        ] {
            assert!(help.contains(what), "{what} missing");
        }
    }

    #[test]
    fn an_error_is_one_line() {
        let e = command()
            .try_get_matches_from(["tandem", "run", "--mem"])
            .err()
            .unwrap();
        let line = one_line(&e.to_string(), Some("run"));
        assert!(!line.contains('\n'), "{line}");
        assert!(line.ends_with("(see 'tandem run --help')"), "{line}");
    }
}

//! `tandem run`'s options: one struct that clap fills from the command line
//! and serde from a `--config` file (JSON or TOML, [`file`]), and the merge
//! of the two, where the command line wins.
//!
//! The file's keys are the long options' names with `_` for `-` (the
//! struct's fields, renamed where the field is plural: `net`, `disk`), so
//! the two cannot drift apart; `--config` and `--print-cmdline` are not
//! keys (a file naming them is refused like any unknown key).
//!
//! Runs on the main thread before any VM exists. Everything here is user
//! input: each mistake is a one-line error naming the option, or the file
//! and its field; never a panic.

pub mod file;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use clap::Args;
use serde::Deserialize;

use crate::config::{self, DiskSpec, Machine, NetSpec, ProfileConfig, VmConfig};
use crate::profile::symbols::{Symbols, SymbolsError};

/// A COLO role given to `tandem run` (the primary is a running VM told
/// `colo-start`).
#[derive(clap::ValueEnum, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ColoRole {
    Secondary,
}

/// Errors of `tandem run`'s options (the command line's own are clap's).
#[derive(Debug, thiserror::Error)]
pub enum RunArgsError {
    #[error("--config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--config {path}: larger than {max} bytes", max = file::MAX_FILE)]
    TooBig { path: PathBuf },
    #[error("--config {path}: {}", file::json_message(field, source))]
    Json {
        path: PathBuf,
        /// Where in the file's structure (`net[1].rsc`), when known.
        field: Option<String>,
        source: serde_json::Error,
    },
    #[error("--config {path}: the JSON text is not an object ({{\"key\": value, ...}})")]
    JsonNotObject { path: PathBuf },
    #[error("--config {path}: {}", file::toml_message(field, source, at))]
    Toml {
        path: PathBuf,
        /// Where in the file's structure (`net[1].rsc`), when known.
        field: Option<String>,
        source: Box<toml::de::Error>,
        /// Line and column (from 1) of what is wrong, when known.
        at: Option<(usize, usize)>,
    },
    #[error(
        "--config {path}: '{key}' is for booting, and the file also gives 'restore' \
         (with --restore on the command line, the file's kernel, initrd and cmdline are ignored)"
    )]
    RestoreAndBoot { path: PathBuf, key: &'static str },
    #[error("--{option} is for booting and cannot be used with 'restore' from --config {path}")]
    BootOptionWithFileRestore { path: PathBuf, option: &'static str },
    #[error("--guest-profile-hz needs --guest-profile")]
    HzWithoutProfile,
    #[error(
        "--firmware with --{0} needs --kernel: the firmware loads that kernel (a bzImage) \
         with its initrd and command line"
    )]
    FirmwareWithoutKernel(&'static str),
    #[error("--firmware: not with --print-cmdline (the firmware is given the command line)")]
    FirmwarePrintCmdline,
    #[error("--guest-symbols: {0}")]
    Symbols(#[source] SymbolsError),
    #[error("--tls-cert, --tls-key and --tls-ca go together, and not with --insecure")]
    TlsPartial,
    #[error("TLS: {0}")]
    Tls(#[source] crate::streams::tls::TlsError),
}

/// What `tandem run` is given (see `tandem run --help`).
#[derive(Args, Deserialize, Debug, Default, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RunArgs {
    /// Read options from FILE, JSON or TOML (chosen by the extension .json
    /// or .toml, else by the content: a file starting with '{' is JSON).
    /// Its keys are the long options' names with '_' for '-' (api_sock,
    /// guest_profile_hz, ...), each at most once; net and disk are arrays
    /// whose entries are either the option's string ("tap=tap0,rsc=on") or
    /// a table with the same keys (rsc and readonly are true or false); mem
    /// and sndbuf are a string ("512M") or a number (MiB for mem, bytes for
    /// sndbuf). An option given on the command line wins over the file's; a
    /// --net or --disk there replaces the file's whole list. With --restore
    /// on the command line the file's kernel, initrd and cmdline are
    /// ignored (its firmware is not: a restore needs the same image), so
    /// one file serves a boot and later restores. Relative paths
    /// are from the current directory. An unknown key is an error. Example
    /// in docs/cli.md ("Config file").
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Guest kernel: an ELF vmlinux (fastest here) or a bzImage.
    /// Default: the guest built by resources/build-guest.sh (target/guest/vmlinux,
    /// with target/guest/initramfs.cpio as initrd).
    #[arg(long, value_name = "PATH")]
    pub kernel: Option<PathBuf>,
    /// Boot from a firmware image instead of a kernel: a BIOS or UEFI image
    /// (e.g. Debian's OVMF.fd from the ovmf package), whole 4 KiB pages, at
    /// most 16 MiB. It is mapped read-only so that it ends at 4 GiB, and the
    /// first vCPU starts at the reset vector (0xFFFFFFF0) in real mode, as
    /// after a power-on. With --kernel (a bzImage), --initrd and --cmdline,
    /// the firmware is offered them through fw_cfg, as with QEMU's -kernel
    /// (OVMF boots them); without, it boots what it finds. The image is not part of a snapshot
    /// or a migration: --restore and --incoming are given the same image
    /// again (checked by size and SHA-256), and so is a COLO secondary
    /// (--colo secondary). Here the firmware runs in KVM's instruction
    /// emulator (docs/firmware.md).
    #[arg(long, value_name = "PATH", conflicts_with = "print_cmdline")]
    #[serde(default)]
    pub firmware: Option<PathBuf>,
    /// Initial ramdisk (uncompressed cpio boots fastest).
    #[arg(long, value_name = "PATH")]
    pub initrd: Option<PathBuf>,
    /// Kernel command line. Parameters this host's KVM needs are appended;
    /// on the legacy machine (no ACPI, no PCI) a kernel boot also gets
    /// "acpi=off pci=off", so that it does not look for them (a line with
    /// its own acpi= or pci= keeps it). Default: "console=ttyS0 reboot=k
    /// panic=1", with "quiet" on hosts whose KVM emulates the guest kernel
    /// (printing the boot log there costs seconds).
    #[arg(long, value_name = "STR")]
    pub cmdline: Option<String>,
    /// Guest memory: a number with K, M, G or T (a plain number is MiB).
    /// Default: 128M; the snapshot's with --restore, the source's with
    /// --incoming or --colo secondary (see --incoming).
    #[arg(long, value_name = "SIZE", value_parser = config::parse_mem)]
    #[serde(default, deserialize_with = "file::mem")]
    pub mem: Option<u64>,
    /// Print the kernel command line the guest would get (with what this
    /// host needs appended) and exit. What the machine adds at boot is not
    /// in it: the virtio_mmio.device= announcements and, on the legacy
    /// machine, "acpi=off pci=off".
    #[arg(long)]
    #[serde(skip)]
    pub print_cmdline: bool,
    /// A virtio-net device on tap NAME (created if absent); repeatable
    /// (eth0, eth1, ... in that order). mac=AA:BB:CC:DD:EE:FF sets the MAC;
    /// sndbuf=SIZE (e.g. 256K) bounds the tap's send buffer so that a guest
    /// sending faster than the host path drains is throttled (its TX queue
    /// waits) instead of growing host queues; default: unlimited, as in QEMU.
    /// rsc=on coalesces received TCP segments into large packets before they
    /// reach the guest (receive segment coalescing; also offers RSC_EXT to
    /// drivers that report coalescing, e.g. Windows NetKVM); default off.
    /// rsc_interval_us=N: how long a partly coalesced packet may wait for
    /// more segments, 1 to 1000000 µs (default 300). transport=mmio|pci:
    /// virtio-mmio or a virtio-pci function with MSI-X (pci needs
    /// --machine pci; default: pci on a PCI machine, mmio otherwise).
    #[arg(long = "net",
          value_name = "tap=NAME[,mac=MAC][,sndbuf=SIZE][,rsc=on|off][,rsc_interval_us=N][,transport=mmio|pci]",
          value_parser = config::parse_net)]
    #[serde(rename = "net", default, deserialize_with = "file::nets")]
    pub nets: Vec<NetSpec>,
    /// A virtio-blk device on a raw image FILE (a regular file or a block
    /// device); repeatable: the guest sees /dev/vda, /dev/vdb, ... in order.
    /// readonly=on offers the disk read-only (writes fail with an I/O error
    /// and the file is opened read-only); id=NAME (up to 20 characters,
    /// default: the file name) is the serial the guest reads from
    /// /sys/block/vdX/serial. The image is locked while tandem runs (shared
    /// when read-only). To boot from it, give a kernel without an initrd and
    /// `root=/dev/vda` in --cmdline. transport=mmio|pci as for --net.
    #[arg(long = "disk", value_name = "path=FILE[,readonly=on][,id=NAME][,transport=mmio|pci]",
          value_parser = config::parse_disk)]
    #[serde(rename = "disk", default, deserialize_with = "file::disks")]
    pub disks: Vec<DiskSpec>,
    /// Write device counters as JSON to PATH, every second and at exit.
    #[arg(long, value_name = "PATH")]
    pub metrics: Option<PathBuf>,
    /// Serve the control API on a Unix socket at PATH (JSON lines; see
    /// `tandem ctl --help`). A stale socket file there is replaced.
    #[arg(long, value_name = "PATH")]
    pub api_sock: Option<PathBuf>,
    /// Number of vCPUs (1 to 32). Default: 1; the snapshot's with --restore,
    /// the source's with --incoming or --colo secondary without --mem.
    #[arg(long, value_name = "N",
          value_parser = |s: &str| config::parse_cpus(s, config::max_cpus()))]
    #[serde(default, deserialize_with = "file::cpus")]
    pub cpus: Option<u8>,
    /// The machine: `legacy` (legacy ports and virtio-mmio; the default) or
    /// `pci` (also PCI bus 0 with a host bridge, reached through ports
    /// 0xCF8/0xCFC, its BARs at 0xe0000000; virtio devices become
    /// virtio-pci functions with MSI-X unless given transport=mmio).
    /// Default with --restore: the snapshot's. An incoming migration or a COLO
    /// secondary must give the source's machine again.
    #[arg(long, value_name = "KIND",
          value_parser = super::values::parser::<super::values::MachineArg, config::Machine>())]
    #[serde(default)]
    pub machine: Option<config::Machine>,
    /// Continue the VM saved in FILE (by `tandem ctl ... snapshot FILE`)
    /// instead of booting a kernel. The whole file is verified first. Give
    /// the snapshot's devices again, in the same order: --net with the same
    /// MAC and rsc (the tap may differ), --disk with the same readonly flag,
    /// size and id, on the image as it was at the snapshot (the path may
    /// differ). Any other --mem, --cpus or device set is refused, saying
    /// what differs.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["kernel", "initrd", "cmdline", "print_cmdline"])]
    pub restore: Option<PathBuf>,
    /// With --restore, how the snapshot's pages go into guest memory: map
    /// (default) maps them from the file, private, so the guest starts
    /// without reading them and each page is read when first touched (a
    /// write copies it; the file is never written; do not rewrite the
    /// file in place while the VM runs); copy reads every page and checks
    /// its CRC before the guest starts. A file of format version 2 (tandem
    /// before issue 36) is always copied.
    #[arg(long, value_name = "map|copy")]
    #[serde(default)]
    pub restore_memory: Option<crate::snapshot::MemoryMode>,
    /// Wait for a live migration on ADDR (`tcp:HOST:PORT` or `unix:PATH`;
    /// the source runs `tandem ctl migrate ADDR`) instead of booting, and
    /// then run the guest it sends with its console here. Without --mem it
    /// takes the source's memory size, and its vCPU count unless --cpus is
    /// given: it lets the source in before it builds the VM (and serves
    /// --api-sock from then on). With --mem the VM is built at once with
    /// it and --cpus (default 1), and --api-sock serves while it waits.
    /// Give the machine and the devices as the source has them (taps and
    /// disk paths may differ), and --mem and --cpus, if given, the
    /// source's: the source's VM is checked against them before any memory
    /// moves, and anything else is refused, naming each difference. A bad,
    /// broken or refused stream ends tandem with one line and status 1;
    /// nothing of the guest ran here.
    #[arg(long, value_name = "ADDR", conflicts_with_all = ["kernel", "initrd", "cmdline", "print_cmdline", "restore"],
          value_parser = |s: &str| s.parse::<crate::streams::Endpoint>())]
    #[serde(default)]
    pub incoming: Option<crate::streams::Endpoint>,
    /// Run as a COLO secondary: wait on --colo-listen ADDR for the
    /// primary's initial sync (`tandem ctl colo-start ADDR` on the running
    /// VM there), checked as an incoming migration is, then run the copy:
    /// its NICs stay off their taps (nothing is read or written there) and
    /// each checkpoint makes it the primary's exact copy again. When the
    /// primary is lost (no heartbeat within its timeout) it takes the lease
    /// (--colo-lease) and serves on its own taps; if the primary served
    /// alone past its last checkpoint it retires instead (status 1).
    /// Its guest's network output goes to the primary's compare, never to
    /// a client. Its writable disks follow the primary's: give images
    /// equal to the primary's (they are hashed); the primary's writes are
    /// applied at each checkpoint, and its own guest's writes are held in
    /// memory until then.
    #[arg(long, value_name = "ROLE", requires = "colo_listen",
          conflicts_with_all = ["kernel", "initrd", "cmdline", "print_cmdline", "restore", "incoming"])]
    #[serde(default)]
    pub colo: Option<ColoRole>,
    /// Where a COLO secondary waits for its primary (`tcp:HOST:PORT` or
    /// `unix:PATH`).
    #[arg(long, value_name = "ADDR", requires = "colo",
          value_parser = |s: &str| s.parse::<crate::streams::Endpoint>())]
    #[serde(default)]
    pub colo_listen: Option<crate::streams::Endpoint>,
    /// The lease file the pair shares on this host (the side that serves
    /// holds an exclusive lock on it). Default: /tmp/tandem-colo/ADDR.lock
    /// after --colo-listen, what colo-start uses by default for the same
    /// address.
    #[arg(
        long,
        value_name = "PATH",
        requires = "colo",
        conflicts_with = "colo_arbiter"
    )]
    #[serde(default)]
    pub colo_lease: Option<PathBuf>,
    /// The arbiter of a pair on two hosts instead of the lease file:
    /// etcd:http://ADDR:PORT[,http://ADDR:PORT...]/KEY, the endpoints this
    /// host reaches etcd by and the key the primary names too. This side
    /// takes over only once it holds the lease on KEY (after the primary's
    /// has expired), keeps it alive, and fences itself (output stopped,
    /// guest paused) when it cannot renew it in time.
    #[arg(long, value_name = "SPEC", requires = "colo")]
    #[serde(default)]
    pub colo_arbiter: Option<String>,
    /// The etcd lease's TTL when this side takes it, whole seconds (2 at
    /// least; default 3).
    #[arg(long, value_name = "S", requires = "colo_arbiter")]
    #[serde(default)]
    pub colo_lease_ttl_s: Option<u32>,
    /// Profile the guest from start to end into FILE: each vCPU's
    /// instruction pointer is sampled --guest-profile-hz times a second
    /// (the vCPU is kicked out of KVM_RUN and its registers read), with the
    /// kernel call chain read from guest memory when the guest kernel keeps
    /// frame pointers; user-mode samples count as [user]. FILE gets folded
    /// stacks (what flamegraph tools read, e.g. `inferno-flamegraph FILE >
    /// boot.svg`), and the top 30 functions are printed on stderr at exit.
    /// For a window on a running VM: `tandem ctl profile-start/profile-stop`.
    #[arg(long, value_name = "FILE")]
    pub guest_profile: Option<PathBuf>,
    /// Samples per second and vCPU for --guest-profile (1 to 10000;
    /// default 1000).
    #[arg(long, value_name = "N",
          value_parser = |s: &str| -> Result<u32, String> {
              let n: u32 = s.parse().map_err(|_| format!("'{s}' is not a number"))?;
              crate::profile::check_hz(n).map_err(|e| e.to_string())
          })]
    #[serde(default, deserialize_with = "file::hz")]
    pub guest_profile_hz: Option<u32>,
    /// Names for profiled addresses: an ELF vmlinux or a System.map. Default:
    /// the --kernel when it is an ELF vmlinux (a bzImage has no symbols:
    /// give its System.map); needed for --restore.
    #[arg(long, value_name = "FILE")]
    pub guest_symbols: Option<PathBuf>,
    /// This host's certificate chain (PEM, its own first) for migration
    /// and COLO streams. With --tls-key and --tls-ca, every tcp: stream
    /// this VMM accepts (--incoming, --colo-listen) or opens (ctl migrate,
    /// colo-start, colo-reprotect) is TLS with a certificate on both ends:
    /// the peer's must be signed by --tls-ca (and the listener's must name
    /// the address the other side dialled), or the connection is refused
    /// before a byte of VM state is read. Without them, a tcp:
    /// address off this host is refused unless --insecure is given.
    #[arg(long, value_name = "PEM", requires_all = ["tls_key", "tls_ca"])]
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "PEM", requires_all = ["tls_cert", "tls_ca"])]
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
    /// The CA (PEM) that signs the peers' certificates; sign only this
    /// deployment's hosts with it.
    #[arg(long, value_name = "PEM", requires_all = ["tls_cert", "tls_key"])]
    #[serde(default)]
    pub tls_ca: Option<PathBuf>,
    /// Allow migration and COLO streams in plain TCP to and from addresses
    /// off this host (anyone who reaches the port can then hand this VMM a
    /// guest, or read this one's memory).
    #[arg(long, conflicts_with = "tls_cert")]
    #[serde(default)]
    pub insecure: bool,
    /// Each thread's seccomp filter (docs/sandbox.md): on (default) ends
    /// tandem with one line naming the thread and the system call when a
    /// thread makes a call outside its list (exit status 4); log lets such
    /// calls through and the kernel logs them (dmesg: 'audit: type=1326
    /// ... comm=THREAD syscall=N'), for finding a missing one; off installs
    /// none.
    #[arg(long, value_name = "MODE")]
    #[serde(default)]
    pub seccomp: Option<crate::sandbox::Mode>,
    /// Landlock (docs/sandbox.md), on (default, where the kernel has it)
    /// or off: once started, this VMM may open only what this VM needs:
    /// its kernel, initrd, firmware, snapshot and TLS files read-only, its
    /// disks (read-only with readonly=on), /dev/kvm and /dev/net/tun, the
    /// system's /etc, /usr, /lib, /proc and /sys read-only; in the
    /// directories of --api-sock and of a unix: --incoming or --colo-listen
    /// it may make and remove sockets only, in those of --metrics and
    /// --guest-profile make and replace files (not read them); it reads and
    /// writes /tmp/tandem-colo (default COLO leases) and --colo-lease's
    /// directory. Anything else (a snapshot, revert or profile through the
    /// API, even beside the API socket) needs --landlock-rule.
    #[arg(long, value_name = "on|off")]
    #[serde(default)]
    pub landlock: Option<crate::sandbox::landlock::Switch>,
    /// One more path this VMM may open under Landlock: PATH:r (read) or
    /// PATH:rw (read, write, make and remove files), a file or everything
    /// beneath a directory; repeatable.
    #[arg(long = "landlock-rule", value_name = "PATH:r|rw")]
    #[serde(
        rename = "landlock_rule",
        default,
        deserialize_with = "file::landlock_rules"
    )]
    pub landlock_rules: Vec<crate::sandbox::landlock::FsRule>,
}

impl RunArgs {
    /// The options to run with: these (from the command line) over the
    /// `--config` file's, if one is given; then the checks that need both.
    pub fn resolve(self) -> Result<RunArgs, RunArgsError> {
        let merged = match &self.config {
            Some(path) => {
                let from_file = file::load(path)?;
                let path = path.clone();
                self.over(from_file, &path)?
            }
            None => self,
        };
        if merged.guest_profile_hz.is_some() && merged.guest_profile.is_none() {
            return Err(RunArgsError::HzWithoutProfile);
        }
        merged.check_firmware()?;
        Ok(merged)
    }

    /// A firmware VM takes an initrd and a command line only with a kernel
    /// (for it to load) and prints no command line (the command line's
    /// conflicts are clap's; these also catch a `--config` file's). A COLO
    /// secondary may be one: its image is checked against the primary's
    /// as an incoming migration's is.
    pub(crate) fn check_firmware(&self) -> Result<(), RunArgsError> {
        if self.firmware.is_none() {
            return Ok(());
        }
        if self.print_cmdline {
            return Err(RunArgsError::FirmwarePrintCmdline);
        }
        if self.kernel.is_none() {
            if let Some(option) = self.kernel_option() {
                return Err(RunArgsError::FirmwareWithoutKernel(option));
            }
        }
        Ok(())
    }

    /// The first option given that boots a kernel (`--kernel`, `--initrd`,
    /// `--cmdline`, `--print-cmdline`), if any.
    fn kernel_option(&self) -> Option<&'static str> {
        [
            ("kernel", self.kernel.is_some()),
            ("initrd", self.initrd.is_some()),
            ("cmdline", self.cmdline.is_some()),
            ("print-cmdline", self.print_cmdline),
        ]
        .into_iter()
        .find_map(|(option, given)| given.then_some(option))
    }

    /// These options (the command line's) over `file`'s (read from `path`):
    /// each one given here wins; a list given here replaces the file's.
    pub fn over(self, file: RunArgs, path: &Path) -> Result<RunArgs, RunArgsError> {
        // A restore asked for here makes the file's boot keys moot; a
        // restore in the file conflicts with any boot option.
        let file_boots = self.restore.is_none();
        if file_boots && file.restore.is_some() {
            let boot_keys = [
                ("kernel", file.kernel.is_some()),
                ("initrd", file.initrd.is_some()),
                ("cmdline", file.cmdline.is_some()),
            ];
            if let Some(&(key, _)) = boot_keys.iter().find(|(_, given)| *given) {
                let path = path.to_path_buf();
                return Err(RunArgsError::RestoreAndBoot { path, key });
            }
            if let Some(option) = self.kernel_option() {
                let path = path.to_path_buf();
                return Err(RunArgsError::BootOptionWithFileRestore { path, option });
            }
        }
        // Option by option: the command line's, else the file's (the
        // file's boot keys only when it is a boot).
        fn or<T>(here: Option<T>, there: Option<T>, take: bool) -> Option<T> {
            here.or(there.filter(|_| take))
        }
        fn list<T>(here: Vec<T>, there: Vec<T>) -> Vec<T> {
            if here.is_empty() {
                there
            } else {
                here
            }
        }
        Ok(RunArgs {
            config: self.config,
            // A restore needs the image its VM booted from.
            firmware: self.firmware.or(file.firmware),
            kernel: or(self.kernel, file.kernel, file_boots),
            initrd: or(self.initrd, file.initrd, file_boots),
            cmdline: or(self.cmdline, file.cmdline, file_boots),
            mem: self.mem.or(file.mem),
            print_cmdline: self.print_cmdline,
            nets: list(self.nets, file.nets),
            disks: list(self.disks, file.disks),
            metrics: self.metrics.or(file.metrics),
            api_sock: self.api_sock.or(file.api_sock),
            cpus: self.cpus.or(file.cpus),
            machine: self.machine.or(file.machine),
            restore: self.restore.or(file.restore),
            restore_memory: self.restore_memory.or(file.restore_memory),
            incoming: self.incoming.or(file.incoming),
            colo: self.colo.or(file.colo),
            colo_listen: self.colo_listen.or(file.colo_listen),
            colo_lease: self.colo_lease.or(file.colo_lease),
            colo_arbiter: self.colo_arbiter.or(file.colo_arbiter),
            colo_lease_ttl_s: self.colo_lease_ttl_s.or(file.colo_lease_ttl_s),
            guest_profile: self.guest_profile.or(file.guest_profile),
            guest_profile_hz: self.guest_profile_hz.or(file.guest_profile_hz),
            guest_symbols: self.guest_symbols.or(file.guest_symbols),
            tls_cert: self.tls_cert.or(file.tls_cert),
            tls_key: self.tls_key.or(file.tls_key),
            tls_ca: self.tls_ca.or(file.tls_ca),
            insecure: self.insecure || file.insecure,
            seccomp: self.seccomp.or(file.seccomp),
            landlock: self.landlock.or(file.landlock),
            landlock_rules: list(self.landlock_rules, file.landlock_rules),
        })
    }

    /// The streams' security: the TLS files loaded (all three or none),
    /// or plain TCP, off this host only with --insecure.
    pub fn transport(&self) -> Result<crate::streams::Transport, RunArgsError> {
        crate::streams::Transport::from_config(&self.streams()?).map_err(RunArgsError::Tls)
    }

    /// The streams' security as data (the TLS files: all three or none).
    pub fn streams(&self) -> Result<config::StreamsConfig, RunArgsError> {
        let files = match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => None,
            (Some(cert), Some(key), Some(ca)) => Some(config::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            }),
            _ => return Err(RunArgsError::TlsPartial),
        };
        if files.is_some() && self.insecure {
            return Err(RunArgsError::TlsPartial);
        }
        Ok(config::StreamsConfig {
            tls: files,
            insecure: self.insecure,
        })
    }

    /// The options every VM takes whatever it starts from, checked and
    /// loaded (the profiler's, then the streams'); `kernel` is the kernel
    /// a boot loads (its symbols are the profile's default).
    pub fn vm_options(&self, kernel: Option<&Path>) -> Result<VmOptions, RunArgsError> {
        let profile = self.profile(kernel)?;
        let streams = self.streams()?;
        Ok(VmOptions {
            firmware: self.firmware.clone(),
            nets: self.nets.clone(),
            disks: self.disks.clone(),
            metrics: self.metrics.clone(),
            api_sock: self.api_sock.clone(),
            profile,
            streams,
        })
    }

    /// The profiler's settings; an unreadable --guest-symbols is an error.
    pub fn profile(&self, kernel: Option<&Path>) -> Result<ProfileConfig, RunArgsError> {
        if let Some(s) = &self.guest_symbols {
            Symbols::load(s).map_err(RunArgsError::Symbols)?;
        }
        let symbols = self
            .guest_symbols
            .clone()
            .or_else(|| kernel.filter(|k| config::is_elf(k)).map(Into::into));
        Ok(ProfileConfig {
            file: self.guest_profile.clone(),
            hz: self.guest_profile_hz.unwrap_or(crate::profile::DEFAULT_HZ),
            symbols,
        })
    }
}

/// A VM's size and machine: the options', the snapshot's (`--restore`)
/// or the source's (`--incoming`, `--colo secondary`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub mem_bytes: u64,
    pub cpus: u8,
    pub machine: Machine,
}

/// What a booted VM loads; a restored or incoming VM loads nothing
/// ([`BootParts::default`]): its memory brings the guest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BootParts {
    /// The kernel (empty: none; a firmware VM boots what it finds).
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    /// The command line as given (or the default).
    pub cmdline: String,
}

/// The options of any VM ([`RunArgs::vm_options`]): the rest of its
/// [`VmConfig`].
#[derive(Debug, Clone)]
pub struct VmOptions {
    pub firmware: Option<PathBuf>,
    pub nets: Vec<NetSpec>,
    /// A restore fills in the ids the snapshot has (`snapshot::load`).
    pub disks: Vec<DiskSpec>,
    pub metrics: Option<PathBuf>,
    pub api_sock: Option<PathBuf>,
    pub profile: ProfileConfig,
    /// The streams' security, as data (the builder loads the TLS files; the
    /// listener of an incoming VM loads them before the build).
    pub streams: config::StreamsConfig,
}

impl VmOptions {
    /// The VM to build: these options, what it boots and its shape. The
    /// one place `tandem run` makes a [`VmConfig`].
    pub fn into_config(self, boot: BootParts, shape: Shape) -> VmConfig {
        VmConfig {
            firmware: self.firmware,
            kernel: boot.kernel,
            initrd: boot.initrd,
            cmdline: boot.cmdline,
            mem_bytes: shape.mem_bytes,
            cpus: shape.cpus,
            machine: shape.machine,
            nets: self.nets,
            disks: self.disks,
            metrics: self.metrics,
            api_sock: self.api_sock,
            profile: self.profile,
            streams: self.streams,
        }
    }
}

//! The VM's configuration, and the parsing and checks of what the user gave.
//! Everything here is user input: each mistake is a one-line error.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::boot::mptable::MAX_CPUS;

/// Default guest memory.
pub const DEFAULT_MEM: &str = "128M";
/// Command line used when the user gives none.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=1";

/// The command line used when the user gives none, on this kind of host:
/// [`DEFAULT_CMDLINE`], and `quiet` where the guest kernel is emulated
/// (each console character is a few hundred emulated instructions and two
/// exits; the kernel's log stays in `dmesg`, and warnings still reach the
/// console).
pub fn default_cmdline(host: crate::host_emu::HostKind) -> String {
    match host {
        crate::host_emu::HostKind::Hardware => DEFAULT_CMDLINE.to_string(),
        crate::host_emu::HostKind::Emulated => format!("{DEFAULT_CMDLINE} quiet"),
    }
}
const MIN_MEM: u64 = 16 << 20;

/// Configuration errors.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("memory size '{0}' is not a number with an optional K, M, G or T suffix (e.g. 512M)")]
    MemParse(String),
    #[error("memory size must be greater than 0")]
    MemZero,
    #[error("memory size {0} is below the minimum of 16M")]
    MemTooSmall(String),
    #[error("memory size {asked} is more than this host has ({host_mib} MiB)")]
    MemTooBig { asked: String, host_mib: u64 },
    #[error("vCPU count '{0}' is not a number")]
    CpusParse(String),
    #[error("vCPU count must be at least 1")]
    CpusZero,
    #[error("vCPU count {asked} is above the limit of {limit}")]
    CpusTooMany { asked: u64, limit: u8 },
    #[error(
        "--net '{0}': expected \
         tap=NAME[,mac=AA:BB:CC:DD:EE:FF][,sndbuf=SIZE][,rsc=on|off][,rsc_interval_us=N]\
         [,transport=mmio|pci]"
    )]
    NetSyntax(String),
    #[error("'{0}': transport '{1}' is not mmio or pci")]
    Transport(String, String),
    #[error("--net '{0}': rsc '{1}' is not on or off")]
    NetRsc(String, String),
    #[error(
        "--net '{0}': rsc_interval_us '{1}' is not a number of microseconds from 1 to 1000000"
    )]
    NetRscInterval(String, String),
    #[error(
        "--net '{0}': sndbuf '{1}' is not a size from 4K to 1G (a number with an optional K, M or G)"
    )]
    NetSndbuf(String, String),
    #[error("--net '{0}': '{1}' is not a MAC address (six hex bytes with ':')")]
    NetMac(String, String),
    #[error("--net '{0}': tap name must be 1 to 15 bytes")]
    NetTapName(String),
    #[error("--disk '{0}': expected path=FILE[,readonly=on|off][,id=NAME][,transport=mmio|pci]")]
    DiskSyntax(String),
    #[error("--disk '{0}': readonly must be 'on' or 'off', not '{1}'")]
    DiskReadonly(String, String),
    #[error("--disk '{0}': id must be 1 to 20 printable ASCII characters (no spaces)")]
    DiskId(String),
    #[error(
        "no --kernel given and the default guest is not built ({0} is missing): \
         run resources/build-guest.sh"
    )]
    NoDefaultGuest(PathBuf),
}

/// Parses a memory size: a number with an optional K/M/G/T suffix (binary
/// units, an optional "iB"/"B" after it); a plain number means MiB, as in QEMU.
pub fn parse_mem(s: &str) -> Result<u64, ConfigError> {
    let err = || ConfigError::MemParse(s.to_string());
    let bytes = parse_size(s.trim(), 20).ok_or_else(err)?;
    if bytes == 0 {
        return Err(ConfigError::MemZero);
    }
    if bytes < MIN_MEM {
        return Err(ConfigError::MemTooSmall(s.to_string()));
    }
    // Whole pages.
    Ok(bytes.div_ceil(4096) * 4096)
}

/// Checks a memory size against what this host has.
pub fn check_mem_fits(bytes: u64, asked: &str) -> Result<(), ConfigError> {
    if let Some(host) = host_mem_bytes() {
        if bytes > host {
            return Err(ConfigError::MemTooBig {
                asked: asked.to_string(),
                host_mib: host >> 20,
            });
        }
    }
    Ok(())
}

fn host_mem_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Parses the vCPU count, 1 to `limit`.
pub fn parse_cpus(s: &str, limit: u8) -> Result<u8, ConfigError> {
    let n: u64 = s
        .trim()
        .parse()
        .map_err(|_| ConfigError::CpusParse(s.to_string()))?;
    check_cpus(n, limit)
}

/// Checks a vCPU count, 1 to `limit`.
pub fn check_cpus(n: u64, limit: u8) -> Result<u8, ConfigError> {
    if n == 0 {
        return Err(ConfigError::CpusZero);
    }
    if n > u64::from(limit) {
        return Err(ConfigError::CpusTooMany { asked: n, limit });
    }
    Ok(n as u8)
}

/// The most vCPUs tandem gives a guest (the MP table's room).
pub const fn max_cpus() -> u8 {
    MAX_CPUS
}

/// Where the default guest lives: `$TANDEM_GUEST_DIR`, else `target/guest`
/// beside the binary's `target/<profile>/` directory, else `./target/guest`.
pub fn default_guest_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TANDEM_GUEST_DIR") {
        return PathBuf::from(d);
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(target) = exe.parent().and_then(Path::parent) {
            let d = target.join("guest");
            if d.is_dir() {
                return d;
            }
        }
    }
    PathBuf::from("target/guest")
}

/// The default guest's kernel and initramfs.
pub fn default_guest() -> Result<(PathBuf, PathBuf), ConfigError> {
    let dir = default_guest_dir();
    let kernel = dir.join("vmlinux");
    let initrd = dir.join("initramfs.cpio");
    for p in [&kernel, &initrd] {
        if !p.is_file() {
            return Err(ConfigError::NoDefaultGuest(p.clone()));
        }
    }
    Ok((kernel, initrd))
}

/// One `--net` option: a virtio-net device on a tap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetSpec {
    pub tap: String,
    pub mac: Option<[u8; 6]>,
    /// The tap's socket send buffer in bytes (`TUNSETSNDBUF`); `None` keeps
    /// the kernel's default, which is unlimited for a tap.
    pub sndbuf: Option<u32>,
    /// Receive segment coalescing (`rsc=on`); off by default.
    pub rsc: bool,
    /// How long RSC lets a partly coalesced packet wait for more segments
    /// (`rsc_interval_us=`); used only with `rsc`.
    pub rsc_interval: Duration,
    /// `transport=`; `None`: the machine's default.
    pub transport: Option<VirtioTransport>,
}

/// The transport of a virtio device (`transport=mmio|pci`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VirtioTransport {
    /// virtio-mmio, announced on the kernel command line.
    Mmio,
    /// virtio-pci (modern, MSI-X) on PCI bus 0: needs `--machine pci`.
    Pci,
}

impl VirtioTransport {
    /// The transport `asked` resolves to on `machine`: by default PCI on a
    /// PCI machine, virtio-mmio otherwise.
    pub fn resolve(asked: Option<VirtioTransport>, machine: Machine) -> VirtioTransport {
        asked.unwrap_or(match machine {
            Machine::Pci => VirtioTransport::Pci,
            Machine::Legacy => VirtioTransport::Mmio,
        })
    }
}

fn parse_transport(v: &str) -> Option<VirtioTransport> {
    match v {
        "mmio" => Some(VirtioTransport::Mmio),
        "pci" => Some(VirtioTransport::Pci),
        _ => None,
    }
}

/// Default RSC drain interval (design §4; QEMU's default too).
pub const DEFAULT_RSC_INTERVAL: Duration = Duration::from_micros(300);
/// Longest RSC drain interval accepted: beyond it the guest's TCP would see
/// the delay as loss.
pub const MAX_RSC_INTERVAL_US: u64 = 1_000_000;

/// `KEY=VALUE,KEY=VALUE...` as pairs; `None` if a part has no `=`.
fn split_pairs(s: &str) -> Option<Vec<(&str, &str)>> {
    s.split(',').map(|part| part.split_once('=')).collect()
}

/// Parses
/// `tap=NAME[,mac=MAC][,sndbuf=SIZE][,rsc=on|off][,rsc_interval_us=N][,transport=mmio|pci]`.
pub fn parse_net(s: &str) -> Result<NetSpec, ConfigError> {
    let pairs = split_pairs(s).ok_or_else(|| ConfigError::NetSyntax(s.to_string()))?;
    net_from_pairs(s, &pairs)
}

/// A `--net` from its `key=value` pairs (the keys of [`parse_net`]); `s`,
/// the option as the user wrote it (or its equivalent), is what errors name.
pub fn net_from_pairs(s: &str, pairs: &[(&str, &str)]) -> Result<NetSpec, ConfigError> {
    let mut tap = None;
    let mut mac = None;
    let mut sndbuf = None;
    let mut rsc = false;
    let mut rsc_interval = DEFAULT_RSC_INTERVAL;
    let mut transport = None;
    for &(k, v) in pairs {
        match k {
            "tap" => tap = Some(v.to_string()),
            "transport" => {
                transport = Some(
                    parse_transport(v)
                        .ok_or_else(|| ConfigError::Transport(s.to_string(), v.to_string()))?,
                )
            }
            "mac" => {
                mac = Some(
                    parse_mac(v)
                        .ok_or_else(|| ConfigError::NetMac(s.to_string(), v.to_string()))?,
                )
            }
            "sndbuf" => {
                sndbuf = Some(
                    parse_sndbuf(v)
                        .ok_or_else(|| ConfigError::NetSndbuf(s.to_string(), v.to_string()))?,
                )
            }
            "rsc" => {
                rsc = match v {
                    "on" => true,
                    "off" => false,
                    _ => return Err(ConfigError::NetRsc(s.to_string(), v.to_string())),
                }
            }
            "rsc_interval_us" => {
                rsc_interval = v
                    .parse::<u64>()
                    .ok()
                    .filter(|us| (1..=MAX_RSC_INTERVAL_US).contains(us))
                    .map(Duration::from_micros)
                    .ok_or_else(|| ConfigError::NetRscInterval(s.to_string(), v.to_string()))?
            }
            _ => return Err(ConfigError::NetSyntax(s.to_string())),
        }
    }
    let tap = tap.ok_or_else(|| ConfigError::NetSyntax(s.to_string()))?;
    if tap.is_empty() || tap.len() > 15 || tap.contains('/') {
        return Err(ConfigError::NetTapName(s.to_string()));
    }
    Ok(NetSpec {
        tap,
        mac,
        sndbuf,
        rsc,
        rsc_interval,
        transport,
    })
}

/// A send-buffer size: bytes, or with a K/M/G suffix (binary units);
/// 4 KiB to 1 GiB.
fn parse_sndbuf(v: &str) -> Option<u32> {
    let bytes = parse_size(v, 0)?;
    if (4096..=1 << 30).contains(&bytes) {
        u32::try_from(bytes).ok()
    } else {
        None
    }
}

/// A size in bytes: a number with an optional K/M/G/T suffix (binary
/// units, optionally followed by "iB" or "B"); a plain number is in units
/// of `1 << plain_shift` bytes. `None` if it is no such number or overflows.
fn parse_size(s: &str, plain_shift: u32) -> Option<u64> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(end);
    let n: u64 = num.parse().ok()?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" => plain_shift,
        "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

fn parse_mac(v: &str) -> Option<[u8; 6]> {
    let parts: Vec<&str> = v.split(':').collect();
    if parts.len() != 6 {
        return None;
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(parts) {
        if p.len() != 2 {
            return None;
        }
        *m = u8::from_str_radix(p, 16).ok()?;
    }
    Some(mac)
}

/// The MAC of NIC `index` when the user gives none (locally administered).
pub fn default_mac(index: usize) -> [u8; 6] {
    [
        0x52,
        0x54,
        0x00,
        0x12,
        0x34,
        0x56u8.wrapping_add(index as u8),
    ]
}

/// One `--disk` option: a virtio-blk device on a raw image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSpec {
    pub path: PathBuf,
    pub readonly: bool,
    /// The device id the guest reads (`/sys/block/vdX/serial`).
    pub id: Option<String>,
    /// `transport=`; `None`: the machine's default.
    pub transport: Option<VirtioTransport>,
}

/// Longest device id virtio-blk carries.
pub const DISK_ID_MAX: usize = 20;

/// Parses `path=FILE[,readonly=on|off][,id=NAME][,transport=mmio|pci]` (each key at most once;
/// a path cannot contain a comma).
pub fn parse_disk(s: &str) -> Result<DiskSpec, ConfigError> {
    let pairs = split_pairs(s).ok_or_else(|| ConfigError::DiskSyntax(s.to_string()))?;
    disk_from_pairs(s, &pairs)
}

/// A `--disk` from its `key=value` pairs (the keys of [`parse_disk`]); `s`,
/// the option as the user wrote it (or its equivalent), is what errors name.
pub fn disk_from_pairs(s: &str, pairs: &[(&str, &str)]) -> Result<DiskSpec, ConfigError> {
    let syntax = || ConfigError::DiskSyntax(s.to_string());
    let (mut path, mut readonly, mut id, mut transport) = (None, None, None, None);
    for &(k, v) in pairs {
        let slot_taken = match k {
            "transport" => {
                let t = parse_transport(v)
                    .ok_or_else(|| ConfigError::Transport(s.to_string(), v.to_string()))?;
                transport.replace(t).is_some()
            }
            "path" => path.replace(PathBuf::from(v)).is_some() || v.is_empty(),
            "readonly" => {
                let ro = match v {
                    "on" => true,
                    "off" => false,
                    _ => return Err(ConfigError::DiskReadonly(s.to_string(), v.to_string())),
                };
                readonly.replace(ro).is_some()
            }
            "id" => {
                if v.is_empty() || v.len() > DISK_ID_MAX || !v.bytes().all(|b| b.is_ascii_graphic())
                {
                    return Err(ConfigError::DiskId(s.to_string()));
                }
                id.replace(v.to_string()).is_some()
            }
            _ => true,
        };
        if slot_taken {
            return Err(syntax());
        }
    }
    Ok(DiskSpec {
        path: path.ok_or_else(syntax)?,
        readonly: readonly.unwrap_or(false),
        id,
        transport,
    })
}

/// The id of a disk the user gave none: its file name's printable ASCII
/// characters, at most 20.
pub fn default_disk_id(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_graphic())
        .take(DISK_ID_MAX)
        .collect()
}

/// The machine's buses besides the legacy ports and virtio-mmio.
#[derive(serde::Deserialize, Debug, Clone, Copy, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Machine {
    /// Legacy ports and virtio-mmio only.
    #[default]
    Legacy,
    /// Also PCI bus 0 with a host bridge (configuration ports 0xCF8/0xCFC).
    Pci,
}

/// A VM to run.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// `--firmware`: boot this image from the reset vector instead of
    /// loading `kernel`, which (with `initrd` and `cmdline`), unless empty,
    /// the firmware loads through fw_cfg.
    pub firmware: Option<PathBuf>,
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    /// The command line as the user gave it (or the default); host-required
    /// parameters are appended at boot.
    pub cmdline: String,
    pub mem_bytes: u64,
    pub cpus: u8,
    /// `--machine`.
    pub machine: Machine,
    pub nets: Vec<NetSpec>,
    /// virtio-blk devices, in order (vda, vdb, ...).
    pub disks: Vec<DiskSpec>,
    /// Where to write device counters as JSON (every second and at exit).
    pub metrics: Option<PathBuf>,
    /// The control API's Unix socket.
    pub api_sock: Option<PathBuf>,
    /// The guest profiler (`--guest-profile`, `--guest-symbols`).
    pub profile: ProfileConfig,
    /// TLS or plain TCP for migration and COLO streams (the files are
    /// loaded when the VM is built, by the layer above the core).
    pub streams: StreamsConfig,
}

/// How the migration and COLO streams cross the network, as data: the
/// TLS files (`--tls-cert/--tls-key/--tls-ca`, all three or none) or plain
/// TCP, off this host only with `--insecure`. `streams::Transport` loads
/// it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamsConfig {
    pub tls: Option<TlsFiles>,
    pub insecure: bool,
}

/// The PEM files one side uses, in both roles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// This host's certificate chain (its own first).
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA that signed the peer's certificate.
    pub ca: PathBuf,
}

/// What the guest profiler is given on the command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProfileConfig {
    /// Profile from the start to the end of the VM, into this file.
    pub file: Option<PathBuf>,
    /// Sampling rate of that profile.
    pub hz: u32,
    /// Where sampled addresses get their names: `--guest-symbols`, else the
    /// kernel when it is an ELF file.
    pub symbols: Option<PathBuf>,
}

/// Whether `path` starts like an ELF file (a vmlinux, not a bzImage).
pub fn is_elf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"\x7fELF"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_sizes() {
        assert_eq!(parse_mem("128M"), Ok(128 << 20));
        assert_eq!(parse_mem("128"), Ok(128 << 20));
        assert_eq!(parse_mem("1G"), Ok(1 << 30));
        assert_eq!(parse_mem("1GiB"), Ok(1 << 30));
        assert_eq!(
            parse_mem("65537K"),
            Ok((65537u64 << 10).div_ceil(4096) * 4096)
        );
        assert_eq!(parse_mem("0"), Err(ConfigError::MemZero));
        assert_eq!(parse_mem("0G"), Err(ConfigError::MemZero));
        assert!(matches!(parse_mem("1M"), Err(ConfigError::MemTooSmall(_))));
        for bad in ["", "abc", "12Q", "-1", "1.5G", "99999999999999999999T", "M"] {
            assert!(
                matches!(parse_mem(bad), Err(ConfigError::MemParse(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            check_mem_fits(1 << 60, "1048576T"),
            Err(ConfigError::MemTooBig { .. })
        ));
        assert_eq!(check_mem_fits(16 << 20, "16M"), Ok(()));
    }

    #[test]
    fn net_options() {
        assert_eq!(
            parse_net("tap=tap0"),
            Ok(NetSpec {
                tap: "tap0".into(),
                mac: None,
                sndbuf: None,
                rsc: false,
                rsc_interval: DEFAULT_RSC_INTERVAL,
                transport: None,
            })
        );
        assert_eq!(
            parse_net("tap=t1,mac=52:54:00:AB:cd:01"),
            Ok(NetSpec {
                tap: "t1".into(),
                mac: Some([0x52, 0x54, 0, 0xab, 0xcd, 1]),
                sndbuf: None,
                rsc: false,
                rsc_interval: DEFAULT_RSC_INTERVAL,
                transport: None,
            })
        );
        assert_eq!(parse_net("tap=t,sndbuf=64K").unwrap().sndbuf, Some(65536));
        assert_eq!(parse_net("tap=t,sndbuf=8192").unwrap().sndbuf, Some(8192));
        assert_eq!(parse_net("tap=t,sndbuf=1G").unwrap().sndbuf, Some(1 << 30));
        for bad in ["0", "4095", "2G", "x", "64Q", "-1", ""] {
            assert!(
                matches!(
                    parse_net(&format!("tap=t,sndbuf={bad}")),
                    Err(ConfigError::NetSndbuf(..))
                ),
                "{bad}"
            );
        }
        assert!(matches!(parse_net("tap0"), Err(ConfigError::NetSyntax(_))));
        assert!(matches!(
            parse_net("mac=52:54:00:00:00:01"),
            Err(ConfigError::NetSyntax(_))
        ));
        assert!(matches!(
            parse_net("tap=x,bogus=1"),
            Err(ConfigError::NetSyntax(_))
        ));
        assert!(matches!(
            parse_net("tap=x,mac=1:2:3"),
            Err(ConfigError::NetMac(..))
        ));
        assert!(matches!(
            parse_net("tap=x,mac=zz:00:00:00:00:00"),
            Err(ConfigError::NetMac(..))
        ));
        assert!(matches!(
            parse_net("tap=0123456789abcdef"),
            Err(ConfigError::NetTapName(_))
        ));
        assert!(matches!(parse_net("tap="), Err(ConfigError::NetTapName(_))));
    }

    #[test]
    fn transport_options() {
        let t = |s: &str| parse_net(s).map(|n| n.transport);
        assert_eq!(t("tap=t"), Ok(None));
        assert_eq!(t("tap=t,transport=pci"), Ok(Some(VirtioTransport::Pci)));
        assert_eq!(t("tap=t,transport=mmio"), Ok(Some(VirtioTransport::Mmio)));
        assert!(matches!(
            t("tap=t,transport=usb"),
            Err(ConfigError::Transport(..))
        ));
        let d = parse_disk("path=x,transport=pci").unwrap();
        assert_eq!(d.transport, Some(VirtioTransport::Pci));
        assert!(matches!(
            parse_disk("path=x,transport=pci,transport=mmio"),
            Err(ConfigError::DiskSyntax(_))
        ));
        assert!(matches!(
            parse_disk("path=x,transport="),
            Err(ConfigError::Transport(..))
        ));
        use VirtioTransport::*;
        assert_eq!(VirtioTransport::resolve(None, Machine::Pci), Pci);
        assert_eq!(VirtioTransport::resolve(None, Machine::Legacy), Mmio);
        assert_eq!(VirtioTransport::resolve(Some(Mmio), Machine::Pci), Mmio);
    }

    #[test]
    fn disk_options() {
        assert_eq!(
            parse_disk("path=/var/lib/a.img"),
            Ok(DiskSpec {
                path: "/var/lib/a.img".into(),
                readonly: false,
                id: None,
                transport: None,
            })
        );
        assert_eq!(
            parse_disk("id=root-1,readonly=on,path=r.img"),
            Ok(DiskSpec {
                path: "r.img".into(),
                readonly: true,
                id: Some("root-1".into()),
                transport: None,
            })
        );
        assert_eq!(
            parse_disk("path=x,readonly=off").map(|d| d.readonly),
            Ok(false)
        );
        assert_eq!(
            parse_disk("path=x,id=12345678901234567890").map(|d| d.id),
            Ok(Some("12345678901234567890".into()))
        );
        for bad in [
            "",
            "x.img",
            "path=",
            "readonly=on",
            "path=a,path=b",
            "path=a,bogus=1",
            "path=a,readonly=on,readonly=off",
            "path=a,ro",
            "path=a,id=x,id=y",
        ] {
            assert_eq!(
                parse_disk(bad),
                Err(ConfigError::DiskSyntax(bad.into())),
                "{bad}"
            );
        }
        assert!(matches!(
            parse_disk("path=a,readonly=yes"),
            Err(ConfigError::DiskReadonly(_, v)) if v == "yes"
        ));
        for bad in [
            "path=a,id=",
            "path=a,id=123456789012345678901",
            "path=a,id=a b",
            "path=a,id=é",
        ] {
            assert_eq!(
                parse_disk(bad),
                Err(ConfigError::DiskId(bad.into())),
                "{bad}"
            );
        }
        // Every message is one line and names the option.
        let e = parse_disk("path=a,readonly=1").unwrap_err().to_string();
        assert!(
            !e.contains('\n') && e.starts_with("--disk 'path=a,readonly=1'"),
            "{e}"
        );
    }

    #[test]
    fn default_disk_ids() {
        assert_eq!(default_disk_id(Path::new("/x/rootfs.ext4")), "rootfs.ext4");
        assert_eq!(
            default_disk_id(Path::new("a very long name with spaces.img")),
            "averylongnamewithspa"
        );
        assert_eq!(default_disk_id(Path::new("/")), "");
    }

    #[test]
    fn rsc_options() {
        let n = parse_net("tap=t,rsc=on").unwrap();
        assert!(n.rsc);
        assert_eq!(n.rsc_interval, Duration::from_micros(300), "default");
        assert!(!parse_net("tap=t").unwrap().rsc, "off by default");
        assert!(!parse_net("tap=t,rsc=off").unwrap().rsc);
        let n = parse_net("tap=t,rsc=on,rsc_interval_us=50").unwrap();
        assert_eq!(n.rsc_interval, Duration::from_micros(50));
        assert_eq!(
            parse_net("tap=t,rsc_interval_us=1000000,rsc=on")
                .unwrap()
                .rsc_interval,
            Duration::from_secs(1),
            "1 s is the limit, in any order"
        );
        assert_eq!(
            parse_net("tap=t,rsc_interval_us=1").unwrap().rsc_interval,
            Duration::from_micros(1)
        );
        for bad in ["yes", "1", "ON", ""] {
            assert_eq!(
                parse_net(&format!("tap=t,rsc={bad}")),
                Err(ConfigError::NetRsc(format!("tap=t,rsc={bad}"), bad.into()))
            );
        }
        for bad in [
            "0",
            "1000001",
            "99999999999999999999",
            "-5",
            "300us",
            "1.5",
            "",
        ] {
            let s = format!("tap=t,rsc=on,rsc_interval_us={bad}");
            assert_eq!(
                parse_net(&s),
                Err(ConfigError::NetRscInterval(s.clone(), bad.into())),
                "{bad}"
            );
        }
        let msg = parse_net("tap=t,rsc_interval_us=0")
            .unwrap_err()
            .to_string();
        assert!(!msg.contains('\n'), "one line: {msg}");
        let msg = parse_net("tap=t,bogus=1").unwrap_err().to_string();
        assert!(msg.contains("rsc=on|off") && !msg.contains('\n'), "{msg}");
    }

    #[test]
    fn cpu_counts() {
        assert_eq!(parse_cpus("1", 32), Ok(1));
        assert_eq!(parse_cpus("32", 32), Ok(32));
        assert_eq!(parse_cpus("0", 32), Err(ConfigError::CpusZero));
        assert_eq!(
            parse_cpus("33", 32),
            Err(ConfigError::CpusTooMany {
                asked: 33,
                limit: 32
            })
        );
        assert!(matches!(
            parse_cpus("two", 32),
            Err(ConfigError::CpusParse(_))
        ));
        assert!(matches!(
            parse_cpus("-1", 32),
            Err(ConfigError::CpusParse(_))
        ));
    }
}

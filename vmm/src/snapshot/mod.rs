//! Snapshot files of a whole VM: a [`VmState`] and guest memory to and
//! from a file, in which order, and every check a restore makes on the
//! file before a VM exists. Runs on the VMM thread; never touches KVM.
//!
//! Save (the VM paused; the state captured by `VmHandle::capture_state`):
//! manifest, `vm` (PIC master/slave, IOAPIC,
//! PIT2, the guest clock as it was at the pause), `vcpu.N`, `dev.com1`
//! (the serial UART), `dev.rtc` (the CMOS RTC; a file without it, from
//! before tandem had one, restores with the RTC on the host's clock),
//! `dev.netN` and `dev.blkN` (each virtio-mmio
//! transport with its queues where the device had got to, and the device's
//! own facts), then guest memory without its zero pages. The file is
//! written to `F.tmp`, fsynced and renamed to `F`, so `F` is never a
//! half-written file.
//!
//! Restore: [`load`] verifies the file (structure, and the CRC of all but
//! the guest pages, which have their own: see [`memory`]), checks the
//! manifest against what is asked for (memory, vCPUs, and the devices:
//! kind, order, MAC, rsc, read-only flag, disk size and id; the tap and
//! the disk path may change), converts every state section and validates
//! the memory image against the VM's layout, all before a VM exists;
//! `builder.rs` then builds the VM paused, fills its memory from the
//! [`Restore`] it returns (mapped or copied, [`memory`]) and applies the
//! state before any vCPU runs.
//!
//! Not in the file: the contents of disks (the restore must be given the
//! image as it was at the snapshot, as with any VMM), and frames the VMM
//! held between the tap and the guest (RSC or a guest without buffers):
//! the restored guest sees those as lost on the wire.

use std::fs::File;
use std::io::{self, BufWriter, Read, Seek};
use std::path::{Path, PathBuf};
use std::time::Instant;

use devices::rtc::CMOS_BYTES;
use devices::GuestMemoryMmap;
use migration::devices::{
    DeviceState, FwCfgState, MmioTransportState, PciState, RtcState, SerialState,
};
use migration::kvm::{KvmStateError, KvmVcpuState, KvmVmState};
use migration::memory::ImageStats;
use migration::vcpu::VcpuState;
use migration::vm::VmState as VmWideState;
use migration::{
    check_compatible, section, CompatError, DeviceConfig, FormatError, Manifest, MemoryError,
    SnapshotReader, SnapshotWriter,
};
use vm_memory::{Bytes, GuestAddress};

use crate::boot::layout;
use crate::config::{self, DiskSpec, Machine, NetSpec};
use crate::device_manager::{self, manifest, FW_CFG_ID, PCI_ID, RTC_ID, SERIAL_ID};
use crate::vstate::memory::GuestPages;
use crate::vstate::vm_state::VmState;

mod memory;

pub use memory::{MemoryMode, PageCheck, Placed};

/// The UART's receive FIFO (vm-superio refuses a longer saved buffer).
const UART_FIFO: usize = 64;

/// Snapshot errors: each is one line for the user.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("cannot open snapshot {path}: {err}")]
    Open { path: String, err: io::Error },
    #[error("snapshot {path}: {err}")]
    Format { path: String, err: FormatError },
    #[error("snapshot {path}: {err}")]
    Memory { path: String, err: MemoryError },
    #[error("snapshot {path}: section {section}: {err}")]
    State {
        path: String,
        section: String,
        err: KvmStateError,
    },
    #[error("snapshot {path}: {msg}")]
    Invalid { path: String, msg: String },
    #[error("snapshot {path}: {err}")]
    Mismatch { path: String, err: CompatError },
    #[error("cannot write snapshot {path}: {source}")]
    Write { path: String, source: SaveError },
    #[error(transparent)]
    Devices(#[from] device_manager::DeviceError),
}

/// What a save wrote.
#[derive(Debug, Clone, Copy)]
pub struct SaveReport {
    /// Size of the file.
    pub file_bytes: u64,
    /// Guest memory bytes stored (non-zero pages).
    pub memory_bytes: u64,
    /// Time to write state and memory into the file (page cache), ms.
    pub write_ms: f64,
    /// Time of the fsync that makes the file durable, ms.
    pub sync_ms: f64,
}

/// `F.tmp` next to `F`.
fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Writes a snapshot of a paused VM to `path` (via `path.tmp`, fsync, rename).
pub fn save(
    path: &Path,
    state: &VmState,
    mem: &GuestMemoryMmap,
) -> Result<SaveReport, SnapshotError> {
    let werr = |source: SaveError| SnapshotError::Write {
        path: path.display().to_string(),
        source,
    };
    let tmp = tmp_path(path);
    let written = match write_file(&tmp, state, mem) {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(werr(e));
        }
    };
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(werr(SaveError::Io(e)));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    let file_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    Ok(SaveReport {
        file_bytes,
        memory_bytes: written.stats.pages * migration::memory::PAGE_SIZE,
        write_ms: written.write_ms,
        sync_ms: written.sync_ms,
    })
}

/// Why writing a snapshot file failed.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
}

/// What [`write_file`] wrote, and how long its two phases took.
struct Written {
    stats: ImageStats,
    write_ms: f64,
    sync_ms: f64,
}

/// Writes the whole file `tmp` (state sections, memory, trailer) and
/// fsyncs it; returns what the memory image holds.
fn write_file(tmp: &Path, state: &VmState, mem: &GuestMemoryMmap) -> Result<Written, SaveError> {
    let start = Instant::now();
    let file = File::create(tmp)?;
    let mut w = SnapshotWriter::new(BufWriter::with_capacity(1 << 20, file))?;
    write_states(&mut w, state)?;
    let stats = migration::memory::write_memory_from(&mut w, section::MEMORY, &GuestPages(mem))?;
    let out = w.finish()?;
    let file = out.into_inner().map_err(|e| e.into_error())?;
    let write_ms = ms_since(start);
    let synced = Instant::now();
    file.sync_all()?;
    Ok(Written {
        stats,
        write_ms,
        sync_ms: ms_since(synced),
    })
}

/// The state sections of a snapshot: manifest, VM, each vCPU, the serial
/// port and each virtio device.
fn write_states<W: io::Write>(w: &mut SnapshotWriter<W>, state: &VmState) -> Result<(), SaveError> {
    w.write_state(section::MANIFEST, &state.manifest)?;
    w.write_state(section::VM, &VmWideState::from_kvm(&state.vm))?;
    for (i, v) in state.vcpus.iter().enumerate() {
        let id = i as u32;
        w.write_state(&section::vcpu(id), &VcpuState::from_kvm(id, v))?;
    }
    let serial = DeviceState::Serial(SerialState::from(&state.serial));
    w.write_state(&section::device(SERIAL_ID), &serial)?;
    if let Some(rtc) = &state.rtc {
        w.write_state(&section::device(RTC_ID), &DeviceState::Rtc(rtc.clone()))?;
    }
    if let Some(f) = &state.fw_cfg {
        w.write_state(&section::device(FW_CFG_ID), &DeviceState::FwCfg(*f))?;
    }
    if let Some(pci) = &state.pci {
        w.write_state(&section::device(PCI_ID), &DeviceState::Pci(pci.clone()))?;
    }
    for (id, dev) in &state.devices {
        w.write_state(&section::device(id), dev)?;
    }
    Ok(())
}

/// `state` as a snapshot image in memory whose memory section is empty:
/// what a migration's `State` message carries (its memory went before).
pub fn state_image(state: &VmState) -> Result<Vec<u8>, SaveError> {
    let mut w = SnapshotWriter::new(Vec::new())?;
    write_states(&mut w, state)?;
    let none: &[(u64, &[u8])] = &[];
    migration::memory::write_memory_from(&mut w, section::MEMORY, none)?;
    Ok(w.finish()?)
}

pub(super) fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// A verified snapshot, converted and ready to apply to a new VM; `R` is
/// where it is read from (a file, or bytes in memory for the fuzz target).
pub struct Restore<R: Read + Seek = File> {
    /// Everything but memory.
    pub state: VmState,
    /// How the pages go into memory; [`MemoryMode::Copy`] unless the
    /// caller asks for a map (only a file can be mapped).
    pub memory: MemoryMode,
    reader: SnapshotReader<R>,
    path: String,
}

/// What a restore asks for besides its disks (`None`: the snapshot's).
#[derive(Clone, Copy)]
pub struct Asked<'a> {
    pub mem: Option<u64>,
    pub cpus: Option<u8>,
    pub machine: Option<Machine>,
    pub nets: &'a [NetSpec],
    /// The image given with `--firmware` (see `boot::firmware::identify`).
    pub firmware: Option<&'a migration::FirmwareId>,
}

/// Opens and verifies `path` completely and checks it against the memory
/// size, vCPU count, machine and firmware asked for and the devices `nets`
/// and `disks`. A disk given without `id=` takes the id the snapshot has for
/// it. Creates nothing.
pub fn load(path: &Path, asked: Asked, disks: &mut [DiskSpec]) -> Result<Restore, SnapshotError> {
    let mut l = Loader::open(path)?;
    let saved: Manifest = l.state(section::MANIFEST)?;
    for (j, d) in disks.iter_mut().enumerate() {
        let want = format!("blk{j}");
        if d.id.is_none() {
            d.id = saved.devices.iter().find_map(|s| match s {
                DeviceConfig::Blk { id, serial, .. } if *id == want => Some(serial.clone()),
                _ => None,
            });
        }
    }
    let machine = asked
        .machine
        .unwrap_or_else(|| device_manager::machine_of(&saved));
    let virtio = device_manager::virtio_configs(asked.nets, disks, machine)?;
    let mut requested = manifest(
        asked.mem.unwrap_or(saved.mem_bytes),
        asked.cpus.map_or(saved.vcpus, u32::from),
        machine,
        virtio,
    );
    requested.firmware = asked.firmware.cloned();
    l.finish(saved, &requested)
}

/// Opens and verifies `path` completely as a state for the VM that
/// `current` describes (a running VM going back to a snapshot of itself).
pub fn load_for(path: &Path, current: &Manifest) -> Result<Restore, SnapshotError> {
    let mut l = Loader::open(path)?;
    let saved: Manifest = l.state(section::MANIFEST)?;
    l.finish(saved, current)
}

/// Verifies a whole snapshot read from `image` (named `shown` in errors)
/// as `tandem run --restore` without options would: every check of
/// [`load`] but the devices' backends. The fuzz target's way in.
pub fn load_image<R: Read + Seek>(image: R, shown: &str) -> Result<Restore<R>, SnapshotError> {
    let mut l = Loader::from_reader(image, shown.to_string())?;
    let saved: Manifest = l.state(section::MANIFEST)?;
    let requested = saved.clone();
    l.finish(saved, &requested)
}

/// Verifies a whole snapshot image read from `image` (named `shown` in
/// errors) as a state for the VM that `current` describes (a migration's
/// destination, which was built from its own options).
pub fn load_image_for<R: Read + Seek>(
    image: R,
    shown: &str,
    current: &Manifest,
) -> Result<Restore<R>, SnapshotError> {
    let mut l = Loader::from_reader(image, shown.to_string())?;
    let saved: Manifest = l.state(section::MANIFEST)?;
    l.finish(saved, current)
}

/// A verified snapshot, read section by section by [`load`].
struct Loader<R: Read + Seek> {
    reader: SnapshotReader<R>,
    shown: String,
}

impl Loader<File> {
    /// Opens `path` and verifies the whole file (CRC, structure).
    fn open(path: &Path) -> Result<Self, SnapshotError> {
        let shown = path.display().to_string();
        let file = File::open(path).map_err(|err| SnapshotError::Open {
            path: shown.clone(),
            err,
        })?;
        Loader::from_reader(file, shown)
    }
}

impl<R: Read + Seek> Loader<R> {
    /// Verifies the whole image (CRC, structure).
    fn from_reader(image: R, shown: String) -> Result<Self, SnapshotError> {
        let reader = SnapshotReader::open(image).map_err(|err| SnapshotError::Format {
            path: shown.clone(),
            err,
        })?;
        Ok(Loader { reader, shown })
    }

    /// Checks `saved` against `requested`, then reads and converts every
    /// state section and validates the memory image.
    fn finish(
        mut self,
        saved: Manifest,
        requested: &Manifest,
    ) -> Result<Restore<R>, SnapshotError> {
        self.check_manifest(&saved, requested)?;
        let (vm, vcpus) = self.kvm_state(saved.vcpus)?;
        let serial = self.serial()?;
        let rtc = self.rtc()?;
        let pci = self.pci(&saved)?;
        let fw_cfg = self.fw_cfg()?;
        let devices = self.devices(&saved)?;
        let Loader { mut reader, shown } = self;
        migration::validate_memory(
            &mut reader,
            section::MEMORY,
            &layout::ram_ranges(saved.mem_bytes),
        )
        .map_err(|err| SnapshotError::Memory {
            path: shown.clone(),
            err,
        })?;
        Ok(Restore {
            state: VmState {
                manifest: saved,
                vm,
                vcpus,
                serial,
                rtc,
                pci,
                fw_cfg,
                devices,
            },
            memory: MemoryMode::Copy,
            reader,
            path: shown,
        })
    }

    fn invalid(&self, msg: String) -> SnapshotError {
        SnapshotError::Invalid {
            path: self.shown.clone(),
            msg,
        }
    }

    fn state<T: serde::de::DeserializeOwned>(&mut self, name: &str) -> Result<T, SnapshotError> {
        self.reader
            .read_state(name)
            .map_err(|err| SnapshotError::Format {
                path: self.shown.clone(),
                err,
            })
    }

    /// The saved manifest, checked against what is asked for and against
    /// what `tandem run` could have started (it came from a file).
    fn check_manifest(&self, saved: &Manifest, requested: &Manifest) -> Result<(), SnapshotError> {
        let notes = check_compatible(saved, requested).map_err(|err| SnapshotError::Mismatch {
            path: self.shown.clone(),
            err,
        })?;
        for n in notes {
            log::info!("restore: {n}");
        }
        let max = u32::from(config::max_cpus());
        if saved.vcpus == 0 || saved.vcpus > max {
            return Err(self.invalid(format!(
                "{} vCPUs (this host allows 1 to {max})",
                saved.vcpus
            )));
        }
        config::check_mem_fits(saved.mem_bytes, &format!("{}M", saved.mem_bytes >> 20))
            .map_err(|e| self.invalid(e.to_string()))?;
        if saved.mem_bytes < 16 << 20
            || !saved.mem_bytes.is_multiple_of(migration::memory::PAGE_SIZE)
        {
            return Err(self.invalid(format!("memory size {} bytes", saved.mem_bytes)));
        }
        Ok(())
    }

    /// The VM-wide state and each vCPU's, converted to KVM's structures.
    fn kvm_state(&mut self, vcpus: u32) -> Result<(KvmVmState, Vec<KvmVcpuState>), SnapshotError> {
        let state_err = |shown: &str, section: String| {
            let path = shown.to_string();
            move |err: KvmStateError| SnapshotError::State { path, section, err }
        };
        let vm_state: VmWideState = self.state(section::VM)?;
        let vm = vm_state
            .to_kvm()
            .map_err(state_err(&self.shown, section::VM.into()))?;
        let mut out = Vec::with_capacity(vcpus as usize);
        for id in 0..vcpus {
            let name = section::vcpu(id);
            let v: VcpuState = self.state(&name)?;
            if v.id != id {
                return Err(self.invalid(format!("section {name} holds vCPU {}", v.id)));
            }
            out.push(v.to_kvm().map_err(state_err(&self.shown, name))?);
        }
        Ok((vm, out))
    }

    /// The serial UART.
    fn serial(&mut self) -> Result<vm_superio::serial::SerialState, SnapshotError> {
        let dev = section::device(SERIAL_ID);
        match self.state::<DeviceState>(&dev)? {
            DeviceState::Serial(s) if s.in_buffer.len() <= UART_FIFO => {
                Ok(vm_superio::serial::SerialState::from(&s))
            }
            DeviceState::Serial(s) => Err(self.invalid(format!(
                "section {dev}: {} bytes in a {UART_FIFO}-byte FIFO",
                s.in_buffer.len()
            ))),
            _ => Err(self.invalid(format!("section {dev} is not a serial port"))),
        }
    }

    /// The state in section `dev.<id>`, if the file has one (a device
    /// added after the file's tandem).
    fn optional_device(&mut self, id: &str) -> Result<Option<DeviceState>, SnapshotError> {
        let dev = section::device(id);
        if self.reader.section(&dev).is_none() {
            return Ok(None);
        }
        self.state(&dev).map(Some)
    }

    /// The CMOS RTC, if the file has it.
    fn rtc(&mut self) -> Result<Option<RtcState>, SnapshotError> {
        let dev = section::device(RTC_ID);
        match self.optional_device(RTC_ID)? {
            None => Ok(None),
            Some(DeviceState::Rtc(s)) if s.ram.len() == CMOS_BYTES => Ok(Some(s)),
            Some(DeviceState::Rtc(s)) => Err(self.invalid(format!(
                "section {dev}: {} bytes of CMOS RAM, not {CMOS_BYTES}",
                s.ram.len()
            ))),
            Some(_) => Err(self.invalid(format!("section {dev} is not a CMOS RTC"))),
        }
    }

    /// fw_cfg, if the file has it.
    fn fw_cfg(&mut self) -> Result<Option<FwCfgState>, SnapshotError> {
        match self.optional_device(FW_CFG_ID)? {
            None => Ok(None),
            Some(DeviceState::FwCfg(s)) => Ok(Some(s)),
            Some(_) => Err(self.invalid(format!(
                "section {} is not fw_cfg",
                section::device(FW_CFG_ID)
            ))),
        }
    }

    /// PCI bus 0, which the file has if and only if its manifest lists the
    /// host bridge.
    fn pci(&mut self, saved: &Manifest) -> Result<Option<PciState>, SnapshotError> {
        if device_manager::machine_of(saved) != Machine::Pci {
            return Ok(None);
        }
        let dev = section::device(PCI_ID);
        match self.state::<DeviceState>(&dev)? {
            DeviceState::Pci(s) => {
                // The host bridge, the PM function, then the virtio
                // functions (each function 0 of its slot), in bus order.
                let mut slots: Vec<(u8, u8)> = [(0, 0), devices::pci::PM_FUNCTION]
                    .into_iter()
                    .chain(
                        saved
                            .devices
                            .iter()
                            .filter_map(DeviceConfig::pci_slot)
                            .map(|s| (s, 0)),
                    )
                    .collect();
                slots.sort_unstable();
                devices::pci::PciBus::check_shape(&s, &slots)
                    .map(|()| Some(s))
                    .map_err(|e| self.invalid(format!("section {dev}: {e}")))
            }
            _ => Err(self.invalid(format!("section {dev} is not a PCI bus"))),
        }
    }

    /// Each virtio device's state, in manifest order, of the kind the
    /// manifest lists and with its queues' shape checked.
    fn devices(&mut self, saved: &Manifest) -> Result<Vec<(String, DeviceState)>, SnapshotError> {
        let mut devices = Vec::new();
        for d in &saved.devices {
            let (id, net) = match d {
                DeviceConfig::Serial { .. } | DeviceConfig::PciHost { .. } => continue,
                DeviceConfig::Net { id, .. } => (id, true),
                DeviceConfig::Blk { id, .. } => (id, false),
            };
            let name = section::device(id);
            let state = self.state::<DeviceState>(&name)?;
            let transport = match &state {
                DeviceState::VirtioNet { transport, pci, .. } if net => (transport, pci),
                DeviceState::VirtioBlk { transport, pci, .. } if !net => (transport, pci),
                _ => {
                    return Err(self.invalid(format!(
                        "section {name} does not hold the {} the manifest lists",
                        d.describe()
                    )))
                }
            };
            let (transport, pci) = transport;
            if pci.is_some() != d.pci_slot().is_some() {
                return Err(self.invalid(format!(
                    "section {name}: the transport is not the one the manifest lists for {}",
                    d.describe()
                )));
            }
            check_queues(transport, if net { 2 } else { 1 })
                .map_err(|e| self.invalid(format!("section {name}: {e}")))?;
            devices.push((id.clone(), state));
        }
        Ok(devices)
    }
}

/// The shape of a saved transport: its queue count and each queue's
/// registers (the transport checks the rest against the device and guest
/// memory when it is restored).
fn check_queues(t: &MmioTransportState, count: usize) -> Result<(), String> {
    if t.queues.len() != count {
        return Err(format!("{} queues, the device has {count}", t.queues.len()));
    }
    for (i, q) in t.queues.iter().enumerate() {
        virtio_queue::Queue::try_from(virtio_queue::QueueState::from(q))
            .map_err(|e| format!("queue {i}: {e:?}"))?;
    }
    Ok(())
}

impl<R: Read + Seek> Restore<R> {
    pub(super) fn memory_error(&self, err: MemoryError) -> SnapshotError {
        SnapshotError::Memory {
            path: self.path.clone(),
            err,
        }
    }

    pub(super) fn invalid(&self, msg: String) -> SnapshotError {
        SnapshotError::Invalid {
            path: self.path.clone(),
            msg,
        }
    }

    /// Copies the stored pages into guest memory that is not fresh: the
    /// pages' CRC is checked first (so a damaged file leaves memory as it
    /// was), then every page is zeroed (the image leaves zero pages out).
    pub fn fill_memory_over(&mut self, mem: &GuestMemoryMmap) -> Result<ImageStats, SnapshotError> {
        let layout = layout::ram_ranges(self.state.manifest.mem_bytes);
        migration::memory::verify_pages(&mut self.reader, section::MEMORY, &layout)
            .map_err(|err| self.memory_error(err))?;
        let zeros = vec![0u8; 1 << 20];
        for (gpa, len) in layout::ram_ranges(self.state.manifest.mem_bytes) {
            let mut at = 0;
            while at < len {
                let n = (len - at).min(zeros.len() as u64) as usize;
                mem.write_slice(&zeros[..n], GuestAddress(gpa + at))
                    .map_err(|e| SnapshotError::Memory {
                        path: self.path.clone(),
                        err: MemoryError::Sink {
                            gpa: gpa + at,
                            source: Box::new(e),
                        },
                    })?;
                at += n as u64;
            }
        }
        self.fill_memory(mem)
    }

    /// Copies the stored pages into fresh (zeroed) guest memory (their CRC
    /// checked as they go).
    pub fn fill_memory(&mut self, mem: &GuestMemoryMmap) -> Result<ImageStats, SnapshotError> {
        self.read_memory(|gpa, bytes| mem.write_slice(bytes, GuestAddress(gpa)))
    }

    /// Hands the stored pages to `sink` as `(guest physical address,
    /// bytes)`, in ascending order, each chunk inside the VM's layout.
    pub fn read_memory<E>(
        &mut self,
        sink: impl FnMut(u64, &[u8]) -> Result<(), E>,
    ) -> Result<ImageStats, SnapshotError>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let layout = layout::ram_ranges(self.state.manifest.mem_bytes);
        migration::read_memory(&mut self.reader, section::MEMORY, &layout, sink).map_err(|err| {
            SnapshotError::Memory {
                path: self.path.clone(),
                err,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file with a manifest and whatever `more` writes after it.
    fn file_with(
        name: &str,
        m: &Manifest,
        more: impl FnOnce(&mut SnapshotWriter<BufWriter<File>>),
    ) -> PathBuf {
        let path = std::env::temp_dir().join(format!(
            "tandem-snapshot-unit-{}-{name}",
            std::process::id()
        ));
        let mut w = SnapshotWriter::new(BufWriter::new(File::create(&path).unwrap())).unwrap();
        w.write_state(section::MANIFEST, m).unwrap();
        more(&mut w);
        w.finish().unwrap();
        path
    }

    fn load_err(path: &Path, mem: Option<u64>, cpus: Option<u8>) -> String {
        let asked = Asked {
            mem,
            cpus,
            machine: None,
            nets: &[],
            firmware: None,
        };
        let e = load(path, asked, &mut []).err().expect("refused");
        let _ = std::fs::remove_file(path);
        e.to_string()
    }

    #[test]
    fn tmp_file_sits_next_to_the_target() {
        assert_eq!(
            tmp_path(Path::new("/a/b/vm.snap")),
            Path::new("/a/b/vm.snap.tmp")
        );
    }

    #[test]
    fn a_mismatch_is_refused_with_the_manifest_message() {
        let p = file_with(
            "mismatch",
            &manifest(128 << 20, 1, Machine::Legacy, vec![]),
            |_| {},
        );
        let e = load_err(&p, Some(256 << 20), None);
        assert!(
            e.contains("snapshot has 128 MiB of memory, this VM asks for 256 MiB"),
            "{e}"
        );
    }

    #[test]
    fn a_forged_vcpu_count_is_refused() {
        let p = file_with(
            "cpus",
            &manifest(128 << 20, 200, Machine::Legacy, vec![]),
            |_| {},
        );
        let e = load_err(&p, None, None);
        assert!(e.contains("200 vCPUs"), "{e}");
    }

    #[test]
    fn a_foreign_device_is_refused() {
        let mut m = manifest(128 << 20, 1, Machine::Legacy, vec![]);
        m.devices.push(DeviceConfig::Net {
            pci: None,
            id: "net0".into(),
            tap: "tap0".into(),
            mac: [2, 0, 0, 0, 0, 1],
            rsc: false,
            slot: migration::manifest::MmioSlot {
                base: 0xd000_0000,
                irq: 5,
            },
        });
        let p = file_with("net", &m, |_| {});
        let e = load_err(&p, None, None);
        assert!(e.contains("NIC net0"), "{e}");
    }

    #[test]
    fn a_bad_vm_section_is_refused_before_anything_is_built() {
        let p = file_with(
            "vm",
            &manifest(128 << 20, 1, Machine::Legacy, vec![]),
            |w| {
                let empty_chip = serde_json::json!({ "pic_master": [] });
                w.write_state(section::VM, &empty_chip).unwrap();
            },
        );
        let e = load_err(&p, None, None);
        assert!(
            e.contains("section \"vm\" does not decode: kvm_irqchip is 0 bytes, KVM takes 520"),
            "{e}"
        );
        let p = file_with(
            "vm-ids",
            &manifest(128 << 20, 1, Machine::Legacy, vec![]),
            |w| {
                w.write_state(section::VM, &VmWideState::default()).unwrap();
            },
        );
        let e = load_err(&p, None, None);
        assert!(
            e.contains("section vm: PIC slave state has chip id 0, KVM's is 1"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_section_is_refused() {
        let p = file_with(
            "missing",
            &manifest(128 << 20, 1, Machine::Legacy, vec![]),
            |_| {},
        );
        let e = load_err(&p, None, None);
        assert!(e.contains("no section \"vm\""), "{e}");
    }
}

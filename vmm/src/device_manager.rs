//! The VM's devices: where each one sits and how it is wired.
//!
//! Owns device placement (the legacy ports of COM1, the i8042 and the CMOS
//! RTC; one
//! virtio-mmio window and IRQ per virtio-mmio device, or one PCI slot per
//! virtio-pci device, NICs first, then disks, ids
//! `net0`, `net1`, ..., `blk0`, ...), the guest command-line announcement of
//! the virtio-mmio devices, the manifest's device list, and one path that
//! adds a virtio device whatever its kind and transport
//! ([`DeviceManager::add_virtio`]: interrupts, ioeventfds per queue,
//! transport on the MMIO or PCI bus, handler on the device event loop). It also saves and restores the virtio devices' state and
//! reports their counters. Pure placement is in `placement`; what a PCI
//! machine adds to the buses, in `pci_machine`.
//!
//! Built on the VMM thread before any vCPU runs ([`DeviceManager::finish`]
//! hands out the buses, read-only from then on and shared with the vCPU
//! threads, and the event loop for the device thread). Never blocks a
//! vCPU: each device has its own lock, taken for one register access.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use devices::acpi_pm::AcpiPm;
use devices::fw_cfg::{FwCfg, FW_CFG_PORT, FW_CFG_PORTS};
use devices::i8042::I8042;
use devices::pci::PciBus;
use devices::rtc::{MemorySizes, Rtc, RTC_PORT, RTC_PORTS};
use devices::serial::{Serial, COM1_IRQ, COM1_PORT, UART_PORTS};
use devices::virtio::block::backend::DiskBackend;
use devices::virtio::block::disk::DiskError;
use devices::virtio::block::metrics::BlockMetrics;
use devices::virtio::mmio::{
    Interrupt, MmioTransport, TransportStateError, MMIO_WINDOW, NOTIFY_OFFSET,
};
use devices::virtio::net::detached::Detached;
use devices::virtio::net::handler::{HandlerError, NetHandler};
use devices::virtio::net::metrics::NetMetrics;
use devices::virtio::net::tap::TapError;
use devices::virtio::net::{Net, NetConfig};
use devices::virtio::pci::{Hooks, PciTransport};
use devices::virtio::VirtioDevice;
use devices::{Bus, BusError, GuestMemoryMmap};
use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use kvm_ioctls::{IoEventAddress, VmFd};
use migration::devices::{BlkState, DeviceState, MmioTransportState, NetState, VirtioPciState};
use migration::{DeviceConfig, Snapshottable};
use vmm_sys_util::eventfd::EventFd;

use crate::boot::layout;
use crate::config::{self, DiskSpec, Machine, NetSpec};
use crate::console::ConsoleOut;
use crate::kvm_util::{kvm_op, KvmOp};
use crate::vstate::exit::ExitSignal;
use crate::vstate::exit_counts::ExitCounts;

mod disks;
mod msi;
mod pci_machine;
mod placement;
pub use disks::{DiskWrites, KeptDisk, WrapDisk};
use msi::{DeviceRoutes, GsiRouting, NotifyEvents};
use placement::pci_bar;
pub use placement::{machine_of, manifest, virtio_configs, virtio_slot};

const I8042_PORT: u64 = 0x60;
const I8042_PORTS: u64 = 5;
/// virtio-mmio devices take IRQs from here up to the last IOAPIC pin.
const VIRTIO_IRQ_BASE: u32 = 5;
const VIRTIO_IRQ_LAST: u32 = 23;
/// The id of the serial console in the manifest and its section.
pub const SERIAL_ID: &str = "com1";
/// The id of the PCI host bridge in the manifest and of the PCI bus's
/// section.
pub const PCI_ID: &str = "pci0";
/// The id of fw_cfg's section.
pub const FW_CFG_ID: &str = "fw_cfg";
/// The id of the CMOS RTC's section (it is not in the manifest: every VM
/// has one, like the PIT).
pub const RTC_ID: &str = "rtc";

/// The device event loop's subscribers.
pub type Subscribers = EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>;
/// The CMOS RTC, as the VM has it.
pub type RtcPort = Arc<Mutex<Rtc>>;
/// fw_cfg, as the VM has it.
pub type FwCfgPort = Arc<Mutex<FwCfg>>;
/// PCI bus 0, as a PCI machine has it.
pub type PciPort = Arc<Mutex<PciBus>>;
/// A PCI machine's ACPI PM1a block (shared with the port bus).
pub type AcpiPmPort = Arc<Mutex<AcpiPm>>;

/// The serial console, as the VM has it.
pub type SerialPort = Arc<Mutex<Serial<ConsoleOut<io::Stdout>>>>;

/// Device errors.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("too many devices: at most {0} virtio devices")]
    TooMany(u32),
    #[error("{0}: transport=pci needs a PCI machine (--machine pci)")]
    PciWithoutMachine(String),
    #[error(
        "{id}: on a PCI machine a virtio-mmio device needs an ISA IRQ other than 9 \
         (the ACPI SCI), 5 to 15; this one would get IRQ {irq} (it is device {number} \
         of --net then --disk): move it, or use transport=pci"
    )]
    MmioIrqOnAcpi { id: String, irq: u32, number: usize },
    #[error("{0}: no free PCI slot or interrupt route left")]
    PciFull(String),
    #[error("{id}: {source}")]
    PciSlot {
        id: String,
        source: devices::pci::PciBusError,
    },
    #[error("--net tap={tap}: {source}")]
    Tap { tap: String, source: TapError },
    #[error("--net tap={tap}: {source}")]
    NetHandler { tap: String, source: HandlerError },
    #[error("--disk: {source}")]
    Disk { path: String, source: DiskError },
    #[error("--disk {path}: {source}")]
    DiskSize { path: String, source: io::Error },
    #[error("{id}: its queues: {source:?}")]
    Queues {
        id: String,
        source: virtio_queue::Error,
    },
    #[error("device placement: {0}")]
    Bus(#[from] BusError),
    #[error(transparent)]
    Kvm(#[from] KvmOp),
    #[error("cannot create an eventfd: {0}")]
    EventFd(io::Error),
    #[error("device {id}: {source}")]
    State {
        id: String,
        source: TransportStateError,
    },
    #[error("device {id}: the saved state is of another kind of device")]
    StateKind { id: String },
    #[error("the serial port's saved state: {0}")]
    Serial(io::Error),
    #[error("the device event loop: {0:?}")]
    EventLoop(event_manager::Error),
}

fn eventfd() -> Result<EventFd, DeviceError> {
    EventFd::new(libc::EFD_NONBLOCK).map_err(DeviceError::EventFd)
}

/// How much of guest memory lies below and above 4 GiB (the RTC's
/// memory-size bytes).
fn memory_sizes(mem: &GuestMemoryMmap) -> MemorySizes {
    use vm_memory::{Address, GuestMemoryBackend, GuestMemoryRegion};
    let mut sizes = MemorySizes::default();
    for r in mem.iter() {
        if r.start_addr().raw_value() < 1 << 32 {
            sizes.below_4g += r.len();
        } else {
            sizes.above_4g += r.len();
        }
    }
    sizes
}

/// What a virtio device's handler and transport are given by the wiring.
pub struct Wiring {
    pub interrupt: Arc<Interrupt>,
    /// One per queue: signalled by the guest's notify (ioeventfd).
    pub queue_evts: Vec<EventFd>,
}

/// The parts of one virtio device, before they are wired in.
pub struct VirtioParts {
    pub device: Box<dyn VirtioDevice>,
    pub handler: Arc<Mutex<dyn MutEventSubscriber + Send>>,
    pub report: Report,
}

/// What the metrics say of one device.
pub enum Report {
    Net {
        tap: String,
        sndbuf: Option<u32>,
        counters: Arc<NetMetrics>,
        /// For the RSC counters (its lock is free between loop turns).
        handler: Arc<Mutex<NetHandler>>,
    },
    Disk {
        path: String,
        id: String,
        readonly: bool,
        counters: Arc<BlockMetrics>,
        /// For the lock's hand-over at a migration's switch-over.
        backend: Arc<dyn DiskBackend>,
        /// What is kept of its writes (for COLO).
        writes: disks::DiskWrites,
    },
}

/// A virtio device's transport, as the VM keeps it.
pub enum TransportHandle {
    Mmio(Arc<Mutex<MmioTransport>>),
    Pci(Arc<Mutex<PciTransport>>),
}

/// One virtio device as the VM keeps it.
pub struct VirtioSlot {
    pub config: DeviceConfig,
    pub transport: TransportHandle,
    report: Report,
    bad_accesses: Arc<AtomicU64>,
}

impl VirtioSlot {
    /// Its id in the manifest (`net0`, `blk0`, ...).
    pub fn id(&self) -> &str {
        self.config.id()
    }

    fn state_err(&self, source: TransportStateError) -> DeviceError {
        DeviceError::State {
            id: self.id().to_string(),
            source,
        }
    }

    /// The device's state (the VM must be paused).
    pub fn save(&self) -> Result<DeviceState, DeviceError> {
        let (transport, pci) = match &self.transport {
            TransportHandle::Mmio(t) => (devices::sync::lock(t).save(), None),
            TransportHandle::Pci(t) => {
                let t = devices::sync::lock(t);
                (t.save().map(|s| s.0), Some(t.save_pci()))
            }
        };
        let transport = transport.map_err(|source| self.state_err(source))?;
        let acked_features = transport.acked_features;
        Ok(match &self.config {
            DeviceConfig::Net { tap, mac, .. } => DeviceState::VirtioNet {
                transport,
                net: NetState {
                    mac: *mac,
                    acked_features,
                    tap: tap.clone(),
                },
                pci,
            },
            DeviceConfig::Blk {
                path,
                readonly,
                serial,
                ..
            } => DeviceState::VirtioBlk {
                transport,
                blk: BlkState {
                    path: path.clone(),
                    readonly: *readonly,
                    acked_features,
                    id: serial.clone(),
                },
                pci,
            },
            DeviceConfig::Serial { .. } | DeviceConfig::PciHost { .. } => {
                return Err(DeviceError::StateKind {
                    id: self.id().to_string(),
                })
            }
        })
    }

    /// Checks a saved transport state (`pci`: virtio-pci's part) against
    /// this device without applying anything (so a restore can refuse a
    /// file before it fills memory).
    pub fn check_transport(
        &self,
        t: &MmioTransportState,
        pci: Option<&VirtioPciState>,
    ) -> Result<(), DeviceError> {
        match (&self.transport, pci) {
            (TransportHandle::Mmio(m), None) => devices::sync::lock(m).check_state(t),
            (TransportHandle::Pci(p), Some(pci)) => devices::sync::lock(p).check_state(t, pci),
            _ => return Err(self.other_transport()),
        }
        .map_err(|source| self.state_err(source))
    }

    fn other_transport(&self) -> DeviceError {
        DeviceError::StateKind {
            id: self.id().to_string(),
        }
    }

    /// Puts a saved transport state back (the VM paused; a live device is
    /// reset and restarted on the saved queues).
    /// A NIC's self-announce (RARP from its MAC) out of its backend;
    /// `None` for a device that is not a NIC.
    pub fn announce(&self) -> Option<std::io::Result<usize>> {
        match (&self.config, &self.report) {
            (DeviceConfig::Net { mac, .. }, Report::Net { handler, .. }) => {
                Some(devices::sync::lock(handler).announce(*mac))
            }
            _ => None,
        }
    }

    /// Puts `backend` in place of this NIC's backend, waiting at most
    /// `wait` for the device loop to do it; returns the one taken out.
    /// `None` for a device that is not a NIC.
    pub fn swap_backend(
        &self,
        backend: Box<dyn devices::virtio::net::NetBackend>,
        wait: std::time::Duration,
    ) -> Option<Result<Box<dyn devices::virtio::net::NetBackend>, String>> {
        let Report::Net { tap, handler, .. } = &self.report else {
            return None;
        };
        let asked = devices::sync::lock(handler).replace_backend(backend);
        Some(match asked {
            Err(e) => Err(format!("tap {tap}: {}", e.source)),
            Ok(done) => match done.recv_timeout(wait) {
                Ok(Ok(old)) => Ok(old),
                Ok(Err(e)) => Err(format!("tap {tap}: {}", e.source)),
                Err(_) => Err(format!("tap {tap}: the device loop did not swap it in")),
            },
        })
    }

    /// The tap's name, for a NIC.
    pub fn tap(&self) -> Option<&str> {
        match &self.report {
            Report::Net { tap, .. } => Some(tap),
            _ => None,
        }
    }

    /// Opens this NIC's tap as its configuration says (`None`: not a
    /// NIC).
    pub fn open_tap(&self) -> Option<Result<Box<dyn devices::virtio::net::NetBackend>, String>> {
        let Report::Net { tap, sndbuf, .. } = &self.report else {
            return None;
        };
        let config = NetConfig {
            tap: tap.clone(),
            mac: [0; 6],
            sndbuf: *sndbuf,
            rsc: None,
        };
        Some(
            devices::virtio::net::device::open_tap(&config)
                .map(|t| Box::new(t) as Box<dyn devices::virtio::net::NetBackend>)
                .map_err(|e| format!("tap {tap}: {e}")),
        )
    }

    /// A COLO secondary's takeover: opens this NIC's tap and puts it in
    /// place of the backend it has, waiting at most `wait` for the device
    /// loop to do it; `None` for a device that is not a NIC.
    pub fn attach_tap(&self, wait: std::time::Duration) -> Option<Result<(), String>> {
        let opened = match self.open_tap()? {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        self.swap_backend(opened, wait).map(|r| r.map(drop))
    }

    pub fn restore_transport(
        &self,
        t: &MmioTransportState,
        pci: Option<&VirtioPciState>,
    ) -> Result<(), DeviceError> {
        match (&self.transport, pci) {
            (TransportHandle::Mmio(m), None) => devices::sync::lock(m).restore(t),
            (TransportHandle::Pci(p), Some(pci)) => devices::sync::lock(p).restore_all(t, pci),
            _ => return Err(self.other_transport()),
        }
        .map_err(|source| self.state_err(source))
    }
}

/// The VM's devices and buses, while they are being built.
pub struct DeviceManager {
    pio: Bus,
    mmio: Bus,
    subscribers: Subscribers,
    virtio: Vec<VirtioSlot>,
    serial: SerialPort,
    serial_irq: EventFd,
    rtc: RtcPort,
    pci: Option<PciPort>,
    acpi_pm: Option<AcpiPmPort>,
    fw_cfg: FwCfgPort,
    exit: Arc<ExitSignal>,
    mem: GuestMemoryMmap,
    vm: Arc<VmFd>,
    /// KVM's interrupt routes (virtio-pci's MSI-X vectors).
    routing: Arc<GsiRouting>,
    /// Open disk images without their lock (a migration's destination:
    /// the lock is taken at the switch-over).
    pub defer_disk_locks: bool,
    /// A COLO secondary's devices: NICs detached from their taps.
    pub secondary: bool,
    /// Serves each writable disk through another backend (a COLO
    /// secondary's replica: journal and overlay, until it takes over).
    pub wrap_disk: Option<WrapDisk>,
}

/// The VM's devices once built: the buses the vCPU threads share, guest
/// memory as the devices see it, and the devices themselves.
pub struct Devices {
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub mem: GuestMemoryMmap,
    pub virtio: Arc<[VirtioSlot]>,
    pub serial: SerialPort,
    pub rtc: RtcPort,
    pub pci: Option<PciPort>,
    /// A PCI machine's ACPI PM1a block.
    pub acpi_pm: Option<AcpiPmPort>,
    pub fw_cfg: FwCfgPort,
    serial_irq: EventFd,
    exit: Arc<ExitSignal>,
}

impl Devices {
    /// Puts the serial UART in a saved state (registers and unread FIFO
    /// bytes), raising its interrupt if that state has one pending.
    pub fn restore_serial(
        &self,
        state: &vm_superio::serial::SerialState,
    ) -> Result<(), DeviceError> {
        let irq = self.serial_irq.try_clone().map_err(DeviceError::EventFd)?;
        let out = ConsoleOut::new(io::stdout(), self.exit.clone());
        let uart = Serial::from_state(irq, out, state).map_err(DeviceError::Serial)?;
        *devices::sync::lock(&self.serial) = uart;
        Ok(())
    }
}

impl DeviceManager {
    /// The legacy devices (COM1 printing to this terminal; the i8042 for
    /// resets; the CMOS RTC on the host's wall clock; fw_cfg for firmware
    /// (memory map, CPU count); PCI bus 0 with its
    /// host bridge on a PCI machine) on a new port bus; virtio devices come
    /// with [`Self::add_all`].
    pub fn new(
        vm: Arc<VmFd>,
        mem: GuestMemoryMmap,
        machine: Machine,
        cpus: u8,
        exit: &Arc<ExitSignal>,
    ) -> Result<DeviceManager, DeviceError> {
        let serial_irq = eventfd()?;
        vm.register_irqfd(&serial_irq, COM1_IRQ)
            .map_err(kvm_op("register the serial interrupt"))?;
        let out = ConsoleOut::new(io::stdout(), exit.clone());
        let irq = serial_irq.try_clone().map_err(DeviceError::EventFd)?;
        let serial = Arc::new(Mutex::new(Serial::new(irq, out)));
        let mut pio = Bus::new();
        pio.insert(serial.clone(), COM1_PORT, UART_PORTS)?;
        let reset = exit.reset_evt().map_err(DeviceError::EventFd)?;
        pio.insert(
            Arc::new(Mutex::new(I8042::new(reset))),
            I8042_PORT,
            I8042_PORTS,
        )?;
        let sizes = memory_sizes(&mem);
        let rtc = Arc::new(Mutex::new(Rtc::new(sizes, devices::rtc::host_clock())));
        pio.insert(rtc.clone(), RTC_PORT, RTC_PORTS)?;
        let ram = layout::ram_ranges(sizes.below_4g + sizes.above_4g);
        let fw_cfg = Arc::new(Mutex::new(FwCfg::new(&ram, u16::from(cpus))));
        pio.insert(fw_cfg.clone(), FW_CFG_PORT, FW_CFG_PORTS)?;
        let mut mmio = Bus::new();
        let (pci, acpi_pm) = match machine {
            Machine::Legacy => (None, None),
            Machine::Pci => {
                let (bus, pm) = pci_machine::attach(&mut pio, &mut mmio, exit)?;
                (Some(bus), Some(pm))
            }
        };
        Ok(DeviceManager {
            pio,
            mmio,
            routing: GsiRouting::new(vm.clone()),
            subscribers: Subscribers::new().map_err(DeviceError::EventLoop)?,
            virtio: Vec::new(),
            serial,
            serial_irq,
            rtc,
            pci,
            acpi_pm,
            fw_cfg,
            exit: exit.clone(),
            mem,
            vm,
            defer_disk_locks: false,
            secondary: false,
            wrap_disk: None,
        })
    }

    /// Hands out the built devices, and the event loop of their handlers
    /// (for the device thread).
    pub fn finish(self) -> (Devices, Subscribers) {
        let devices = Devices {
            pio: Arc::new(self.pio),
            mmio: Arc::new(self.mmio),
            mem: self.mem,
            virtio: self.virtio.into(),
            serial: self.serial,
            serial_irq: self.serial_irq,
            rtc: self.rtc,
            pci: self.pci,
            acpi_pm: self.acpi_pm,
            fw_cfg: self.fw_cfg,
            exit: self.exit,
        };
        (devices, self.subscribers)
    }

    /// The `virtio_mmio.device=` parameters that announce the virtio
    /// devices to the guest, in bus order (the guest probes in that order).
    pub fn announcement(&self) -> String {
        self.virtio
            .iter()
            .filter_map(|v| v.config.slot())
            .map(|s| format!(" virtio_mmio.device=4K@{:#x}:{}", s.base, s.irq))
            .collect()
    }

    /// Adds the NIC and disks of `nets` and `disks` (whose manifest
    /// entries are `configs`, see [`virtio_configs`]).
    pub fn add_all(
        &mut self,
        nets: &[NetSpec],
        disks: &[DiskSpec],
        configs: Vec<DeviceConfig>,
    ) -> Result<(), DeviceError> {
        let mut configs = configs.into_iter();
        let detach = self.secondary;
        for (i, spec) in nets.iter().enumerate() {
            if let Some(c) = configs.next() {
                self.add_virtio(c, 2, |w| net_parts(spec, i, w, detach))?;
            }
        }
        let (defer, wrap) = (self.defer_disk_locks, self.wrap_disk);
        for spec in disks {
            if let Some(c) = configs.next() {
                self.add_virtio(c, 1, |w| disks::disk_parts(spec, w, defer, wrap))?;
            }
        }
        Ok(())
    }

    /// Wires a virtio device with `queues` queues into its slot: its
    /// interrupt, a queue-notify ioeventfd per queue, its transport on the
    /// MMIO or PCI bus and its handler on the device event loop.
    pub fn add_virtio(
        &mut self,
        config: DeviceConfig,
        queues: usize,
        build: impl FnOnce(Wiring) -> Result<VirtioParts, DeviceError>,
    ) -> Result<(), DeviceError> {
        if let Some(pci) = config.pci_slot() {
            return self.add_virtio_pci(config, pci, queues, build);
        }
        let slot = config.slot().ok_or_else(|| DeviceError::StateKind {
            id: config.id().to_string(),
        })?;
        let irq_evt = eventfd()?;
        self.vm
            .register_irqfd(&irq_evt, slot.irq)
            .map_err(kvm_op("register a virtio interrupt"))?;
        let interrupt = Arc::new(Interrupt::new(irq_evt));
        let mut queue_evts = Vec::with_capacity(queues);
        let mut transport_evts = Vec::with_capacity(queues);
        for q in 0..queues {
            let evt = eventfd()?;
            self.vm
                .register_ioevent(
                    &evt,
                    &IoEventAddress::Mmio(slot.base + NOTIFY_OFFSET),
                    q as u32,
                )
                .map_err(kvm_op("register a queue notification"))?;
            transport_evts.push(evt.try_clone().map_err(DeviceError::EventFd)?);
            queue_evts.push(evt);
        }
        let parts = build(Wiring {
            interrupt: interrupt.clone(),
            queue_evts,
        })?;
        let transport =
            MmioTransport::new(parts.device, self.mem.clone(), interrupt, transport_evts).map_err(
                |source| DeviceError::Queues {
                    id: config.id().to_string(),
                    source,
                },
            )?;
        let bad_accesses = transport.bad_accesses();
        let transport = Arc::new(Mutex::new(transport));
        self.mmio
            .insert(transport.clone(), slot.base, MMIO_WINDOW)?;
        self.subscribers.add_subscriber(parts.handler);
        self.virtio.push(VirtioSlot {
            config,
            transport: TransportHandle::Mmio(transport),
            report: parts.report,
            bad_accesses,
        });
        Ok(())
    }

    /// [`Self::add_virtio`] for a virtio-pci device at PCI slot `pci`: an
    /// irqfd on a GSI of its own per MSI-X vector (one per queue and one
    /// for configuration changes), routed as the guest programs them;
    /// queue-notify ioeventfds registered where the guest puts the BAR.
    fn add_virtio_pci(
        &mut self,
        config: DeviceConfig,
        pci: u8,
        queues: usize,
        build: impl FnOnce(Wiring) -> Result<VirtioParts, DeviceError>,
    ) -> Result<(), DeviceError> {
        let id = config.id().to_string();
        let bus = self
            .pci
            .clone()
            .ok_or_else(|| DeviceError::PciWithoutMachine(id.clone()))?;
        let vectors = queues + 1;
        let first = self
            .routing
            .allocate(vectors as u32)
            .ok_or_else(|| DeviceError::PciFull(id.clone()))?;
        let mut vector_evts = Vec::with_capacity(vectors);
        for v in 0..vectors {
            let evt = eventfd()?;
            self.vm
                .register_irqfd(&evt, first + v as u32)
                .map_err(kvm_op("register a virtio-pci vector"))?;
            vector_evts.push(evt);
        }
        let interrupt = Arc::new(Interrupt::msix(vector_evts, queues));
        let (mut queue_evts, mut transport_evts, mut notify_evts) = (vec![], vec![], vec![]);
        for _ in 0..queues {
            let evt = eventfd()?;
            transport_evts.push(evt.try_clone().map_err(DeviceError::EventFd)?);
            notify_evts.push(evt.try_clone().map_err(DeviceError::EventFd)?);
            queue_evts.push(evt);
        }
        let parts = build(Wiring {
            interrupt: interrupt.clone(),
            queue_evts,
        })?;
        let hooks = Hooks {
            routes: Box::new(DeviceRoutes {
                routing: self.routing.clone(),
                first,
            }),
            notify: Box::new(NotifyEvents {
                vm: self.vm.clone(),
                evts: notify_evts,
                at: None,
            }),
        };
        let transport = PciTransport::new(
            parts.device,
            self.mem.clone(),
            interrupt,
            transport_evts,
            pci_bar(pci),
            hooks,
        )
        .map_err(|source| DeviceError::Queues {
            id: id.clone(),
            source,
        })?;
        let bad_accesses = transport.bad_accesses();
        let transport = Arc::new(Mutex::new(transport));
        devices::sync::lock(&bus)
            .add(pci, transport.clone())
            .map_err(|source| DeviceError::PciSlot { id, source })?;
        self.subscribers.add_subscriber(parts.handler);
        self.virtio.push(VirtioSlot {
            config,
            transport: TransportHandle::Pci(transport),
            report: parts.report,
            bad_accesses,
        });
        Ok(())
    }
}

/// The device counters as JSON (what `--metrics` writes).
pub fn metrics_json(virtio: &[VirtioSlot], exits: &ExitCounts) -> serde_json::Value {
    let mut net = Vec::new();
    let mut blk = Vec::new();
    for v in virtio {
        let bad = v.bad_accesses.load(Ordering::Relaxed);
        match &v.report {
            Report::Net {
                tap,
                counters,
                handler,
                ..
            } => {
                let mut c = counters.snapshot();
                c.bad_register_accesses += bad;
                // `null` when RSC is off.
                let rsc = devices::sync::lock(handler).rsc_counters();
                net.push(serde_json::json!({ "tap": tap, "counters": c, "rsc": rsc }));
            }
            Report::Disk {
                path,
                id,
                readonly,
                counters,
                ..
            } => {
                let mut c = counters.snapshot();
                c.bad_register_accesses += bad;
                blk.push(serde_json::json!({
                    "path": path, "id": id, "readonly": readonly, "counters": c,
                }));
            }
        }
    }
    serde_json::json!({
        "net": net,
        "blk": blk,
        "emulation": crate::host_emu::emulation::counts(),
        "exits": exits.json(),
    })
}

/// A virtio-net device on the tap of `spec`; with `detach`, on a
/// [`Detached`] backend (the tap is only checked: opened and closed).
fn net_parts(
    spec: &NetSpec,
    index: usize,
    w: Wiring,
    detach: bool,
) -> Result<VirtioParts, DeviceError> {
    let activate = eventfd()?;
    let config = NetConfig {
        tap: spec.tap.clone(),
        mac: spec.mac.unwrap_or_else(|| config::default_mac(index)),
        sndbuf: spec.sndbuf,
        rsc: spec.rsc.then_some(spec.rsc_interval),
    };
    let tap_err = |source| DeviceError::Tap {
        tap: spec.tap.clone(),
        source,
    };
    let evt = activate.try_clone().map_err(DeviceError::EventFd)?;
    let net = if detach {
        drop(devices::virtio::net::device::open_tap(&config).map_err(tap_err)?);
        let backend = Detached::new(&spec.tap).map_err(DeviceError::EventFd)?;
        Net::with_backend(config, Box::new(backend), evt)
    } else {
        Net::new(config, evt).map_err(tap_err)?
    };
    let mut evts = w.queue_evts.into_iter();
    let (Some(rx), Some(tx)) = (evts.next(), evts.next()) else {
        return Err(DeviceError::EventFd(io::Error::other("two queues wanted")));
    };
    let counters = net.metrics.clone();
    let handler = NetHandler::new(
        net.state(),
        activate,
        [rx, tx],
        w.interrupt,
        counters.clone(),
        net.rsc_config(),
    )
    .map_err(|source| DeviceError::NetHandler {
        tap: spec.tap.clone(),
        source,
    })?;
    let handler = Arc::new(Mutex::new(handler));
    Ok(VirtioParts {
        device: Box::new(net),
        handler: handler.clone(),
        report: Report::Net {
            tap: spec.tap.clone(),
            sndbuf: spec.sndbuf,
            counters,
            handler,
        },
    })
}

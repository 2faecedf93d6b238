//! The state of tandem's emulated devices, as data: serial, CMOS RTC, PCI bus, fw_cfg,
//! virtio-mmio
//! transport and queues, virtio-net, virtio-blk.
//!
//! This module owns the serde shape of the `dev.<id>` state sections. Neither vm-superio's
//! `SerialState` nor virtio-queue's `QueueState` implements serde, so they are mirrored
//! here, with conversions both ways; a mirrored queue is still untrusted, and the devices
//! crate must rebuild its queue with `Queue::try_from(virtio_queue::QueueState)`, which
//! validates sizes and addresses. Backend facts (tap name, disk path) are recorded so that
//! a restore can tell what it is reattaching; the guest-visible configuration is checked
//! by [`crate::manifest`].

use serde::{Deserialize, Serialize};

/// The state of one device, tagged by kind: the body of a `dev.<id>` section.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum DeviceState {
    /// The 16550 serial console.
    Serial(SerialState),
    /// The CMOS real-time clock and its RAM.
    Rtc(RtcState),
    /// PCI bus 0 (configuration mechanism #1) and its functions.
    Pci(PciState),
    /// The firmware configuration interface (where the guest is in a read).
    FwCfg(FwCfgState),
    /// A virtio-net device behind its transport.
    VirtioNet {
        /// The transport's registers and queues.
        transport: MmioTransportState,
        /// The device's own state.
        net: NetState,
        /// What virtio-pci keeps beyond the common registers (absent for
        /// virtio-mmio).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pci: Option<VirtioPciState>,
    },
    /// A virtio-blk device behind its transport.
    VirtioBlk {
        /// The transport's registers and queues.
        transport: MmioTransportState,
        /// The device's own state.
        blk: BlkState,
        /// What virtio-pci keeps beyond the common registers (absent for
        /// virtio-mmio).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pci: Option<VirtioPciState>,
    },
}

/// The 16550 UART registers and pending input (mirror of `vm_superio::serial::SerialState`).
#[allow(missing_docs)]
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SerialState {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    /// Received bytes the guest has not read yet.
    #[serde(with = "crate::hex")]
    pub in_buffer: Vec<u8>,
}

impl From<&vm_superio::serial::SerialState> for SerialState {
    fn from(s: &vm_superio::serial::SerialState) -> Self {
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

impl From<&SerialState> for vm_superio::serial::SerialState {
    fn from(s: &SerialState) -> Self {
        vm_superio::serial::SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

/// The CMOS RTC: its 128 bytes of RAM, the index register, and where the guest set its
/// clock relative to the host's wall clock. A restored RTC keeps counting from the
/// host's clock of the restore, so a guest set to UTC reads the right time after any
/// pause, restore or migration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RtcState {
    /// The selected register (bits 0-6) and the NMI mask (bit 7), as last written to
    /// port 0x70.
    pub index: u8,
    /// The CMOS RAM, 128 bytes (the time registers in it hold only what a guest wrote
    /// while it had the clock stopped, `SET` in register B).
    #[serde(with = "crate::hex")]
    pub ram: Vec<u8>,
    /// Seconds the guest's clock runs ahead of the host's wall clock (negative:
    /// behind).
    pub offset_s: i64,
}

/// fw_cfg: the selected item and how far the guest has read it (the items themselves
/// follow from the VM's configuration).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FwCfgState {
    /// The selected item.
    pub selected: u16,
    /// The next byte of it a read returns.
    pub offset: u64,
}

/// PCI bus 0: the CONFIG_ADDRESS latch and each function's configuration space.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PciState {
    /// CONFIG_ADDRESS, as last written to port 0xCF8.
    pub address: u32,
    /// The functions on the bus, by slot.
    pub functions: Vec<PciFunctionState>,
    /// The ACPI PM1a enable register (PM1_EN) the guest wrote, shared by
    /// the fixed block and PIIX4's (absent in files from before tandem
    /// kept it: 0 then, as at power-on).
    #[serde(default, skip_serializing_if = "is_zero_u16")]
    pub pm1_enable: u16,
}

fn is_zero_u16(v: &u16) -> bool {
    *v == 0
}

/// One PCI function.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PciFunctionState {
    /// Its device number on bus 0.
    pub slot: u8,
    /// Its function number in the slot (absent for 0, as files before
    /// multi-function slots have it).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub function: u8,
    /// Its 256 bytes of configuration space (a restore takes only the bits the function
    /// lets a guest write).
    #[serde(with = "crate::hex")]
    pub config: Vec<u8>,
}

/// What a virtio-pci transport keeps beyond the registers every virtio
/// transport has ([`MmioTransportState`]); its configuration space (BAR,
/// command, MSI-X enable) is in the PCI bus's section.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtioPciState {
    /// The MSI-X vector of configuration changes (0xffff: none).
    pub config_vector: u16,
    /// Each queue's MSI-X vector.
    pub queue_vectors: Vec<u16>,
    /// The MSI-X table.
    pub msix: Vec<MsixEntryState>,
}

/// One MSI-X table entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MsixEntryState {
    /// Message address.
    pub address: u64,
    /// Message data.
    pub data: u32,
    /// The vector's mask bit.
    pub masked: bool,
    /// Its pending bit.
    pub pending: bool,
}

/// The registers every virtio transport has (named for virtio-mmio, the
/// first; virtio-pci's common configuration holds the same).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MmioTransportState {
    /// Device status (`VIRTIO_CONFIG_S_*` bits).
    pub status: u32,
    /// `DeviceFeaturesSel`.
    pub device_features_sel: u32,
    /// `DriverFeaturesSel`.
    pub driver_features_sel: u32,
    /// Features the driver acknowledged.
    pub acked_features: u64,
    /// `QueueSel`.
    pub queue_sel: u32,
    /// `InterruptStatus` (used-buffer and config-change bits) not yet acknowledged.
    pub interrupt_status: u32,
    /// `ConfigGeneration`.
    pub config_generation: u32,
    /// The device's queues, in index order.
    pub queues: Vec<QueueState>,
}

/// One virtqueue (mirror of `virtio_queue::QueueState`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueState {
    /// The largest size the device offers.
    pub max_size: u16,
    /// The size the driver chose.
    pub size: u16,
    /// `QueueReady`.
    pub ready: bool,
    /// Guest physical address of the descriptor table.
    pub desc_table: u64,
    /// Guest physical address of the available ring.
    pub avail_ring: u64,
    /// Guest physical address of the used ring.
    pub used_ring: u64,
    /// The next available-ring index the device will read.
    pub next_avail: u16,
    /// The next used-ring index the device will write.
    pub next_used: u16,
    /// `VIRTIO_F_RING_EVENT_IDX` negotiated.
    pub event_idx_enabled: bool,
}

impl From<&virtio_queue::QueueState> for QueueState {
    fn from(q: &virtio_queue::QueueState) -> Self {
        QueueState {
            max_size: q.max_size,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx_enabled: q.event_idx_enabled,
        }
    }
}

impl From<&QueueState> for virtio_queue::QueueState {
    fn from(q: &QueueState) -> Self {
        virtio_queue::QueueState {
            max_size: q.max_size,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx_enabled: q.event_idx_enabled,
        }
    }
}

/// virtio-net's own state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetState {
    /// The guest-visible MAC address.
    #[serde(with = "crate::hex::mac")]
    pub mac: [u8; 6],
    /// Features the driver acknowledged (also in the transport; kept for the device).
    pub acked_features: u64,
    /// The tap the device was attached to when saved.
    pub tap: String,
}

/// virtio-blk's own state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlkState {
    /// The disk image the device was attached to when saved.
    pub path: String,
    /// Whether the guest sees the disk read-only.
    pub readonly: bool,
    /// Features the driver acknowledged.
    pub acked_features: u64,
    /// The id string answered to `VIRTIO_BLK_T_GET_ID`.
    pub id: String,
}

fn is_zero(v: &u8) -> bool {
    *v == 0
}

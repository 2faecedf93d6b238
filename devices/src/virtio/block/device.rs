//! The virtio-blk device: features, configuration space (capacity, limits)
//! and activation. Requests are served in `handler` on the VMM thread;
//! activation (on a vCPU thread) hands it the queue through `BlockState`.

use std::sync::{Arc, Mutex};

use crate::GuestMemoryMmap;
use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

use super::backend::DiskBackend;
use super::disk::{ID_BYTES, SECTOR_SIZE};
use super::features::{self, DISCARD, FLUSH, RO, WRITE_ZEROES};
use super::metrics::BlockMetrics;
use super::request::{MAX_RANGE_SECTORS, MAX_SEGMENTS};
use crate::virtio::{read_config_space, ActivateError, VirtioDevice, VIRTIO_RING_F_EVENT_IDX};

/// Virtio device id of a block device.
pub const TYPE_BLOCK: u32 = 2;
/// Size of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Data segments per request (`seg_max`): what a chain of the whole queue
/// can hold besides the header and the status byte.
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// Discard granularity, in sectors (4 KiB, the usual host block).
const DISCARD_ALIGNMENT: u32 = 8;
/// Length of the configuration space we fill (up to write_zeroes_may_unmap).
const CONFIG_LEN: usize = 60;

/// What the user asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockConfig {
    /// The device id the guest reads (`/sys/block/vdX/serial`), padded
    /// with NULs to 20 bytes.
    pub id: [u8; ID_BYTES],
}

impl BlockConfig {
    /// A config whose id is `id`, cut at 20 bytes.
    pub fn with_id(id: &str) -> Self {
        let mut b = [0u8; ID_BYTES];
        let n = id.len().min(ID_BYTES);
        b[..n].copy_from_slice(&id.as_bytes()[..n]);
        BlockConfig { id: b }
    }
}

/// State shared between the device (activation, reset) and its handler.
#[derive(Default)]
pub struct BlockState {
    /// Set on activation, cleared on reset.
    pub active: Option<Active>,
}

/// A running device's queue and negotiated features.
pub struct Active {
    pub queue: Queue,
    pub mem: GuestMemoryMmap,
    pub acked: u64,
}

/// The virtio-blk device.
pub struct Block {
    config: BlockConfig,
    disk: Arc<dyn DiskBackend>,
    state: Arc<Mutex<BlockState>>,
    activate_evt: EventFd,
    pub metrics: Arc<BlockMetrics>,
}

impl Block {
    /// A device on `disk`. `activate_evt` is written when the driver starts
    /// the device.
    pub fn new(
        config: BlockConfig,
        disk: impl DiskBackend + 'static,
        activate_evt: EventFd,
    ) -> Block {
        Self::shared(config, Arc::new(disk), activate_evt)
    }

    /// A device on `disk`, which its owner also keeps (a COLO secondary's
    /// replicated disk, fed by the replication stream too).
    pub fn shared(config: BlockConfig, disk: Arc<dyn DiskBackend>, activate_evt: EventFd) -> Block {
        Block {
            config,
            disk,
            state: Arc::new(Mutex::new(BlockState::default())),
            activate_evt,
            metrics: Arc::new(BlockMetrics::default()),
        }
    }

    /// The storage, shared with the handler.
    pub fn disk(&self) -> Arc<dyn DiskBackend> {
        self.disk.clone()
    }

    /// The state, shared with the handler.
    pub fn state(&self) -> Arc<Mutex<BlockState>> {
        self.state.clone()
    }

    /// The device id.
    pub fn id(&self) -> [u8; ID_BYTES] {
        self.config.id
    }

    fn config_bytes(&self) -> [u8; CONFIG_LEN] {
        let mut c = [0u8; CONFIG_LEN];
        let mut put = |at: usize, v: &[u8]| c[at..at + v.len()].copy_from_slice(v);
        put(0, &(self.disk.size() / SECTOR_SIZE).to_le_bytes()); // capacity
        put(12, &SEG_MAX.to_le_bytes()); // seg_max
        put(20, &512u32.to_le_bytes()); // blk_size (not offered: informative)
        put(34, &1u16.to_le_bytes()); // num_queues
        put(36, &MAX_RANGE_SECTORS.to_le_bytes()); // max_discard_sectors
        put(40, &MAX_SEGMENTS.to_le_bytes()); // max_discard_seg
        put(44, &DISCARD_ALIGNMENT.to_le_bytes()); // discard_sector_alignment
        put(48, &MAX_RANGE_SECTORS.to_le_bytes()); // max_write_zeroes_sectors
        put(52, &MAX_SEGMENTS.to_le_bytes()); // max_write_zeroes_seg
        put(56, &[1]); // write_zeroes_may_unmap
        c
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        TYPE_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        let base = features::SEG_MAX | FLUSH | VIRTIO_RING_F_EVENT_IDX;
        if self.disk.readonly() {
            base | RO
        } else {
            base | DISCARD | WRITE_ZEROES
        }
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_space(&self.config_bytes(), offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // Only `writeback` is writable, and only with CONFIG_WCE (not offered).
        BlockMetrics::add(&self.metrics.bad_register_accesses, 1);
    }

    fn activate(
        &mut self,
        acked: u64,
        mut queues: Vec<Queue>,
        mem: GuestMemoryMmap,
    ) -> Result<(), ActivateError> {
        ActivateError::check_queue_count(&queues, 1)?;
        let queue = queues.pop().ok_or(ActivateError::BadQueue(0))?;
        crate::sync::lock(&self.state).active = Some(Active { queue, mem, acked });
        self.activate_evt.write(1).map_err(ActivateError::Notify)
    }

    fn reset(&mut self) {
        crate::sync::lock(&self.state).active = None;
    }

    fn queue_states(&self) -> Option<Vec<virtio_queue::QueueState>> {
        let state = crate::sync::lock(&self.state);
        Some(vec![state.active.as_ref()?.queue.state()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::block::disk::tests::disk;

    fn block(readonly: bool) -> Block {
        let (d, _raw) = disk(1 << 20, 0, readonly);
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        Block::new(BlockConfig::with_id("a-very-long-disk-name-cut"), d, evt)
    }

    fn cfg(b: &Block, at: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        b.read_config(at, &mut v);
        v
    }

    #[test]
    fn features_follow_readonly() {
        let rw = block(false);
        assert_eq!(rw.features() & RO, 0);
        assert_ne!(rw.features() & (DISCARD | WRITE_ZEROES | FLUSH), 0);
        let ro = block(true);
        assert_ne!(ro.features() & RO, 0);
        assert_eq!(ro.features() & (DISCARD | WRITE_ZEROES), 0);
        assert_eq!(&rw.id(), b"a-very-long-disk-nam");
    }

    #[test]
    fn config_space() {
        let b = block(false);
        assert_eq!(cfg(&b, 0, 8), 2048u64.to_le_bytes());
        assert_eq!(cfg(&b, 12, 4), SEG_MAX.to_le_bytes());
        assert_eq!(cfg(&b, 40, 4), MAX_SEGMENTS.to_le_bytes());
        // Byte-wise reads, reads past the end and at absurd offsets are 0s.
        assert_eq!(cfg(&b, 1, 1), [8]);
        assert_eq!(cfg(&b, 58, 4), [0, 0, 0, 0]);
        assert_eq!(cfg(&b, u64::MAX, 4), [0, 0, 0, 0]);
        let mut b = b;
        b.write_config(32, &[1]);
        assert_eq!(
            b.metrics.snapshot().bad_register_accesses,
            1,
            "config writes are refused and counted"
        );
    }
}

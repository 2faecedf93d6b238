//! A virtio device for transport unit tests: it records what the
//! transport did to it (starts with features and queues, resets, config
//! writes) and can be told to refuse to start.

use std::sync::{Arc, Mutex};

use virtio_queue::Queue;

use crate::virtio::{ActivateError, VirtioDevice};
use crate::GuestMemoryMmap;

#[derive(Default)]
pub(crate) struct Seen {
    pub(crate) activated: Option<(u64, usize)>,
    /// The queues as activated (what `queue_states` reports).
    pub(crate) live: Option<Vec<virtio_queue::QueueState>>,
    /// Successful activations so far.
    pub(crate) starts: u32,
    /// The next activations fail (as a device that cannot start).
    pub(crate) refuse: bool,
    pub(crate) resets: u32,
    pub(crate) config: Vec<u8>,
}

pub(crate) struct Dummy(pub(crate) Arc<Mutex<Seen>>);

impl VirtioDevice for Dummy {
    fn device_type(&self) -> u32 {
        1
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[256, 256]
    }
    fn features(&self) -> u64 {
        1 << 5 // VIRTIO_NET_F_MAC
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = (offset as u8).wrapping_add(i as u8);
        }
    }
    fn write_config(&mut self, _offset: u64, data: &[u8]) {
        self.0.lock().unwrap().config.extend_from_slice(data);
    }
    fn activate(
        &mut self,
        acked: u64,
        queues: Vec<Queue>,
        _mem: GuestMemoryMmap,
    ) -> Result<(), ActivateError> {
        let mut seen = self.0.lock().unwrap();
        if seen.refuse {
            return Err(ActivateError::QueueCount {
                wanted: 0,
                got: queues.len(),
            });
        }
        seen.starts += 1;
        seen.activated = Some((acked, queues.len()));
        seen.live = Some(queues.iter().map(|q| q.state()).collect());
        Ok(())
    }
    fn reset(&mut self) {
        let mut seen = self.0.lock().unwrap();
        seen.resets += 1;
        seen.live = None;
    }
    fn queue_states(&self) -> Option<Vec<virtio_queue::QueueState>> {
        self.0.lock().unwrap().live.clone()
    }
}

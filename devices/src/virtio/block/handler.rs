//! virtio-blk's event-loop glue (VMM thread): on each queue notification,
//! serve every request the guest made available, return it as used, and
//! raise the interrupt once per batch when the driver wants it (EVENT_IDX).
//!
//! Runtime events are registered only once the driver activates the device.
//! A hostile ring (an available index more than a queue ahead) ends the
//! batch instead of spinning ([`drain`]): the VMM thread is never held by a
//! guest.

use std::sync::{Arc, Mutex};

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use vm_memory::Bytes;
use vmm_sys_util::eventfd::EventFd;

use super::backend::DiskBackend;
use super::device::BlockState;
use super::disk::ID_BYTES;
use super::metrics::BlockMetrics;
use super::request::{self, Request};
use crate::virtio::drain::{drain, Served};
use crate::virtio::mmio::Interrupt;

const ACTIVATE: u32 = 0;
const QUEUE: u32 = 1;

/// The handler of one device.
pub struct BlockHandler {
    state: Arc<Mutex<BlockState>>,
    disk: Arc<dyn DiskBackend>,
    id: [u8; ID_BYTES],
    activate_evt: EventFd,
    queue_evt: EventFd,
    interrupt: Arc<Interrupt>,
    metrics: Arc<BlockMetrics>,
    registered: bool,
}

impl BlockHandler {
    /// A handler for the device whose shared parts these are.
    pub fn new(
        state: Arc<Mutex<BlockState>>,
        disk: Arc<dyn DiskBackend>,
        id: [u8; ID_BYTES],
        activate_evt: EventFd,
        queue_evt: EventFd,
        interrupt: Arc<Interrupt>,
        metrics: Arc<BlockMetrics>,
    ) -> Self {
        BlockHandler {
            state,
            disk,
            id,
            activate_evt,
            queue_evt,
            interrupt,
            metrics,
            registered: false,
        }
    }

    fn name(&self) -> &str {
        self.disk.name()
    }

    /// Serves what the guest queued. Returns the number of chains returned.
    pub fn process_queue(&mut self) -> usize {
        let mut state = crate::sync::lock(&self.state);
        let Some(active) = state.active.as_mut() else {
            return 0;
        };
        let (disk, id, metrics) = (&*self.disk, &self.id, &*self.metrics);
        let (mem, acked) = (&active.mem, active.acked);
        let r = drain(&mut active.queue, mem, |chain| {
            let head = chain.head_index();
            Served::Used(match Request::parse(chain, mem) {
                Ok(req) => {
                    let c = request::execute(&req, mem, disk, acked, id);
                    metrics.record(c.outcome);
                    c.used_len
                }
                Err(rejected) => {
                    log::debug!(
                        "virtio-blk {}: bad chain {head}: {}",
                        disk.name(),
                        rejected.error
                    );
                    BlockMetrics::add(&metrics.malformed_chains, 1);
                    match rejected.status {
                        Some(at) if mem.write_obj(request::status::IOERR, at).is_ok() => 1,
                        _ => 0,
                    }
                }
            })
        });
        if r.faults > 0 {
            log::debug!("virtio-blk {}: bad available ring", self.name());
            BlockMetrics::add(&self.metrics.malformed_chains, r.faults);
        }
        if r.notify {
            self.interrupt.trigger_queue(0);
        }
        r.used
    }

    fn register_runtime(&mut self, ops: &mut EventOps) {
        if self.registered {
            return;
        }
        if let Err(e) = ops.add(Events::with_data(&self.queue_evt, QUEUE, EventSet::IN)) {
            log::error!("virtio-blk {}: cannot register events: {e:?}", self.name());
        }
        self.registered = true;
    }
}

impl MutEventSubscriber for BlockHandler {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::with_data(
            &self.activate_evt,
            ACTIVATE,
            EventSet::IN,
        )) {
            log::error!("virtio-blk {}: cannot register: {e:?}", self.name());
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            ACTIVATE => {
                let _ = self.activate_evt.read();
                self.register_runtime(ops);
                self.process_queue();
            }
            QUEUE => {
                let _ = self.queue_evt.read();
                self.process_queue();
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;
    use crate::virtio::block::backend::tests::MemDisk;
    use crate::virtio::block::device::Active;
    use crate::virtio::block::disk::tests::disk;
    use crate::virtio::block::request::{kind, status};
    use crate::virtio::test_util::{Driver, DATA};

    fn handler(d: &Driver, readonly: bool) -> (BlockHandler, EventFd, std::fs::File) {
        let (dk, raw) = disk(64 << 10, 0x5a, readonly);
        let (h, irq) = handler_on(d, Arc::new(dk));
        (h, irq, raw)
    }

    fn handler_on(d: &Driver, disk: Arc<dyn DiskBackend>) -> (BlockHandler, EventFd) {
        let state = Arc::new(Mutex::new(BlockState {
            active: Some(Active {
                queue: d.queue(),
                mem: d.mem.clone(),
                acked: 0,
            }),
        }));
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let h = BlockHandler::new(
            state,
            disk,
            *b"handler-test-id\0\0\0\0\0",
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            Arc::new(Interrupt::new(irq.try_clone().unwrap())),
            Arc::new(BlockMetrics::default()),
        );
        (h, irq)
    }

    fn header(d: &Driver, at: u64, k: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&k.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        d.write(at, &h);
    }

    #[test]
    fn a_batch_is_served_counted_and_signalled_once() {
        let mut d = Driver::new(32);
        let (mut h, irq, raw) = handler(&d, false);
        // A read, a write, a flush, an id, an unknown type, one out of range,
        // and two malformed chains (one with a status byte, one without).
        header(&d, DATA, kind::IN, 0);
        d.add_chain(&[
            (DATA, 16, false),
            (DATA + 0x1000, 1024, true),
            (DATA + 0x100, 1, true),
        ]);
        header(&d, DATA + 0x200, kind::OUT, 4);
        d.write(DATA + 0x2000, &[0xc3; 512]);
        d.add_chain(&[
            (DATA + 0x200, 16, false),
            (DATA + 0x2000, 512, false),
            (DATA + 0x101, 1, true),
        ]);
        header(&d, DATA + 0x300, kind::FLUSH, 0);
        d.add_chain(&[(DATA + 0x300, 16, false), (DATA + 0x102, 1, true)]);
        header(&d, DATA + 0x400, kind::GET_ID, 0);
        d.add_chain(&[
            (DATA + 0x400, 16, false),
            (DATA + 0x3000, 20, true),
            (DATA + 0x103, 1, true),
        ]);
        header(&d, DATA + 0x500, 77, 0);
        d.add_chain(&[(DATA + 0x500, 16, false), (DATA + 0x104, 1, true)]);
        header(&d, DATA + 0x600, kind::IN, 1 << 40);
        d.add_chain(&[
            (DATA + 0x600, 16, false),
            (DATA + 0x4000, 512, true),
            (DATA + 0x105, 1, true),
        ]);
        d.add_chain(&[(DATA + 0x700, 8, false), (DATA + 0x106, 1, true)]);
        d.add_chain(&[(DATA + 0x800, 16, false)]);
        d.write(DATA + 0x100, &[0xff; 8]);

        assert_eq!(h.process_queue(), 8);
        assert_eq!(
            d.used(),
            vec![
                (0, 1025),
                (3, 1),
                (6, 1),
                (8, 21),
                (11, 1),
                (13, 1),
                (16, 1),
                (18, 0)
            ]
        );
        assert_eq!(
            d.read(DATA + 0x100, 8),
            vec![
                status::OK,
                status::OK,
                status::OK,
                status::OK,
                status::UNSUPP,
                status::IOERR,
                status::IOERR,
                0xff
            ]
        );
        assert_eq!(d.read(DATA + 0x1000, 1024), vec![0x5a; 1024]);
        assert_eq!(&d.read(DATA + 0x3000, 20)[..15], b"handler-test-id");
        let mut b = [0u8; 512];
        raw.read_exact_at(&mut b, 2048).unwrap();
        assert_eq!(b, [0xc3; 512]);
        let m = h.metrics.snapshot();
        assert_eq!(
            (m.reads, m.read_bytes, m.writes, m.write_bytes),
            (1, 1024, 1, 512)
        );
        assert_eq!(
            (m.flushes, m.get_ids, m.unsupported, m.io_errors),
            (1, 1, 1, 1)
        );
        assert_eq!(m.malformed_chains, 2);
        assert_eq!(irq.read().unwrap(), 1, "one interrupt for the batch");
        assert_eq!(h.process_queue(), 0);
    }

    #[test]
    fn a_readonly_disk_answers_writes_with_ioerr() {
        let mut d = Driver::new(16);
        let (mut h, _irq, raw) = handler(&d, true);
        header(&d, DATA, kind::OUT, 0);
        d.write(DATA + 0x1000, &[0; 4096]);
        d.add_chain(&[
            (DATA, 16, false),
            (DATA + 0x1000, 4096, false),
            (DATA + 0x100, 1, true),
        ]);
        assert_eq!(h.process_queue(), 1);
        assert_eq!(d.read(DATA + 0x100, 1), vec![status::IOERR]);
        let mut b = vec![0u8; 64 << 10];
        raw.read_exact_at(&mut b, 0).unwrap();
        assert!(b.iter().all(|&x| x == 0x5a));
        assert_eq!(h.metrics.snapshot().io_errors, 1);
    }

    #[test]
    fn a_hostile_available_index_does_not_hold_the_thread() {
        let d = Driver::new(16);
        let (mut h, _irq, _raw) = handler(&d, false);
        // avail.idx = 1000: far more than a queue's worth.
        d.set_avail_idx(1000);
        assert_eq!(h.process_queue(), 0);
        assert_eq!(h.metrics.snapshot().malformed_chains, 1);
    }

    #[test]
    fn any_backend_serves_the_requests() {
        let mut d = Driver::new(16);
        let mem_disk = Arc::new(MemDisk::new(8 << 10, 0x77, false));
        let (mut h, irq) = handler_on(&d, mem_disk.clone());
        // A write of sector 2, a read of sectors 1-2, a flush, and a read
        // past the end.
        header(&d, DATA, kind::OUT, 2);
        d.write(DATA + 0x1000, &[0x42; 512]);
        d.add_chain(&[
            (DATA, 16, false),
            (DATA + 0x1000, 512, false),
            (DATA + 0x100, 1, true),
        ]);
        header(&d, DATA + 0x200, kind::IN, 1);
        d.add_chain(&[
            (DATA + 0x200, 16, false),
            (DATA + 0x2000, 1024, true),
            (DATA + 0x101, 1, true),
        ]);
        header(&d, DATA + 0x300, kind::FLUSH, 0);
        d.add_chain(&[(DATA + 0x300, 16, false), (DATA + 0x102, 1, true)]);
        header(&d, DATA + 0x400, kind::IN, 16);
        d.add_chain(&[
            (DATA + 0x400, 16, false),
            (DATA + 0x3000, 512, true),
            (DATA + 0x103, 1, true),
        ]);
        assert_eq!(h.process_queue(), 4);
        assert_eq!(
            d.read(DATA + 0x100, 4),
            [status::OK, status::OK, status::OK, status::IOERR]
        );
        let got = d.read(DATA + 0x2000, 1024);
        assert_eq!(&got[..512], &[0x77; 512][..]);
        assert_eq!(&got[512..], &[0x42; 512][..]);
        assert_eq!(
            &mem_disk.bytes.lock().unwrap()[1024..1536],
            &[0x42; 512][..]
        );
        assert_eq!(*mem_disk.flushes.lock().unwrap(), 1);
        assert_eq!(irq.read().unwrap(), 1);
    }

    #[test]
    fn nothing_happens_before_activation() {
        let d = Driver::new(16);
        let (mut h, irq, _raw) = handler(&d, false);
        crate::sync::lock(&h.state).active = None;
        assert_eq!(h.process_queue(), 0);
        assert!(irq.read().is_err(), "no interrupt");
    }
}

use std::sync::Mutex;

use vm_memory::GuestAddress;

use super::*;
use crate::virtio::{status, INT_CONFIG, VIRTIO_F_VERSION_1};
use std::sync::atomic::Ordering;

pub(super) use crate::virtio::test_device::{Dummy, Seen};

pub(super) fn transport() -> (MmioTransport, Arc<Mutex<Seen>>, Vec<EventFd>) {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let evts: Vec<EventFd> = (0..2)
        .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
        .collect();
    let clones = evts.iter().map(|e| e.try_clone().unwrap()).collect();
    let t = MmioTransport::new(
        Box::new(Dummy(seen.clone())),
        mem,
        Arc::new(Interrupt::new(irq)),
        clones,
    )
    .unwrap();
    (t, seen, evts)
}

pub(super) fn r(t: &mut MmioTransport, off: u64) -> u32 {
    let mut b = [0u8; 4];
    t.read(off, &mut b);
    u32::from_le_bytes(b)
}

pub(super) fn w(t: &mut MmioTransport, off: u64, v: u32) {
    t.write(off, &v.to_le_bytes());
}

pub(super) fn setup_queue(t: &mut MmioTransport, sel: u32, base: u64) {
    w(t, 0x30, sel);
    assert_eq!(r(t, 0x34), 256);
    w(t, 0x38, 256);
    w(t, 0x80, base as u32);
    w(t, 0x84, 0);
    w(t, 0x90, (base + 0x1000) as u32);
    w(t, 0x94, 0);
    w(t, 0xa0, (base + 0x2000) as u32);
    w(t, 0xa4, 0);
    w(t, 0x44, 1);
}

#[test]
fn identity_registers() {
    let (mut t, _, _) = transport();
    assert_eq!(r(&mut t, 0x0), MAGIC);
    assert_eq!(r(&mut t, 0x4), 2);
    assert_eq!(r(&mut t, 0x8), 1);
    w(&mut t, 0x14, 1);
    assert_eq!(r(&mut t, 0x10), 1, "VERSION_1 in the high page");
    w(&mut t, 0x14, 0);
    assert_eq!(r(&mut t, 0x10), 1 << 5);
    let mut cfg = [0u8; 2];
    t.read(0x104, &mut cfg);
    assert_eq!(cfg, [4, 5]);
}

/// What a driver does up to DRIVER_OK: features (MAC and VERSION_1),
/// FEATURES_OK, both queues.
pub(super) fn start_device(t: &mut MmioTransport) {
    w(t, 0x70, status::ACKNOWLEDGE);
    w(t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
    w(t, 0x24, 0);
    w(t, 0x20, 1 << 5);
    w(t, 0x24, 1);
    w(t, 0x20, 1);
    let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
    w(t, 0x70, s);
    assert_eq!(r(t, 0x70), s);
    setup_queue(t, 0, 0x10000);
    setup_queue(t, 1, 0x20000);
    w(t, 0x70, s | status::DRIVER_OK);
}

#[test]
fn full_negotiation_activates_the_device() {
    let (mut t, seen, evts) = transport();
    start_device(&mut t);
    assert_eq!(
        seen.lock().unwrap().activated,
        Some(((1 << 5) | VIRTIO_F_VERSION_1, 2))
    );
    // A notify that reaches the transport signals the queue's eventfd.
    w(&mut t, 0x50, 1);
    assert_eq!(evts[1].read().unwrap(), 1);
    w(&mut t, 0x50, 7);
    assert_eq!(t.bad_accesses().load(Ordering::Relaxed), 1);
    // Reset.
    w(&mut t, 0x70, 0);
    assert_eq!(r(&mut t, 0x70), 0);
    assert_eq!(seen.lock().unwrap().resets, 1);
}

#[test]
fn hostile_accesses_are_counted_and_ignored() {
    let (mut t, seen, _) = transport();
    let bad = t.bad_accesses();
    // Offered features only, and VERSION_1 is required.
    w(&mut t, 0x70, status::ACKNOWLEDGE);
    w(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
    w(&mut t, 0x20, 1 << 7);
    w(
        &mut t,
        0x70,
        status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
    );
    assert_eq!(r(&mut t, 0x70) & status::FEATURES_OK, 0);
    // Queue set-up before FEATURES_OK.
    w(&mut t, 0x38, 16);
    // Odd widths and offsets.
    t.write(0x30, &[1]);
    t.write(0x31, &[1, 2, 3, 4]);
    let mut b = [0xffu8; 2];
    t.read(0x0, &mut b);
    assert_eq!(b, [0, 0]);
    assert_eq!(r(&mut t, 0xf0), 0);
    w(&mut t, 0xf0, 1);
    // Queue selector past the end.
    w(&mut t, 0x30, 99);
    assert_eq!(r(&mut t, 0x34), 0);
    // DRIVER_OK without FEATURES_OK.
    w(
        &mut t,
        0x70,
        status::ACKNOWLEDGE | status::DRIVER | status::DRIVER_OK,
    );
    assert!(seen.lock().unwrap().activated.is_none());
    assert!(
        bad.load(Ordering::Relaxed) >= 8,
        "{}",
        bad.load(Ordering::Relaxed)
    );
}

#[test]
fn a_queue_outside_guest_memory_needs_reset() {
    let (mut t, seen, _) = transport();
    w(&mut t, 0x70, status::ACKNOWLEDGE);
    w(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
    w(&mut t, 0x24, 1);
    w(&mut t, 0x20, 1);
    let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
    w(&mut t, 0x70, s);
    setup_queue(&mut t, 0, 0x7fff_0000);
    w(&mut t, 0x70, s | status::DRIVER_OK);
    assert!(seen.lock().unwrap().activated.is_none());
    assert_ne!(r(&mut t, 0x70) & status::DEVICE_NEEDS_RESET, 0);
    assert_ne!(r(&mut t, 0x60) & INT_CONFIG, 0);
    w(&mut t, 0x64, INT_CONFIG);
    assert_eq!(r(&mut t, 0x60), 0);
}

/// Everything a driver can read from the registers, at every selector;
/// leaves the selectors as they were.
pub(super) fn registers(t: &mut MmioTransport) -> Vec<u32> {
    let (queue_sel, features_sel) = (t.core.queue_sel, t.core.device_features_sel);
    let mut regs: Vec<u32> = [0x0, 0x4, 0x8, 0xc, 0x10, 0x34, 0x44, 0x60, 0x70, 0xfc]
        .into_iter()
        .map(|off| r(t, off))
        .collect();
    for sel in 0..3 {
        w(t, 0x14, sel);
        regs.push(r(t, 0x10));
        w(t, 0x30, sel);
        regs.push(r(t, 0x34));
        regs.push(r(t, 0x44));
    }
    w(t, 0x14, features_sel);
    w(t, 0x30, queue_sel);
    regs
}

const AD: u32 = status::ACKNOWLEDGE | status::DRIVER;

/// ACKNOWLEDGE, then DRIVER, and the device's features with VERSION_1.
pub(super) fn driver_with_features(t: &mut MmioTransport) {
    w(t, 0x70, status::ACKNOWLEDGE);
    w(t, 0x70, AD);
    w(t, 0x24, 0);
    w(t, 0x20, 1 << 5);
    w(t, 0x24, 1);
    w(t, 0x20, 1);
}

#[test]
fn status_bits_are_set_in_the_drivers_order() {
    let (mut t, seen, _) = transport();
    let bad = t.bad_accesses();
    let refused = |t: &mut MmioTransport, v: u32, want: u32| {
        let before = bad.load(Ordering::Relaxed);
        w(t, 0x70, v);
        assert_eq!(r(t, 0x70), want, "write {v:#x}");
        assert_eq!(bad.load(Ordering::Relaxed), before + 1, "write {v:#x}");
    };
    refused(&mut t, status::DRIVER, 0); // out of order
    w(&mut t, 0x70, AD); // two bits at once, in order: as two writes
    assert_eq!(r(&mut t, 0x70), AD);
    refused(&mut t, AD | status::DRIVER_OK, AD); // no FEATURES_OK
    refused(&mut t, AD | status::FEATURES_OK, AD); // no VERSION_1
    refused(&mut t, AD | status::FEATURES_OK | status::DRIVER_OK, AD);
    assert_eq!(seen.lock().unwrap().starts, 0);
    w(&mut t, 0x24, 1);
    w(&mut t, 0x20, 1);
    w(&mut t, 0x70, AD | status::FEATURES_OK);
    refused(&mut t, status::ACKNOWLEDGE, AD | status::FEATURES_OK); // cleared
    w(&mut t, 0x70, AD | status::FEATURES_OK | status::DRIVER_OK);
    assert_eq!(r(&mut t, 0x70), 0xf);
    assert_eq!(seen.lock().unwrap().starts, 1, "started on DRIVER_OK");
    // After a reset (features to negotiate again), FEATURES_OK and
    // DRIVER_OK in one write: taken in order, started once.
    w(&mut t, 0x70, 0);
    w(&mut t, 0x70, AD);
    w(&mut t, 0x24, 1);
    w(&mut t, 0x20, 1);
    w(&mut t, 0x70, 0xf);
    assert_eq!(r(&mut t, 0x70), 0xf);
    assert_eq!(seen.lock().unwrap().starts, 2, "started again");
    w(&mut t, 0x70, 0xf);
    assert_eq!(seen.lock().unwrap().starts, 2, "started once per DRIVER_OK");
    w(&mut t, 0x70, 0);
    assert_eq!((r(&mut t, 0x70), seen.lock().unwrap().resets), (0, 2));
}

#[test]
fn unknown_status_bits_are_ignored_and_counted() {
    let (mut t, _, _) = transport();
    let bad = t.bad_accesses();
    w(&mut t, 0x70, 0x11);
    assert_eq!(r(&mut t, 0x70), status::ACKNOWLEDGE);
    // Only unknown bits: neither a reset nor a change.
    w(&mut t, 0x70, 0x20);
    assert_eq!(r(&mut t, 0x70), status::ACKNOWLEDGE);
    // DEVICE_NEEDS_RESET is the device's to set.
    w(
        &mut t,
        0x70,
        status::ACKNOWLEDGE | status::DEVICE_NEEDS_RESET,
    );
    assert_eq!(r(&mut t, 0x70), status::ACKNOWLEDGE);
    assert_eq!(bad.load(Ordering::Relaxed), 3);
}

#[test]
fn failed_is_taken_at_any_time_and_only_a_reset_follows() {
    let (mut t, seen, _) = transport();
    w(&mut t, 0x70, status::FAILED | status::ACKNOWLEDGE);
    assert_eq!(r(&mut t, 0x70), status::FAILED, "FAILED alone is taken");
    w(&mut t, 0x70, status::FAILED | status::ACKNOWLEDGE);
    assert_eq!(r(&mut t, 0x70), status::FAILED);
    w(&mut t, 0x70, 0);
    // A running device that the driver gives up on runs until the reset.
    start_device(&mut t);
    w(&mut t, 0x70, 0xf | status::FAILED);
    assert_eq!(r(&mut t, 0x70), 0x8f);
    let seen = seen.lock().unwrap();
    assert_eq!((seen.starts, seen.resets), (1, 1));
}

#[test]
fn a_device_that_refuses_to_start_needs_reset_and_stays_stopped() {
    let (mut t, seen, _) = transport();
    seen.lock().unwrap().refuse = true;
    start_device(&mut t);
    assert_eq!(r(&mut t, 0x70), 0xf | status::DEVICE_NEEDS_RESET);
    assert_ne!(r(&mut t, 0x60) & INT_CONFIG, 0);
    let seen = seen.lock().unwrap();
    assert_eq!(
        (seen.starts, seen.resets),
        (0, 1),
        "reset after the refusal"
    );
    assert!(seen.live.is_none());
}

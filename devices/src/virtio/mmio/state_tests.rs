use std::sync::{Arc, Mutex};

use virtio_queue::QueueT;

use super::tests::{
    driver_with_features, r, registers, setup_queue, start_device, transport, w, Seen,
};
use super::*;
use crate::bus::BusDevice;
use crate::virtio::transport::lifecycle;
use crate::virtio::{status, INT_USED_RING, VIRTIO_F_VERSION_1};

fn running() -> (MmioTransport, MmioTransportState) {
    let (mut t, _, _) = transport();
    start_device(&mut t);
    let state = t.save().unwrap();
    (t, state)
}

#[test]
fn a_running_transport_round_trips_with_its_ring_positions() {
    let (t, mut state) = running();
    assert_eq!(state.queues.len(), 2);
    assert_eq!(state.queues[1].desc_table, 0x20000);
    assert!(state.queues[0].ready);
    // As if the device had used 3 buffers of queue 0 before the save.
    state.queues[0].next_avail = 3;
    state.queues[0].next_used = 3;
    state.interrupt_status = INT_USED_RING;
    drop(t);

    let (mut fresh, seen, _) = transport();
    fresh.restore(&state).unwrap();
    assert_eq!(
        seen.lock().unwrap().activated,
        Some(((1 << 5) | VIRTIO_F_VERSION_1, 2)),
        "restarted with the saved features"
    );
    let live = seen.lock().unwrap().live.clone().unwrap();
    assert_eq!((live[0].next_avail, live[0].next_used), (3, 3));
    assert_eq!(fresh.core.interrupt.status(), INT_USED_RING);
    // What a second save sees is what was restored.
    let again = fresh.save().unwrap();
    assert_eq!(again, state);
}

#[test]
fn a_reset_transport_restores_without_starting_the_device() {
    let (t, _, _) = transport();
    let state = t.save().unwrap();
    let (mut fresh, seen, _) = transport();
    fresh.restore(&state).unwrap();
    assert!(seen.lock().unwrap().activated.is_none());
    assert_eq!(fresh.save().unwrap(), state);
}

#[test]
fn hostile_states_are_refused_and_nothing_is_applied() {
    let (_, good) = running();
    type Spoil = Box<dyn Fn(&mut MmioTransportState)>;
    let cases: Vec<(&str, Spoil)> = vec![
        ("queues saved", Box::new(|s| s.queues.truncate(1))),
        ("entries at most", Box::new(|s| s.queues[0].max_size = 1024)),
        ("queue 0", Box::new(|s| s.queues[0].size = 3)),
        ("queue 1", Box::new(|s| s.queues[1].desc_table = 0x20001)),
        (
            "not inside guest memory",
            Box::new(|s| s.queues[0].used_ring = 0x7fff_0000),
        ),
        ("status", Box::new(|s| s.status = status::DRIVER_OK)),
        ("status", Box::new(|s| s.status |= 0x10)),
        ("does not offer", Box::new(|s| s.acked_features |= 1 << 7)),
        (
            "VERSION_1",
            Box::new(|s| s.acked_features &= !VIRTIO_F_VERSION_1),
        ),
        ("in that order", Box::new(|s| s.status &= !status::DRIVER)),
        (
            "only set when a start",
            Box::new(|s| s.status = 0xb | status::DEVICE_NEEDS_RESET),
        ),
        ("no device raises", Box::new(|s| s.interrupt_status = 4)),
        (
            "ring positions",
            Box::new(|s| {
                s.status = 0xb;
                s.queues[1].next_used = 1;
            }),
        ),
        (
            "never set FEATURES_OK",
            Box::new(|s| {
                s.status = 0x3;
                s.queues[0].next_avail = 0;
                s.queues[0].next_used = 0;
            }),
        ),
        (
            "event index true",
            Box::new(|s| s.queues[1].event_idx_enabled = true),
        ),
    ];
    for (want, spoil) in cases {
        let mut bad = good.clone();
        spoil(&mut bad);
        let (mut fresh, seen, _) = transport();
        let checked = fresh.check_state(&bad).unwrap_err();
        let e = fresh.restore(&bad).unwrap_err();
        let e = e.to_string();
        assert_eq!(checked.to_string(), e, "check_state and restore agree");
        assert!(e.contains(want), "{want}: {e}");
        assert!(seen.lock().unwrap().activated.is_none(), "{want}");
        assert_eq!(fresh.status(), 0, "{want}: nothing applied");
    }
}

#[test]
fn a_live_transport_is_reset_then_restored() {
    let (mut t, mut state) = running();
    // As if the device had moved on since the state was saved.
    state.queues[0].next_avail = 2;
    state.queues[0].next_used = 2;
    t.restore(&state).unwrap();
    assert_eq!(
        t.save().unwrap(),
        state,
        "the saved state, not the live one"
    );

    // A refused state leaves the running transport as it was.
    let before = t.save().unwrap();
    let mut bad = state.clone();
    bad.interrupt_status = 0x80;
    assert!(t.restore(&bad).is_err());
    assert_eq!(t.save().unwrap(), before);
}

/// Saves `t`, restores into a fresh transport and checks that the driver
/// reads the same registers there and that the device runs there exactly
/// when it ran in `t`. Returns the fresh transport's device record.
fn round_trip(t: &mut MmioTransport) -> Arc<Mutex<Seen>> {
    let state = t.save().unwrap();
    let (mut fresh, seen, _) = transport();
    if let Err(e) = fresh.restore(&state) {
        panic!("{state:#x?} refused: {e}");
    }
    assert_eq!(fresh.save().unwrap(), state, "saved again");
    assert_eq!(registers(&mut fresh), registers(t), "{state:#x?}");
    let live = lifecycle::is_live(state.status);
    let fresh_seen = seen.lock().unwrap();
    assert_eq!(fresh_seen.starts, u32::from(live), "{state:#x?}");
    if live {
        assert_eq!(
            fresh_seen.activated,
            Some((state.acked_features, state.queues.len()))
        );
    }
    drop(fresh_seen);
    seen
}

/// Fuzz finding 1: a refused FEATURES_OK used to keep DRIVER_OK (0x7), and
/// a later accepted one never started the device.
#[test]
fn fuzz_finding_a_refused_features_ok_keeps_driver_ok_out() {
    let (mut t, seen, _) = transport();
    w(&mut t, 0x70, status::ACKNOWLEDGE);
    w(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
    w(&mut t, 0x70, 0xf); // VERSION_1 not acked
    assert_eq!(r(&mut t, 0x70), 0x3);
    round_trip(&mut t);
    w(&mut t, 0x24, 1);
    w(&mut t, 0x20, 1);
    w(&mut t, 0x70, 0xf); // FEATURES_OK, then DRIVER_OK: both taken now
    assert_eq!(r(&mut t, 0x70), 0xf);
    assert_eq!(seen.lock().unwrap().starts, 1, "the device runs");
    let fresh = round_trip(&mut t);
    assert_eq!(
        fresh.lock().unwrap().activated,
        Some((VIRTIO_F_VERSION_1, 2))
    );
}

/// Fuzz finding 2: unknown status bits were stored (0x11).
#[test]
fn fuzz_finding_unknown_status_bits_are_not_stored() {
    let (mut t, _, _) = transport();
    w(&mut t, 0x70, 0x11);
    assert_eq!(r(&mut t, 0x70), status::ACKNOWLEDGE);
    round_trip(&mut t);
}

/// Fuzz finding 3: DEVICE_NEEDS_RESET after a queue outside guest memory;
/// the restore demanded valid queues of a device that never started.
#[test]
fn fuzz_finding_needs_reset_with_a_queue_outside_memory() {
    let (mut t, seen, _) = transport();
    w(&mut t, 0x70, status::ACKNOWLEDGE);
    w(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
    w(&mut t, 0x24, 1);
    w(&mut t, 0x20, 1);
    w(&mut t, 0x70, 0xb);
    setup_queue(&mut t, 0, 0x7fff_0000);
    round_trip(&mut t);
    w(&mut t, 0x70, 0xf);
    assert_eq!(r(&mut t, 0x70), 0x4f);
    assert_eq!(seen.lock().unwrap().starts, 0);
    let fresh = round_trip(&mut t);
    assert!(fresh.lock().unwrap().live.is_none(), "not started");
}

#[test]
fn failed_and_refused_states_round_trip() {
    let (mut t, seen, _) = transport();
    w(&mut t, 0x70, status::FAILED);
    round_trip(&mut t);
    w(&mut t, 0x70, 0);
    start_device(&mut t);
    w(&mut t, 0x70, 0x8f);
    round_trip(&mut t);
    w(&mut t, 0x70, 0);
    seen.lock().unwrap().refuse = true;
    start_device(&mut t);
    assert_eq!(r(&mut t, 0x70), 0x4f);
    w(&mut t, 0x70, 0xcf);
    round_trip(&mut t);
}

/// A deterministic pseudo-random number generator (Knuth's MMIX LCG).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) as u32
    }

    fn below(&mut self, n: u32) -> u32 {
        self.next() % n
    }

    fn pick(&mut self, of: &[u32]) -> u32 {
        of[self.below(of.len() as u32) as usize]
    }
}

/// Queue addresses: inside guest memory (1 MiB), at its end, outside,
/// badly aligned.
const ADDRESSES: [u32; 8] = [
    0,
    0x10000,
    0x20000,
    0xf_f000,
    0x7fff_0000,
    0x1002,
    0x1004,
    0xffff_fff0,
];

/// One status write: mostly the next bit in order, sometimes anything.
fn random_status(rng: &mut Lcg, t: &mut MmioTransport) {
    let cur = t.status();
    let v = match rng.below(24) {
        0..=11 => cur | lifecycle::next_bit(cur).unwrap_or(0),
        12..=13 => cur | status::DEVICE_NEEDS_RESET | 0x10,
        14..=16 => rng.pick(&[0x3, 0x7, 0xb, 0xf, 0x11, 0x4f, cur & !1]),
        17..=18 => rng.next() & 0x7f,
        19 => rng.next(),
        20 => cur | status::FAILED,
        _ => rng.pick(&[0, cur]),
    };
    w(t, 0x70, v);
}

/// One queue register write, or a whole queue set up in memory.
fn random_queue(rng: &mut Lcg, t: &mut MmioTransport) {
    let off = rng.pick(&[0x38, 0x44, 0x80, 0x84, 0x90, 0x94, 0xa0, 0xa4, 0]);
    let v = match off {
        0 => {
            let base = rng.pick(&[0x10000, 0x20000, 0x7fff_0000]);
            return setup_queue(t, rng.below(2), u64::from(base));
        }
        0x38 => rng.pick(&[256, 128, 16, 3, 0, 512]),
        0x44 => rng.pick(&[0, 1, 1, 2]),
        0x84 | 0x94 | 0xa4 => rng.pick(&[0, 0, 0, 1]),
        _ => rng.pick(&ADDRESSES),
    };
    w(t, u64::from(off), v);
}

/// One random driver access.
fn random_access(rng: &mut Lcg, t: &mut MmioTransport) {
    match rng.below(12) {
        0..=3 => random_status(rng, t),
        4..=6 => random_queue(rng, t),
        7 => driver_with_features(t),
        8 => {
            w(t, 0x24, rng.pick(&[0, 1, 2]));
            w(t, 0x20, rng.pick(&[1 << 5, 1, 0, u32::MAX, 1 << 7]));
        }
        9 => {
            let off = rng.pick(&[0x14, 0x30, 0x50, 0x64]);
            w(t, u64::from(off), rng.pick(&[0, 1, 2, 3, u32::MAX]));
        }
        10 => {
            let off = 0x100 + u64::from(rng.below(16));
            t.write(off, &rng.next().to_le_bytes()[..rng.below(4) as usize + 1]);
        }
        _ => {
            let off = u64::from(rng.below(0x100));
            let len = rng.pick(&[1, 2, 4, 4, 8]) as usize;
            if rng.below(2) == 0 {
                t.write(off, &rng.next().to_le_bytes().repeat(2)[..len]);
            } else {
                t.read(off, &mut [0u8; 8][..len]);
            }
        }
    }
}

/// Thousands of random drivers: after each burst of accesses the state is
/// saved and restored into a fresh transport, which must take it and look
/// the same to the driver. Also checks that the walk reached the states
/// that matter, so that it keeps testing something.
#[test]
fn random_drivers_always_save_and_restore() {
    let mut rng = Lcg(0x7a4d_656d);
    let mut reached = [0u32; 5]; // live, needs reset, failed, queues set up, reset
    for run in 0..100 {
        let (mut t, seen, _) = transport();
        seen.lock().unwrap().refuse = run % 8 == 7;
        for _ in 0..40 {
            for _ in 0..=rng.below(16) {
                random_access(&mut rng, &mut t);
            }
            let s = t.status();
            let live = lifecycle::is_live(s);
            assert_eq!(seen.lock().unwrap().live.is_some(), live, "{s:#x}");
            reached[0] += u32::from(live);
            reached[1] += u32::from(s & status::DEVICE_NEEDS_RESET != 0);
            reached[2] += u32::from(s & status::FAILED != 0);
            reached[3] += u32::from(!live && t.core.queues.iter().any(|q| q.ready()));
            reached[4] += u32::from(s == 0);
            round_trip(&mut t);
        }
    }
    assert!(reached.iter().all(|&n| n > 50), "{reached:?}");
}

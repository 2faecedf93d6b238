use super::*;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use vm_memory::GuestAddress;

use crate::bus::BusDevice;
use crate::pci::{PciBus, PciWindow};
use crate::virtio::{status, VIRTIO_F_VERSION_1};

/// Where the BAR starts when the transport is built.
const BAR: u32 = 0xe000_0000;
/// The dummy's MSI-X vectors: one per queue and one for configuration.
const VECTORS: usize = 3;
const MAC: u64 = 1 << 5;
const AD: u32 = status::ACKNOWLEDGE | status::DRIVER;
const ADF: u32 = AD | status::FEATURES_OK;

// Common configuration offsets (virtio 1.2, 4.1.4.3).
const DEVICE_FEATURE_SELECT: u64 = 0x00;
const DEVICE_FEATURE: u64 = 0x04;
const DRIVER_FEATURE_SELECT: u64 = 0x08;
const DRIVER_FEATURE: u64 = 0x0c;
const CONFIG_MSIX_VECTOR: u64 = 0x10;
const NUM_QUEUES: u64 = 0x12;
const DEVICE_STATUS: u64 = 0x14;
const CONFIG_GENERATION: u64 = 0x15;
const QUEUE_SELECT: u64 = 0x16;
const QUEUE_SIZE: u64 = 0x18;
const QUEUE_MSIX_VECTOR: u64 = 0x1a;
const QUEUE_ENABLE: u64 = 0x1c;
const QUEUE_NOTIFY_OFF: u64 = 0x1e;
const QUEUE_DESC: u64 = 0x20;
const QUEUE_DRIVER: u64 = 0x28;
const QUEUE_DEVICE: u64 = 0x30;

use crate::virtio::test_device::{Dummy, Seen};

type Routes = Arc<Mutex<Vec<(usize, u64, u32)>>>;
type Moves = Arc<Mutex<Vec<Option<u64>>>>;

struct RecordRoutes(Routes);

impl MsiRoutes for RecordRoutes {
    fn set(&mut self, vector: usize, address: u64, data: u32) -> io::Result<()> {
        self.0.lock().unwrap().push((vector, address, data));
        Ok(())
    }
}

struct RecordNotify(Moves);

impl NotifyArea for RecordNotify {
    fn moved(&mut self, at: Option<u64>) -> io::Result<()> {
        self.0.lock().unwrap().push(at);
        Ok(())
    }
}

/// A transport around a [`Dummy`] and what the test watches of it.
struct Fixture {
    t: PciTransport,
    seen: Arc<Mutex<Seen>>,
    interrupt: Arc<Interrupt>,
    /// Clones of the MSI-X vectors' irqfds.
    vectors: Vec<EventFd>,
    /// Clones of the queues' eventfds.
    queue_evts: Vec<EventFd>,
    routes: Routes,
    moves: Moves,
}

fn fds(n: usize) -> Vec<EventFd> {
    (0..n)
        .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
        .collect()
}

fn clones(fds: &[EventFd]) -> Vec<EventFd> {
    fds.iter().map(|e| e.try_clone().unwrap()).collect()
}

fn fixture() -> Fixture {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let vectors = fds(VECTORS);
    let interrupt = Arc::new(Interrupt::msix(clones(&vectors), 2));
    let queue_evts = fds(2);
    let routes = Routes::default();
    let moves = Moves::default();
    let hooks = Hooks {
        routes: Box::new(RecordRoutes(routes.clone())),
        notify: Box::new(RecordNotify(moves.clone())),
    };
    let t = PciTransport::new(
        Box::new(Dummy(seen.clone())),
        mem,
        interrupt.clone(),
        clones(&queue_evts),
        BAR,
        hooks,
    )
    .unwrap();
    Fixture {
        t,
        seen,
        interrupt,
        vectors,
        queue_evts,
        routes,
        moves,
    }
}

fn bad(t: &PciTransport) -> u64 {
    t.bad_accesses().load(Ordering::Relaxed)
}

fn fired(e: &EventFd) -> bool {
    e.read().is_ok()
}

fn rd(t: &mut PciTransport, off: u64, len: usize) -> u64 {
    let mut b = [0u8; 8];
    t.read_bar(off, &mut b[..len]);
    u64::from_le_bytes(b)
}

fn r8(t: &mut PciTransport, off: u64) -> u8 {
    rd(t, off, 1) as u8
}

fn r16(t: &mut PciTransport, off: u64) -> u16 {
    rd(t, off, 2) as u16
}

fn r32(t: &mut PciTransport, off: u64) -> u32 {
    rd(t, off, 4) as u32
}

fn w8(t: &mut PciTransport, off: u64, v: u8) {
    t.write_bar(off, &[v]);
}

fn w16(t: &mut PciTransport, off: u64, v: u16) {
    t.write_bar(off, &v.to_le_bytes());
}

fn w32(t: &mut PciTransport, off: u64, v: u32) {
    t.write_bar(off, &v.to_le_bytes());
}

fn cfg8(t: &PciTransport, at: usize) -> u8 {
    t.config().bytes()[at]
}

fn cfg16(t: &PciTransport, at: usize) -> u16 {
    let b = t.config().bytes();
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn cfg32(t: &PciTransport, at: usize) -> u32 {
    t.config().dword(at)
}

/// ACKNOWLEDGE, DRIVER, MAC and VERSION_1, FEATURES_OK.
fn negotiate(t: &mut PciTransport) {
    w8(t, DEVICE_STATUS, status::ACKNOWLEDGE as u8);
    w8(t, DEVICE_STATUS, AD as u8);
    w32(t, DEVICE_FEATURE_SELECT, 0);
    assert_eq!(r32(t, DEVICE_FEATURE), MAC as u32);
    w32(t, DEVICE_FEATURE_SELECT, 1);
    assert_eq!(r32(t, DEVICE_FEATURE), 1, "VERSION_1 in the high half");
    w32(t, DRIVER_FEATURE_SELECT, 0);
    w32(t, DRIVER_FEATURE, MAC as u32);
    w32(t, DRIVER_FEATURE_SELECT, 1);
    w32(t, DRIVER_FEATURE, 1);
    w8(t, DEVICE_STATUS, ADF as u8);
    assert_eq!(r8(t, DEVICE_STATUS), ADF as u8);
}

/// Sets up queue `q` at `base` in guest memory with MSI-X vector `vector`.
fn setup_queue(t: &mut PciTransport, q: u16, base: u64, vector: u16) {
    w16(t, QUEUE_SELECT, q);
    assert_eq!(r16(t, QUEUE_SIZE), 256);
    assert_eq!(r16(t, QUEUE_NOTIFY_OFF), q);
    w16(t, QUEUE_SIZE, 128);
    for (reg, addr) in [
        (QUEUE_DESC, base),
        (QUEUE_DRIVER, base + 0x1000),
        (QUEUE_DEVICE, base + 0x2000),
    ] {
        w32(t, reg, addr as u32);
        w32(t, reg + 4, (addr >> 32) as u32);
        assert_eq!(r32(t, reg), addr as u32);
    }
    w16(t, QUEUE_MSIX_VECTOR, vector);
    assert_eq!(r16(t, QUEUE_MSIX_VECTOR), vector);
    w16(t, QUEUE_ENABLE, 1);
    assert_eq!(r16(t, QUEUE_ENABLE), 1);
}

/// Programs MSI-X table entry `v` with a 4-byte write per field.
fn program_vector(t: &mut PciTransport, v: u64, address: u64, data: u32) {
    let at = MSIX_TABLE_AT + 16 * v;
    w32(t, at, address as u32);
    w32(t, at + 4, (address >> 32) as u32);
    w32(t, at + 8, data);
}

fn set_masked(t: &mut PciTransport, v: u64, masked: bool) {
    w32(t, MSIX_TABLE_AT + 16 * v + 12, u32::from(masked));
}

/// MSI-X Enable (and Function Mask if `function_masked`) in the message
/// control, through the configuration space.
fn enable_msix(t: &mut PciTransport, function_masked: bool) {
    let control = 0x80 | if function_masked { 0x40 } else { 0 };
    t.write_config(MSIX_CAP + 3, &[control]);
}

/// A driver's whole bring-up: features, both queues with vectors 0 and 1,
/// configuration on vector 2, MSI-X programmed and enabled, DRIVER_OK.
fn bring_up(t: &mut PciTransport) {
    negotiate(t);
    w16(t, CONFIG_MSIX_VECTOR, 2);
    assert_eq!(r16(t, CONFIG_MSIX_VECTOR), 2);
    setup_queue(t, 0, 0x10000, 0);
    setup_queue(t, 1, 0x20000, 1);
    for v in 0..VECTORS as u64 {
        program_vector(t, v, 0xfee0_0000 + (v << 12), 0x40 + v as u32);
        set_masked(t, v, false);
    }
    enable_msix(t, false);
    w8(t, DEVICE_STATUS, (ADF | status::DRIVER_OK) as u8);
    assert_eq!(u32::from(r8(t, DEVICE_STATUS)), ADF | status::DRIVER_OK);
}

#[test]
fn config_space_says_virtio_net_with_msix_and_the_virtio_capabilities() {
    let f = fixture();
    let t = &f.t;
    assert_eq!(cfg16(t, 0x00), 0x1af4);
    assert_eq!(cfg16(t, 0x02), 0x1041, "0x1040 + net");
    assert_eq!(cfg8(t, 0x08), 1, "revision 1: modern");
    assert_eq!(cfg8(t, 0x0b), 0x02, "network controller");
    assert_eq!(cfg16(t, 0x2c), 0x1af4, "subsystem vendor");
    assert!(cfg16(t, 0x2e) >= 0x40, "subsystem id of a modern device");
    assert_eq!(cfg16(t, 0x06) & 0x10, 0x10, "capabilities list");
    assert_eq!(cfg8(t, 0x34), 0x40);
    assert_eq!(cfg32(t, 0x10), BAR, "32-bit memory BAR");
    assert_eq!(cfg8(t, 0x3d), 0, "no INTx pin");

    let mut caps = Vec::new();
    let mut at = usize::from(cfg8(t, 0x34));
    while at != 0 && caps.len() < 48 {
        assert_eq!(at % 4, 0, "capability at {at:#x} not dword-aligned");
        assert!(at >= 0x40, "capability at {at:#x} in the header");
        caps.push((at, cfg8(t, at)));
        at = usize::from(cfg8(t, at + 1));
    }
    let ids: Vec<u8> = caps.iter().map(|c| c.1).collect();
    assert_eq!(ids, [0x11, 0x09, 0x09, 0x09, 0x09, 0x09]);

    let msix = caps[0].0;
    assert_eq!(
        usize::from(cfg16(t, msix + 2) & 0x7ff),
        VECTORS - 1,
        "table size is N - 1"
    );
    assert_eq!(cfg16(t, msix + 2) & 0xc000, 0, "disabled, unmasked");
    assert_eq!(u64::from(cfg32(t, msix + 4)), MSIX_TABLE_AT, "BIR 0");
    assert_eq!(u64::from(cfg32(t, msix + 8)), MSIX_PBA_AT, "BIR 0");

    let expected = [
        (1u8, COMMON_AT, 0x38u64),
        (2, NOTIFY_AT, 2 * u64::from(NOTIFY_MULTIPLIER)),
        (3, ISR_AT, 1),
        (4, DEVICE_AT, 1),
        (5, 0, 0),
    ];
    for (&(at, _), (cfg_type, offset, min_len)) in caps[1..].iter().zip(expected) {
        assert_eq!(cfg8(t, at + 3), cfg_type, "cap at {at:#x}");
        assert_eq!(cfg8(t, at + 4), 0, "BAR 0, cap at {at:#x}");
        assert_eq!(u64::from(cfg32(t, at + 8)), offset, "cap at {at:#x}");
        let len = u64::from(cfg32(t, at + 12));
        assert!(len >= min_len, "cap at {at:#x}: length {len:#x}");
        assert!(offset + len <= u64::from(BAR_SIZE));
        let cap_len = if matches!(cfg_type, 2 | 5) { 20 } else { 16 };
        assert_eq!(cfg8(t, at + 2), cap_len, "cap_len at {at:#x}");
    }
    let notify = caps[2].0;
    assert_eq!(cfg32(t, notify + 16), 4, "notify_off_multiplier");
}

#[test]
fn the_bar_is_sized_moved_and_the_notify_area_follows() {
    let mut f = fixture();
    let t = &mut f.t;
    assert_eq!(t.decoded_bar(), None, "memory decoding is off");
    t.write_config(0x10, &u32::MAX.to_le_bytes());
    assert_eq!(cfg32(t, 0x10), !(BAR_SIZE - 1));
    assert!(f.moves.lock().unwrap().is_empty(), "nothing decoded yet");

    let new = 0xc000_8000u32;
    t.write_config(0x10, &new.to_le_bytes());
    assert_eq!(cfg32(t, 0x10), new);
    t.write_config(0x04, &[0x02, 0x00]);
    let new = u64::from(new);
    assert_eq!(t.decoded_bar(), Some((new, u64::from(BAR_SIZE))));
    assert_eq!(*f.moves.lock().unwrap(), [Some(new + NOTIFY_AT)]);

    // An unaligned address keeps only the BAR's address bits.
    t.write_config(0x10, &0xd000_1234u32.to_le_bytes());
    assert_eq!(t.decoded_bar(), Some((0xd000_0000, u64::from(BAR_SIZE))));
    // A config write that changes nothing says nothing.
    t.write_config(0x3c, &[0x0b]);
    t.write_config(0x04, &[0x00, 0x00]);
    assert_eq!(t.decoded_bar(), None);
    assert_eq!(
        *f.moves.lock().unwrap(),
        [Some(new + NOTIFY_AT), Some(0xd000_0000 + NOTIFY_AT), None]
    );
}

#[test]
fn a_driver_brings_the_device_up_through_the_common_configuration() {
    let mut f = fixture();
    let t = &mut f.t;
    assert_eq!(r16(t, NUM_QUEUES), 2);
    assert_eq!(r8(t, DEVICE_STATUS), 0);
    assert_eq!(r16(t, CONFIG_MSIX_VECTOR), NO_VECTOR);
    negotiate(t);
    w32(t, DRIVER_FEATURE_SELECT, 0);
    assert_eq!(r32(t, DRIVER_FEATURE), MAC as u32);
    w16(t, CONFIG_MSIX_VECTOR, 2);
    setup_queue(t, 0, 0x10000, 0);
    setup_queue(t, 1, 0x20000, 1);
    w16(t, QUEUE_SELECT, 0);
    assert_eq!(r16(t, QUEUE_SIZE), 128);
    assert_eq!(r32(t, QUEUE_DRIVER), 0x11000);
    assert_eq!(r32(t, QUEUE_DEVICE + 4), 0);
    assert_eq!(r16(t, QUEUE_MSIX_VECTOR), 0);
    assert!(f.seen.lock().unwrap().activated.is_none());
    w8(t, DEVICE_STATUS, (ADF | status::DRIVER_OK) as u8);
    assert_eq!(u32::from(r8(t, DEVICE_STATUS)), ADF | status::DRIVER_OK);
    {
        let seen = f.seen.lock().unwrap();
        assert_eq!(seen.activated, Some((MAC | VIRTIO_F_VERSION_1, 2)));
        let live = seen.live.as_ref().unwrap();
        assert_eq!(live[1].desc_table, 0x20000);
        assert_eq!(live[1].size, 128);
    }
    assert_eq!(bad(t), 0);
    assert_eq!(r8(t, CONFIG_GENERATION), 0);
    // Device configuration, and a write bumps the generation.
    assert_eq!(r16(t, DEVICE_AT + 4), 0x0504);
    t.write_bar(DEVICE_AT, &[1]);
    assert_eq!(r8(t, CONFIG_GENERATION), 1);
    // A notify that reaches the transport signals the queue's eventfd.
    w16(t, NOTIFY_AT + 4, 1);
    assert!(fired(&f.queue_evts[1]));
    assert!(!fired(&f.queue_evts[0]));
    // The ISR is read-to-clear.
    f.interrupt.trigger_queue(0);
    assert_eq!(r8(t, ISR_AT), 1);
    assert_eq!(r8(t, ISR_AT), 0);
    // Queue set-up after DRIVER_OK is refused.
    w16(t, QUEUE_SIZE, 64);
    assert_eq!(r16(t, QUEUE_SIZE), 128);
    assert_eq!(bad(t), 1);
    // Reset: the device stops, the vectors are unassigned.
    w8(t, DEVICE_STATUS, 0);
    assert_eq!(r8(t, DEVICE_STATUS), 0);
    assert_eq!(f.seen.lock().unwrap().resets, 1);
    assert_eq!(r16(t, CONFIG_MSIX_VECTOR), NO_VECTOR);
    assert_eq!(r16(t, QUEUE_MSIX_VECTOR), NO_VECTOR);
    assert_eq!(r16(t, QUEUE_ENABLE), 0);
}

#[test]
fn msix_table_routes_masks_and_pending_bits() {
    let mut f = fixture();
    let t = &mut f.t;
    program_vector(t, 1, 0xfee0_0000, 0x41);
    assert_eq!(
        f.routes.lock().unwrap().last(),
        Some(&(1, 0xfee0_0000, 0x41))
    );
    assert!(f.routes.lock().unwrap().iter().all(|r| r.0 == 1));
    // Reads return what was written; vector control holds the mask bit
    // (masked after reset).
    let e1 = MSIX_TABLE_AT + 16;
    assert_eq!(r32(t, e1), 0xfee0_0000);
    assert_eq!(r32(t, e1 + 4), 0);
    assert_eq!(r32(t, e1 + 8), 0x41);
    assert_eq!(r32(t, e1 + 12), 1);
    assert_eq!(rd(t, e1, 8), 0xfee0_0000);
    assert_eq!(rd(t, e1 + 8, 8), 0x1_0000_0041);
    // A qword write of address, then of data and vector control.
    t.write_bar(MSIX_TABLE_AT + 32, &0x1_fee0_1000u64.to_le_bytes());
    assert_eq!(
        f.routes.lock().unwrap().last(),
        Some(&(2, 0x1_fee0_1000, 0))
    );
    t.write_bar(MSIX_TABLE_AT + 40, &0x42u64.to_le_bytes());
    assert_eq!(rd(t, MSIX_TABLE_AT + 40, 8), 0x42, "unmasked");
    assert_eq!(r32(t, MSIX_TABLE_AT + 44), 0);
    assert_eq!(bad(t), 0);

    enable_msix(t, false);
    assert!(f.interrupt.mask_state().enabled);
    set_masked(t, 1, false);
    assert_eq!(r32(t, e1 + 12), 0);
    w16(t, QUEUE_SELECT, 0);
    w16(t, QUEUE_MSIX_VECTOR, 1);
    f.interrupt.trigger_queue(0);
    assert!(fired(&f.vectors[1]));
    assert!(!fired(&f.vectors[0]) && !fired(&f.vectors[2]));

    // Masked: held in the PBA, sent on unmask.
    set_masked(t, 1, true);
    assert_eq!(r32(t, e1 + 12), 1);
    f.interrupt.trigger_queue(0);
    assert!(!fired(&f.vectors[1]));
    assert_eq!(r32(t, MSIX_PBA_AT), 0b10);
    assert_eq!(rd(t, MSIX_PBA_AT, 8), 0b10);
    set_masked(t, 1, false);
    assert!(fired(&f.vectors[1]));
    assert_eq!(r32(t, MSIX_PBA_AT), 0);

    // The function mask holds it as well.
    enable_msix(t, true);
    f.interrupt.trigger_queue(0);
    assert!(!fired(&f.vectors[1]));
    assert_eq!(r32(t, MSIX_PBA_AT), 0b10);
    enable_msix(t, false);
    assert!(fired(&f.vectors[1]));
    // MSI-X off: nothing is sent, nothing is pending.
    t.write_config(MSIX_CAP + 3, &[0]);
    f.interrupt.trigger_queue(0);
    assert!(!fired(&f.vectors[1]));
    assert_eq!(r32(t, MSIX_PBA_AT), 0);
    assert_eq!(bad(t), 0);
}

/// Runs `f`; `true` if it panicked.
fn panics(f: impl FnOnce()) -> bool {
    catch_unwind(AssertUnwindSafe(f)).is_err()
}

#[test]
fn an_eight_byte_write_to_the_common_configuration_is_counted() {
    let mut f = fixture();
    let t = &mut f.t;
    // A guest can issue a qword write anywhere in the common configuration
    // (KVM passes MMIO accesses of up to 8 bytes): counted and ignored.
    // (It once panicked on the vCPU thread.)
    let panicked = panics(|| t.write_bar(DEVICE_FEATURE_SELECT, &u64::MAX.to_le_bytes()));
    assert!(!panicked, "an 8-byte write at common config 0x0 panicked");
    assert_eq!(bad(t), 1);
    assert_eq!(r32(t, DEVICE_FEATURE_SELECT), 0);
}

#[test]
fn hostile_bar_accesses_never_panic_and_are_counted() {
    let mut f = fixture();
    let t = &mut f.t;
    negotiate(t);
    let mut panicked = Vec::new();
    for pass in 0..2 {
        for off in 0..u64::from(BAR_SIZE) + 16 {
            for len in [1usize, 2, 3, 4, 8] {
                let mut d = [0u8; 8];
                if panics(|| t.read_bar(off, &mut d[..len])) {
                    panicked.push(("read", off, len));
                }
                // Second pass: all ones (status, vectors, table, notify).
                let v = [if pass == 0 { 0x00 } else { 0xff }; 8];
                if panics(|| t.write_bar(off, &v[..len])) {
                    panicked.push(("write", off, len));
                }
            }
        }
    }
    // Most of the BAR is nothing, or read-only, or write-only.
    assert!(bad(t) > 2 * u64::from(BAR_SIZE), "{}", bad(t));
    assert!(
        panicked.is_empty(),
        "{} accesses panicked, the first: {:x?}",
        panicked.len(),
        &panicked[..panicked.len().min(8)]
    );
}

/// Runs `access`, which must be counted as exactly one bad access.
fn counted(what: &str, t: &mut PciTransport, access: &dyn Fn(&mut PciTransport)) {
    let before = bad(t);
    access(t);
    assert_eq!(bad(t), before + 1, "{what}");
}

/// A read of `len` bytes at `off` that must answer zeros.
fn zeros(t: &mut PciTransport, off: u64, len: usize) {
    let mut d = [0xaau8; 8];
    t.read_bar(off, &mut d[..len]);
    assert!(d[..len].iter().all(|&b| b == 0), "read at {off:#x}: {d:x?}");
}

#[test]
fn each_kind_of_hostile_bar_access_is_counted_once() {
    let mut f = fixture();
    let t = &mut f.t;
    negotiate(t);
    counted("num_queues as a dword", t, &|t| zeros(t, NUM_QUEUES, 4));
    counted("device_feature as a word", t, &|t| {
        zeros(t, DEVICE_FEATURE, 2)
    });
    counted("odd byte of queue_select", t, &|t| {
        zeros(t, QUEUE_SELECT + 1, 1)
    });
    counted("status as a word", t, &|t| w16(t, DEVICE_STATUS, 0));
    counted("num_queues is read-only", t, &|t| w16(t, NUM_QUEUES, 7));
    counted("device_feature is read-only", t, &|t| {
        w32(t, DEVICE_FEATURE, 0)
    });
    counted("past the common configuration", t, &|t| zeros(t, 0x38, 4));
    counted("ISR write", t, &|t| w8(t, ISR_AT, 1));
    counted("past the ISR", t, &|t| zeros(t, ISR_AT + 4, 4));
    counted("device config across its end", t, &|t| {
        zeros(t, DEVICE_AT + 0xffe, 4)
    });
    counted("notify read", t, &|t| zeros(t, NOTIFY_AT, 2));
    counted("notify between queues", t, &|t| w16(t, NOTIFY_AT + 2, 0));
    counted("notify of queue 2", t, &|t| w16(t, NOTIFY_AT + 8, 2));
    counted("table past the vectors", t, &|t| {
        zeros(t, MSIX_TABLE_AT + 48, 4)
    });
    counted("table write past the vectors", t, &|t| {
        w32(t, MSIX_TABLE_AT + 48, 1)
    });
    counted("unaligned table", t, &|t| zeros(t, MSIX_TABLE_AT + 2, 4));
    counted("table word", t, &|t| zeros(t, MSIX_TABLE_AT, 2));
    counted("table qword across fields", t, &|t| {
        zeros(t, MSIX_TABLE_AT + 4, 8)
    });
    counted("PBA word", t, &|t| zeros(t, MSIX_PBA_AT, 2));
    counted("PBA past the bits", t, &|t| zeros(t, MSIX_PBA_AT + 8, 4));
    counted("PBA write", t, &|t| w32(t, MSIX_PBA_AT, 1));
    counted("past the BAR", t, &|t| zeros(t, u64::from(BAR_SIZE) + 4, 4));
    assert!(f.routes.lock().unwrap().is_empty(), "nothing routed");
    assert!(!fired(&f.queue_evts[0]) && !fired(&f.queue_evts[1]));

    // queue_enable written 0 is refused: the queue stays enabled.
    setup_queue(t, 0, 0x10000, 0);
    counted("queue_enable 0", t, &|t| w16(t, QUEUE_ENABLE, 0));
    assert_eq!(r16(t, QUEUE_ENABLE), 1);
    // A vector the device does not have reads back as NO_VECTOR.
    w16(t, QUEUE_MSIX_VECTOR, VECTORS as u16);
    assert_eq!(r16(t, QUEUE_MSIX_VECTOR), NO_VECTOR);
    w16(t, CONFIG_MSIX_VECTOR, 0x7fff);
    assert_eq!(r16(t, CONFIG_MSIX_VECTOR), NO_VECTOR);
    // A queue that does not exist.
    w16(t, QUEUE_SELECT, 2);
    assert_eq!(r16(t, QUEUE_SIZE), 0);
    assert_eq!(r16(t, QUEUE_ENABLE), 0);
    counted("vector of queue 2", t, &|t| w16(t, QUEUE_MSIX_VECTOR, 0));
    assert_eq!(r16(t, QUEUE_MSIX_VECTOR), NO_VECTOR);
    counted("size of queue 2", t, &|t| w16(t, QUEUE_SIZE, 16));
}

#[test]
fn config_space_writes_anywhere_never_panic_nor_change_the_identity() {
    let mut f = fixture();
    let t = &mut f.t;
    let before = *t.config().bytes();
    let mut panicked = Vec::new();
    for v in [0xffu8, 0x00, 0x5a] {
        for at in 0..CONFIG_BYTES + 4 {
            for len in [1usize, 2, 3, 4, 8] {
                if panics(|| t.write_config(at, &[v; 8][..len])) {
                    panicked.push((at, len));
                }
            }
        }
    }
    assert!(panicked.is_empty(), "panicked: {panicked:x?}");
    let after = t.config().bytes();
    assert_eq!(after[..4], before[..4], "vendor and device");
    assert_eq!(after[0x08..0x0c], before[0x08..0x0c], "revision and class");
    assert_eq!(after[0x2c..0x30], before[0x2c..0x30], "subsystem");
    assert_eq!(after[0x34..0x38], before[0x34..0x38], "capability pointer");
    assert_eq!(after[0x40..0x43], before[0x40..0x43], "MSI-X capability");
    assert_eq!(after[0x44..0x90], before[0x44..0x90], "capabilities");
    // What the last (0x5a) pass could change: the BAR address bits, the
    // command register, and message control's enable (0x5a has no 0x80)
    // and function mask (0x40).
    assert_eq!(cfg32(t, 0x10), 0x5a5a_0000 & !(BAR_SIZE - 1));
    assert!(!f.interrupt.mask_state().enabled);
    assert!(f.interrupt.mask_state().function_masked);
    // The all-ones pass decoded the BAR at 0xffff8000, then 0x00 turned
    // decoding off.
    let moves = f.moves.lock().unwrap();
    assert!(moves.contains(&Some(0xffff_8000 + NOTIFY_AT)), "{moves:x?}");
    assert_eq!(t.decoded_bar(), Some((0x5a5a_0000, u64::from(BAR_SIZE))));
    assert_eq!(moves.last(), Some(&Some(0x5a5a_0000 + NOTIFY_AT)));
    // Config space is the bus's to count, but for the configuration
    // access capability's window, which these passes set to nonsense
    // (BAR 0xff, 0x00 bytes long, BAR 0x5a) before each write of its data.
    assert!(bad(t) > 0);
}

/// Reads and writes the BAR through the PCI configuration access
/// capability (as firmware does before it maps BARs).
fn window(t: &mut PciTransport, offset: u32, len: u32) {
    t.write_config(PCI_CFG_BAR, &[0]);
    t.write_config(PCI_CFG_OFFSET, &offset.to_le_bytes());
    t.write_config(PCI_CFG_LENGTH, &len.to_le_bytes());
}

fn window_read(t: &mut PciTransport) -> u32 {
    let mut b = [0u8; 4];
    t.read_config(PCI_CFG_DATA, &mut b);
    u32::from_le_bytes(b)
}

#[test]
fn the_configuration_access_capability_reaches_the_bar() {
    let mut f = fixture();
    let t = &mut f.t;
    // Memory decoding is off: only the window reaches the BAR.
    assert_eq!(t.decoded_bar(), None);
    window(t, DEVICE_FEATURE_SELECT as u32, 4);
    t.write_config(PCI_CFG_DATA, &1u32.to_le_bytes());
    assert_eq!(r32(t, DEVICE_FEATURE_SELECT), 1);
    window(t, DEVICE_FEATURE as u32, 4);
    assert_eq!(window_read(t), r32(t, DEVICE_FEATURE));
    assert_eq!(window_read(t), 1, "VIRTIO_F_VERSION_1 is bit 32");
    // A 2-byte window: the number of queues; a 1-byte one: the status.
    window(t, NUM_QUEUES as u32, 2);
    assert_eq!(window_read(t), 2);
    window(t, DEVICE_STATUS as u32, 1);
    t.write_config(PCI_CFG_DATA, &[status::ACKNOWLEDGE as u8]);
    assert_eq!(t.status(), status::ACKNOWLEDGE);
    assert_eq!(bad(t), 0);
    // Nonsense windows: counted, nothing reached, reads zero.
    for (bar, offset, len) in [
        (1u8, 0u32, 4u32),
        (0, 2, 4),
        (0, 0, 3),
        (0, BAR_SIZE - 2, 4),
    ] {
        let before = bad(t);
        t.write_config(PCI_CFG_BAR, &[bar]);
        t.write_config(PCI_CFG_OFFSET, &offset.to_le_bytes());
        t.write_config(PCI_CFG_LENGTH, &len.to_le_bytes());
        t.write_config(PCI_CFG_DATA, &[0xff; 4]);
        assert_eq!(window_read(t), 0, "{bar} {offset:#x} {len}");
        assert_eq!(bad(t), before + 2, "{bar} {offset:#x} {len}");
    }
    assert_eq!(t.status(), status::ACKNOWLEDGE);
}

#[test]
fn save_and_restore_round_trip_the_vectors_and_the_table() {
    let mut f = fixture();
    bring_up(&mut f.t);
    set_masked(&mut f.t, 2, true);
    f.interrupt.trigger_config();
    let saved = f.t.save().unwrap();
    let (regs, pci) = &saved;
    assert_eq!(pci.config_vector, 2);
    assert_eq!(pci.queue_vectors, [0, 1]);
    assert_eq!(pci.msix.len(), VECTORS);
    assert_eq!(pci.msix[1].address, 0xfee0_1000);
    assert_eq!(pci.msix[1].data, 0x41);
    assert!(!pci.msix[1].masked);
    assert!(pci.msix[2].masked && pci.msix[2].pending);
    assert_eq!(regs.status, ADF | status::DRIVER_OK);

    let mut g = fixture();
    g.t.restore(&saved).unwrap();
    {
        let seen = g.seen.lock().unwrap();
        assert_eq!(seen.starts, 1, "the device restarted");
        assert_eq!(seen.activated, Some((MAC | VIRTIO_F_VERSION_1, 2)));
    }
    assert_eq!(g.t.save().unwrap(), saved);
    let routes = g.routes.lock().unwrap().clone();
    for v in 0..VECTORS {
        let want = (v, 0xfee0_0000 + ((v as u64) << 12), 0x40 + v as u32);
        assert!(routes.contains(&want), "{want:x?} not in {routes:x?}");
    }
    // The registers read as they did.
    let t = &mut g.t;
    assert_eq!(r16(t, CONFIG_MSIX_VECTOR), 2);
    w16(t, QUEUE_SELECT, 1);
    assert_eq!(r16(t, QUEUE_MSIX_VECTOR), 1);
    assert_eq!(r32(t, MSIX_TABLE_AT + 24), 0x41);
    assert_eq!(r32(t, MSIX_TABLE_AT + 44), 1, "vector 2 masked");
    // MSI-X enable is the configuration space's (the PCI bus restores
    // it); then the pending config interrupt goes out on unmask.
    t.restore_config(f.t.config().bytes());
    assert!(g.interrupt.mask_state().enabled);
    assert_eq!(r32(t, MSIX_PBA_AT), 0b100);
    set_masked(t, 2, false);
    assert!(fired(&g.vectors[2]));
    assert_eq!(bad(t), 0);
}

#[test]
fn a_hostile_pci_state_is_refused_and_nothing_is_applied() {
    let mut f = fixture();
    bring_up(&mut f.t);
    let saved = f.t.save().unwrap();
    let mut forged = Vec::new();
    let mut s = saved.clone();
    s.1.msix.pop();
    forged.push(s);
    let mut s = saved.clone();
    s.1.msix.push(s.1.msix[0]);
    forged.push(s);
    let mut s = saved.clone();
    s.1.queue_vectors.pop();
    forged.push(s);
    let mut s = saved.clone();
    s.1.queue_vectors.push(0);
    forged.push(s);
    let mut s = saved.clone();
    s.1.queue_vectors[1] = VECTORS as u16;
    forged.push(s);
    let mut s = saved.clone();
    s.1.config_vector = VECTORS as u16;
    forged.push(s);

    let mut g = fixture();
    let fresh = g.t.save().unwrap();
    for s in &forged {
        let e = g.t.restore(s).unwrap_err();
        assert!(matches!(e, TransportStateError::Pci(_)), "{e}");
        assert!(g.t.check_state(&s.0, &s.1).is_err());
    }
    assert_eq!(g.t.save().unwrap(), fresh, "nothing applied");
    assert_eq!(g.seen.lock().unwrap().starts, 0);
    assert!(g.routes.lock().unwrap().is_empty());
    assert_eq!(g.t.status(), 0);
    // The genuine state still goes in afterwards.
    g.t.restore(&saved).unwrap();
    assert_eq!(g.t.save().unwrap(), saved);
}

fn config_address(slot: u32, reg: u32) -> [u8; 4] {
    (1u32 << 31 | slot << 11 | reg).to_le_bytes()
}

fn port_read32(bus: &Mutex<PciBus>, slot: u32, reg: u32) -> u32 {
    let mut bus = bus.lock().unwrap();
    bus.write(0, &config_address(slot, reg));
    let mut b = [0u8; 4];
    bus.read(4, &mut b);
    u32::from_le_bytes(b)
}

fn port_write32(bus: &Mutex<PciBus>, slot: u32, reg: u32, v: u32) {
    let mut bus = bus.lock().unwrap();
    bus.write(0, &config_address(slot, reg));
    bus.write(4, &v.to_le_bytes());
}

#[test]
fn the_pci_bus_finds_the_function_and_its_window_reaches_the_bar() {
    let f = fixture();
    let moves = f.moves.clone();
    let t = Arc::new(Mutex::new(f.t));
    let bus = Arc::new(Mutex::new(PciBus::new()));
    bus.lock().unwrap().add(1, t.clone()).unwrap();
    const WINDOW: u64 = 0xc000_0000;
    let mut window = PciWindow::new(bus.clone(), WINDOW);

    // Enumeration: slot 1 is virtio-net, its BAR sized and placed.
    assert_eq!(port_read32(&bus, 1, 0x00), 0x1041_1af4);
    assert_eq!(port_read32(&bus, 1, 0x08) >> 24, 0x02);
    assert_eq!(port_read32(&bus, 1, 0x34) & 0xff, 0x40);
    port_write32(&bus, 1, 0x10, u32::MAX);
    assert_eq!(port_read32(&bus, 1, 0x10), !(BAR_SIZE - 1));
    let bar = WINDOW + 0x8000;
    port_write32(&bus, 1, 0x10, bar as u32);
    // Nothing decoded before memory is enabled.
    let mut w = [0u8; 2];
    window.read(0x8000 + NUM_QUEUES, &mut w);
    assert_eq!(w, [0xff; 2]);
    assert_eq!(bus.lock().unwrap().bad_accesses(), 1);
    port_write32(&bus, 1, 0x04, 0x0000_0002);
    assert_eq!(port_read32(&bus, 1, 0x04) & 0xffff, 0x0002);
    assert_eq!(*moves.lock().unwrap(), [Some(bar + NOTIFY_AT)]);

    window.read(0x8000 + NUM_QUEUES, &mut w);
    assert_eq!(u16::from_le_bytes(w), 2);
    window.write(0x8000 + DEVICE_STATUS, &[status::ACKNOWLEDGE as u8]);
    assert_eq!(t.lock().unwrap().status(), status::ACKNOWLEDGE);
    let mut b = [0u8; 1];
    window.read(0x8000 + DEVICE_STATUS, &mut b);
    assert_eq!(u32::from(b[0]), status::ACKNOWLEDGE);
    assert_eq!(bus.lock().unwrap().bad_accesses(), 1);

    // Below the BAR, and across its end: all ones, counted by the bus.
    let mut d = [0u8; 4];
    window.read(0x100, &mut d);
    assert_eq!(d, [0xff; 4]);
    window.read(0x8000 + u64::from(BAR_SIZE) - 2, &mut d);
    assert_eq!(d, [0xff; 4]);
    window.write(0x100, &[1, 2, 3, 4]);
    assert_eq!(bus.lock().unwrap().bad_accesses(), 4);
    assert_eq!(t.lock().unwrap().bad_accesses().load(Ordering::Relaxed), 0);
}

//! Writes the seeds of `snapshot_reader`, `mmio_net`, `net_chains` and
//! `rsc` into `fuzz/seeds/<target>/` (each a few KiB, all under 64 KiB):
//!
//!     cd fuzz && cargo run --example make_seeds
//!
//! Snapshot seeds are real snapshot files (`SnapshotWriter`), with device
//! states saved from transports a driver brought up through their
//! registers, and each must go through the whole restore path
//! (`tandem_fuzz::restore`) before it is written. Needs a tap, like the
//! net targets (root, `/dev/net/tun`).

use std::fs;
use std::io::{Cursor, Read};
use std::path::Path;

use devices::GuestMemoryMmap;
use migration::devices::{DeviceState, MmioTransportState, NetState, RtcState, SerialState};
use migration::format::SectionKind;
use migration::kvm::KvmVcpuState;
use migration::manifest::MmioSlot;
use migration::vcpu::VcpuState;
use migration::vm::VmState;
use migration::{section, DeviceConfig, Manifest, SnapshotReader, SnapshotWriter, Snapshottable};
use tandem_fuzz::fixtures;
use tandem_fuzz::mmio::{self, Probed};
use tandem_fuzz::restore::{assemble, restore};
use vm_memory::GuestAddress;
use vmm::boot::layout::ram_ranges;

const MAC: [u8; 6] = [0x02, 0x54, 0x4e, 0x00, 0x00, 0x01];

/// A register write (4 bytes) as the mmio drivers encode it.
fn w(offset: u8, value: u32) -> Vec<u8> {
    let mut op = vec![0x04, offset];
    op.extend_from_slice(&value.to_le_bytes());
    op
}

/// A register read (4 bytes).
fn r(offset: u8) -> Vec<u8> {
    vec![0x05, offset, 0, 0, 0, 0]
}

/// Queue `sel` of `size` entries with its rings at `base` (+0x1000, +0x2000).
fn queue(sel: u32, size: u32, base: u32) -> Vec<u8> {
    [
        w(0x30, sel),
        r(0x34),
        w(0x38, size),
        w(0x80, base),
        w(0x84, 0),
        w(0x90, base + 0x1000),
        w(0x94, 0),
        w(0xa0, base + 0x2000),
        w(0xa4, 0),
        w(0x44, 1),
    ]
    .concat()
}

/// A driver's bring-up: ACKNOWLEDGE, DRIVER, features `lo`/`hi`,
/// FEATURES_OK, the queues, and DRIVER_OK when `start`.
fn bring_up(lo: u32, hi: u32, queues: &[Vec<u8>], start: bool) -> Vec<u8> {
    let mut ops = [
        w(0x70, 1),
        w(0x70, 3),
        w(0x24, 0),
        w(0x20, lo),
        w(0x24, 1),
        w(0x20, hi),
        w(0x70, 0xb),
        r(0x70),
    ]
    .concat();
    for q in queues {
        ops.extend_from_slice(q);
    }
    if start {
        ops.extend(w(0x70, 0xf));
    }
    ops
}

/// Features a Linux driver takes from virtio-net (MAC, STATUS, MRG_RXBUF,
/// the offloads, EVENT_IDX); page 1: VERSION_1, and RSC_EXT with `rsc`.
fn net_features(rsc: bool) -> (u32, u32) {
    (0x2001_99a3, if rsc { 0x2000_0001 } else { 1 })
}

fn write(target: &str, name: &str, bytes: &[u8]) {
    assert!(bytes.len() <= 64 << 10, "seed {target}/{name} is too big");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("seeds")
        .join(target);
    fs::create_dir_all(&dir).expect("seed directory");
    fs::write(dir.join(name), bytes).expect("write a seed");
    println!("{target}/{name}: {} bytes", bytes.len());
}

/// Writes an mmio_net seed after checking where it leaves the status.
fn net_seed(name: &str, rsc: bool, ops: &[u8], status: u32) {
    let mut d = probed_net(fixtures::small_memory(), rsc);
    mmio::drive(&mut d, ops);
    assert_eq!(d.transport.status(), status, "mmio_net seed {name}");
    write("mmio_net", name, &[&[u8::from(rsc)][..], ops].concat());
}

fn mmio_net_seeds() {
    let q = |base| [queue(0, 256, base), queue(1, 256, base + 0x4000)];
    let (lo, hi) = net_features(true);
    let live = bring_up(lo, hi, &q(0), true);
    let kicked = [&live[..], &w(0x50, 0), &w(0x50, 1), &w(0x64, 3)].concat();
    net_seed("live_rsc", true, &kicked, 0xf);
    let (lo, hi) = net_features(false);
    let plain = bring_up(lo, hi, &q(0), true);
    let config: Vec<u8> = (0..10)
        .flat_map(|o| vec![0x01 | 8, o, 0, 0, 0, 0])
        .collect();
    net_seed("live_config", false, &[&plain[..], &config].concat(), 0xf);
    let again = [&plain[..], &w(0x70, 0), &plain].concat();
    net_seed("reset_cycle", false, &again, 0xf);
    // Rings past the end of the 64 KiB memory: DRIVER_OK fails.
    let outside = [&bring_up(lo, hi, &q(0xf000), true)[..], &r(0x60)].concat();
    net_seed("needs_reset", false, &outside, 0x4f);
    // RSC_EXT acked from a device without RSC: FEATURES_OK refused.
    let (_, hi_rsc) = net_features(true);
    net_seed(
        "refused_rsc_ext",
        false,
        &bring_up(lo, hi_rsc, &[], true),
        0x3,
    );
    let failed = [&bring_up(lo, hi, &q(0x8000), false)[..], &w(0x70, 0x8f)].concat();
    net_seed("stopped_queues", true, &failed, 0x8b);
}

/// A transport brought up by `ops` on `mem`, saved.
fn saved(mut d: Probed, ops: &[u8]) -> MmioTransportState {
    mmio::drive(&mut d, ops);
    d.transport.save().expect("save a transport")
}

fn slot(n: u64) -> MmioSlot {
    MmioSlot {
        base: 0xd000_0000 + 0x1000 * n,
        irq: 5 + n as u32,
    }
}

fn vcpu(id: u32) -> VcpuState {
    let mut kvm = KvmVcpuState::default();
    kvm.fpu.fcw = 0x37f;
    kvm.fpu.mxcsr = 0x1f80;
    kvm.xcrs.nr_xcrs = 1;
    kvm.xcrs.xcrs[0].xcr = 0;
    kvm.xcrs.xcrs[0].value = 7;
    kvm.msrs = vec![kvm_bindings::kvm_msr_entry {
        index: 0x10,
        data: 12345,
        ..Default::default()
    }];
    kvm.cpuid = vec![kvm_bindings::kvm_cpuid_entry2 {
        function: 0,
        eax: 0xd,
        ..Default::default()
    }];
    kvm.tsc_khz = 2_000_000;
    kvm.regs.rip = 0x100_0000;
    kvm.regs.rflags = 2;
    kvm.sregs.cr0 = 0x8000_0011;
    VcpuState { id, kvm }
}

struct Snapshot {
    mem_bytes: u64,
    vcpus: u32,
    /// Virtio devices: config and saved state.
    devices: Vec<(DeviceConfig, DeviceState)>,
    fifo: Vec<u8>,
    /// Guest pages to store: (gpa, fill byte).
    pages: Vec<(u64, u8)>,
}

impl Snapshot {
    fn bytes(&self) -> Vec<u8> {
        let mut devices = vec![DeviceConfig::Serial { id: "com1".into() }];
        devices.extend(self.devices.iter().map(|(c, _)| c.clone()));
        let manifest = Manifest {
            tandem_version: "0.1.0".into(),
            mem_bytes: self.mem_bytes,
            vcpus: self.vcpus,
            firmware: None,
            devices,
        };
        let mut w = SnapshotWriter::new(Vec::new()).expect("a writer");
        w.write_state(section::MANIFEST, &manifest)
            .expect("manifest");
        // Chip ids as KVM numbers them (to_kvm refuses others).
        let mut vm = VmState::default();
        vm.pic_master.chip_id = kvm_bindings::KVM_IRQCHIP_PIC_MASTER;
        vm.pic_slave.chip_id = kvm_bindings::KVM_IRQCHIP_PIC_SLAVE;
        vm.ioapic.chip_id = kvm_bindings::KVM_IRQCHIP_IOAPIC;
        w.write_state(section::VM, &vm).expect("vm");
        for id in 0..self.vcpus {
            w.write_state(&section::vcpu(id), &vcpu(id)).expect("vcpu");
        }
        let serial = DeviceState::Serial(SerialState {
            in_buffer: self.fifo.clone(),
            line_status: 0x60,
            ..SerialState::default()
        });
        w.write_state(&section::device("com1"), &serial)
            .expect("serial");
        let mut cmos = vec![0u8; 128];
        cmos[0x0b] = 0x02;
        let rtc = DeviceState::Rtc(RtcState {
            index: 0x0b,
            ram: cmos,
            offset_s: 3600,
        });
        w.write_state(&section::device("rtc"), &rtc).expect("rtc");
        for (c, s) in &self.devices {
            w.write_state(&section::device(c.id()), s).expect("device");
        }
        let pages: Vec<(u64, Vec<u8>)> = self
            .pages
            .iter()
            .map(|&(gpa, b)| (gpa, vec![b; 4096]))
            .collect();
        migration::write_memory(
            &mut w,
            section::MEMORY,
            pages.iter().map(|(g, p)| (*g, p.as_slice())),
        )
        .expect("memory");
        w.finish().expect("finish")
    }
}

fn guest_memory(mem_bytes: u64) -> GuestMemoryMmap {
    let ranges: Vec<_> = ram_ranges(mem_bytes)
        .into_iter()
        .map(|(g, l)| (GuestAddress(g), l as usize))
        .collect();
    GuestMemoryMmap::from_ranges(&ranges).expect("guest memory")
}

fn probed_block(mem: &GuestMemoryMmap, id: &str) -> Probed {
    let (transport, state) = fixtures::block(mem, id, false);
    Probed {
        transport,
        running: Box::new(move || state.lock().unwrap().active.is_some()),
    }
}

fn probed_net(mem: &GuestMemoryMmap, rsc: bool) -> Probed {
    let (transport, state) = fixtures::net(mem, MAC, rsc);
    Probed {
        transport,
        running: Box::new(move || state.lock().unwrap().active.is_some()),
    }
}

fn blk(mem: &GuestMemoryMmap, n: u64, live: bool) -> (DeviceConfig, DeviceState) {
    let id = format!("blk{n}");
    // SEG_MAX and FLUSH, and VERSION_1.
    let ops = bring_up(0x204, 1, &[queue(0, 128, 0x10_0000)], live);
    let transport = saved(probed_block(mem, &id), &ops);
    let config = DeviceConfig::Blk {
        pci: None,
        id: id.clone(),
        path: "/var/lib/tandem/disk.img".into(),
        readonly: false,
        bytes: fixtures::DISK_BYTES,
        serial: id.clone(),
        slot: slot(n),
    };
    let state = DeviceState::VirtioBlk {
        pci: None,
        transport,
        blk: migration::devices::BlkState {
            path: "/var/lib/tandem/disk.img".into(),
            readonly: false,
            acked_features: 0,
            id,
        },
    };
    (config, state)
}

fn net(mem: &GuestMemoryMmap, rsc: bool) -> (DeviceConfig, DeviceState) {
    let (lo, hi) = net_features(rsc);
    let ops = bring_up(
        lo,
        hi,
        &[queue(0, 256, 0x20_0000), queue(1, 256, 0x20_4000)],
        true,
    );
    let transport = saved(probed_net(mem, rsc), &[&ops[..], &w(0x50, 0)].concat());
    let acked_features = transport.acked_features;
    let config = DeviceConfig::Net {
        pci: None,
        id: "net0".into(),
        tap: "tap0".into(),
        mac: MAC,
        rsc,
        slot: slot(0),
    };
    let state = DeviceState::VirtioNet {
        pci: None,
        transport,
        net: NetState {
            mac: MAC,
            acked_features,
            tap: "tap0".into(),
        },
    };
    (config, state)
}

fn snapshot_seeds() {
    let small = 16 << 20;
    let mem = guest_memory(small);
    let seeds = [
        (
            "minimal",
            Snapshot {
                mem_bytes: small,
                vcpus: 1,
                devices: vec![],
                fifo: vec![],
                pages: vec![(0x1000, 0xcc)],
            },
        ),
        (
            "blk_live",
            Snapshot {
                mem_bytes: small,
                vcpus: 1,
                devices: vec![blk(&mem, 0, true)],
                fifo: b"ls\n".to_vec(),
                pages: vec![(0, 1), (0x1000, 2), (0x10_0000, 3)],
            },
        ),
        (
            "net_and_blk",
            Snapshot {
                mem_bytes: small,
                vcpus: 1,
                devices: vec![net(&mem, true), blk(&mem, 1, false)],
                fifo: vec![],
                pages: vec![(0x20_0000, 9)],
            },
        ),
        (
            "two_vcpus",
            Snapshot {
                mem_bytes: small,
                vcpus: 2,
                devices: vec![net(&mem, false)],
                fifo: vec![b'x'; 64],
                pages: vec![(0x3000, 4), (0x5000, 5)],
            },
        ),
        (
            "high_memory",
            Snapshot {
                mem_bytes: 4 << 30,
                vcpus: 1,
                devices: vec![],
                fifo: vec![],
                pages: vec![(0xcfff_f000, 6), (0x1_0000_0000, 7), (0x1_0000_1000, 8)],
            },
        ),
    ];
    for (name, s) in seeds {
        let bytes = s.bytes();
        if let Err(e) = restore(&bytes) {
            panic!("seed {name} does not restore: {e}");
        }
        write("snapshot_reader", name, &bytes);
        let records = records(&bytes);
        assert_eq!(assemble(&records), bytes, "seed {name} as sections");
        write("snapshot_reader", &format!("{name}.sections"), &records);
    }
}

/// The sections of a snapshot file in the record form of `assemble`.
fn records(file: &[u8]) -> Vec<u8> {
    let mut reader = SnapshotReader::open(Cursor::new(file)).expect("a seed opens");
    let mut out = Vec::new();
    for s in reader.sections().to_vec() {
        let (len, mut body) = reader.section_reader(&s.name, s.kind).expect("a section");
        out.push(match s.kind {
            SectionKind::Memory => 1,
            SectionKind::Pages => 2,
            SectionKind::State => 0,
        });
        out.push(s.name.len() as u8);
        out.extend_from_slice(s.name.as_bytes());
        out.extend_from_slice(&u16::try_from(len).expect("a small section").to_le_bytes());
        body.read_to_end(&mut out).expect("read a section");
    }
    out
}

/// net_chains operations (8 bytes each, see the target).
mod chains {
    pub fn desc(ring: u8, idx: u8, addr: u16, len: u16, flags: u8, next: u8) -> Vec<u8> {
        let [a0, a1] = addr.to_le_bytes();
        let [l0, l1] = len.to_le_bytes();
        vec![0, ring | (next << 1), idx, a0, a1, l0, l1, flags]
    }
    pub fn publish(ring: u8, head: u8, count: u8) -> Vec<u8> {
        vec![1, ring, head, 0, count - 1, 0, 0, 0]
    }
    pub fn avail_idx(ring: u8, idx: u16) -> Vec<u8> {
        let [i0, i1] = idx.to_le_bytes();
        vec![2, ring, i0, i1, 0, 0, 0, 0]
    }
    pub fn poke(addr: u16, bytes: [u8; 5]) -> Vec<u8> {
        let [a0, a1] = addr.to_le_bytes();
        [&[3, a0, a1][..], &bytes].concat()
    }
    pub fn raw_rx(len: u16, mult: u8) -> Vec<u8> {
        let [l0, l1] = len.to_le_bytes();
        vec![4, l0, l1, 0, 0, mult, 0, 0]
    }
    pub fn tcp_rx(flow: u8, len: u16, flags: u8, mode: u8) -> Vec<u8> {
        let [l0, l1] = len.to_le_bytes();
        vec![5, flow, l0, l1, flags, mode, 0, 0]
    }
    pub fn tx_kick(accept: u8) -> Vec<u8> {
        vec![6, accept, 0, 0, 0, 0, 0, 0]
    }
    pub fn tick(us: u16) -> Vec<u8> {
        let [u0, u1] = us.to_le_bytes();
        vec![8, u0, u1, 0, 0, 0, 0, 0]
    }
    pub fn activate(features: u8) -> Vec<u8> {
        vec![9, features, 0, 0, 0, 0, 0, 0]
    }
}

fn net_chains_seeds() {
    use chains::*;
    const WRITE: u8 = 2;
    const NEXT: u8 = 1;
    // RX and TX queues of 16 entries.
    let sizes = 4 | (4 << 3);
    let seed = |name: &str, features: u8, ops: Vec<Vec<u8>>| {
        write(
            "net_chains",
            name,
            &[vec![sizes, features], ops.concat()].concat(),
        );
    };
    seed(
        "rx_one_chain",
        0,
        vec![
            desc(0, 0, 0x4000, 2048, WRITE, 0),
            publish(0, 0, 1),
            raw_rx(1000, 3),
        ],
    );
    seed(
        "rx_mergeable",
        1,
        vec![
            desc(0, 0, 0x4000, 1500, WRITE, 0),
            desc(0, 1, 0x5000, 1500, WRITE, 0),
            desc(0, 2, 0x6000, 1500, WRITE, 0),
            publish(0, 0, 1),
            raw_rx(4000, 5),
            publish(0, 1, 2),
            raw_rx(60, 1),
        ],
    );
    seed(
        "tx_split_frame",
        2,
        vec![
            desc(1, 0, 0x8000, 12, NEXT, 1),
            desc(1, 1, 0x8100, 60, 0, 0),
            poke(0x8100, [0xff; 5]),
            publish(1, 0, 1),
            tx_kick(0),
            tx_kick(0xff),
        ],
    );
    // RSC on, GUEST_CSUM, TSO4, TSO6, mergeable.
    let mut rsc = vec![];
    for i in 0..4u16 {
        rsc.push(desc(0, i as u8, 0x4000 + 0x2000 * i, 0x2000, WRITE, 0));
    }
    rsc.push(publish(0, 0, 4));
    for _ in 0..4 {
        rsc.push(tcp_rx(0, 1448, 0, 0));
    }
    rsc.push(tcp_rx(9, 1000, 0, 1));
    rsc.push(tick(400));
    rsc.push(tcp_rx(0, 1448, 0x08, 0));
    seed("rsc_bulk", 0x3d, rsc);
    seed(
        "hostile",
        0x03,
        vec![
            desc(0, 0, 0x4000, 64, WRITE | NEXT, 1),
            desc(0, 1, 0x4100, 64, WRITE | NEXT, 0),
            publish(0, 0, 1),
            raw_rx(200, 7),
            desc(1, 0, 0xfff0, 0x100, 0, 0),
            desc(1, 1, 0x4000, 64, WRITE, 0),
            publish(1, 0, 2),
            tx_kick(0xff),
            avail_idx(1, 0x8000),
            tx_kick(0xff),
            activate(0x01),
        ],
    );
}

/// rsc operations (see the target).
mod rsc_ops {
    /// A data segment of `flow` with `len` bytes; `odd` is a[8].
    pub fn seg(flow: u8, len: u16, flags: u8, seq_step: u8, ts: u8, odd: u8) -> Vec<u8> {
        let [l0, l1] = len.to_le_bytes();
        vec![0, flow, flags, l0, l1, seq_step, 0, 0, ts, odd, 0, 0]
    }
    pub fn tick(us: u16) -> Vec<u8> {
        let [u0, u1] = us.to_le_bytes();
        vec![3, u0, u1]
    }
    pub fn flush_all() -> Vec<u8> {
        vec![4]
    }
    pub fn reconfigure(cfg: u8) -> Vec<u8> {
        vec![5, cfg]
    }
    pub fn raw(bytes: &[u8]) -> Vec<u8> {
        [&[2, bytes.len() as u8][..], bytes].concat()
    }
}

fn rsc_seeds() {
    use rsc_ops::*;
    let seed = |name: &str, cfg: u8, ops: Vec<Vec<u8>>| {
        write("rsc", name, &[vec![cfg], ops.concat()].concat());
    };
    let bulk = |flow, n, len, ts, odd| -> Vec<Vec<u8>> {
        (0..n).map(|_| seg(flow, len, 0, 0, ts, odd)).collect()
    };
    // TSO4 + CSUM.
    let mut v4 = bulk(0, 10, 1448, 0, 0);
    v4.push(seg(0, 1448, 0x08, 0, 0, 0));
    seed("bulk_v4", 0x05, v4);
    // TSO6 + CSUM + RSC_EXT, timestamps moving on.
    let mut v6 = bulk(1, 8, 1428, 0x07, 0);
    v6.push(seg(1, 0, 0, 0, 0x07, 0));
    v6.push(seg(1, 0, 0, 0, 0x07, 0));
    seed("bulk_v6_ts_rsc_ext", 0x0e, v6);
    let mut mixed = vec![];
    for i in 0..6 {
        mixed.push(seg(2, 1448, 0, 0, 0, 0x40));
        mixed.push(seg(4, 1000, 0, if i == 3 { 1 } else { 0 }, 0, 0x80));
    }
    mixed.push(tick(500));
    mixed.push(raw(&[0u8; 60]));
    mixed.push(reconfigure(0x0f));
    mixed.extend(bulk(6, 3, 500, 0, 0x02));
    mixed.push(flush_all());
    seed("mixed_flows", 0x07, mixed);
    // A 1 KiB cap: every third segment starts a new packet.
    seed("size_cap", 0x17, bulk(8, 9, 400, 0, 0));
    let mut many = vec![];
    for flow in 0..40 {
        many.push(seg(flow, 100, 0, 0, 0, 0));
    }
    many.extend(bulk(0, 2, 100, 0, 0));
    seed("many_flows", 0x07, many);
}

fn main() {
    snapshot_seeds();
    mmio_net_seeds();
    net_chains_seeds();
    rsc_seeds();
}

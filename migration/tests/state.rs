//! State types: the KVM structures of the vCPU and VM sections (kvm-bindings' serde, held
//! to exact sizes), conversions from and to vm-superio and virtio-queue, their JSON shape,
//! refusal of wrong sizes and counts, and a whole snapshot saved and restored.

mod common;

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_fpu, kvm_irqchip,
    kvm_irqchip__bindgen_ty_1, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_pic_state,
    kvm_pit_state2, kvm_regs, kvm_segment, kvm_sregs, kvm_vcpu_events, kvm_xcr, kvm_xcrs,
    kvm_xsave, CpuId, Msrs, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use migration::devices::{
    BlkState, DeviceState, MmioTransportState, NetState, QueueState, SerialState,
};
use migration::kvm::{KvmStateError, KvmVcpuState, KvmVmState};
use migration::vcpu::VcpuState;
use migration::vm::VmState;
use migration::Snapshottable;
use proptest::prelude::*;
use serde_json::Value;
use zerocopy::{FromBytes, IntoBytes};

fn json_round_trip<T: serde::Serialize + serde::de::DeserializeOwned>(v: &T) -> T {
    serde_json::from_slice(&serde_json::to_vec(v).unwrap()).unwrap()
}

fn seg(n: u64) -> kvm_segment {
    kvm_segment {
        base: n << 12,
        limit: 0xffff_ffff - n as u32,
        selector: n as u16 * 8,
        type_: 11,
        present: 1,
        dpl: (n % 4) as u8,
        db: 1,
        s: 1,
        l: 1,
        g: 1,
        avl: 1,
        unusable: 0,
        padding: 0,
    }
}

fn cpuid_entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
    kvm_cpuid_entry2 {
        function,
        index,
        flags: index,
        eax: function ^ 0x1111,
        ebx: 0x756e_6547,
        ecx: 0x6c65_746e,
        edx: 0x4965_6e69 + index,
        padding: [0; 3],
    }
}

/// A vCPU state with a different value in every field.
fn kvm_vcpu() -> KvmVcpuState {
    let mut k = KvmVcpuState {
        regs: kvm_regs {
            rax: 1,
            rbx: 2,
            rcx: 3,
            rdx: 4,
            rsi: 5,
            rdi: 6,
            rsp: 7,
            rbp: 8,
            r8: 9,
            r9: 10,
            r10: 11,
            r11: 12,
            r12: 13,
            r13: 14,
            r14: 15,
            r15: 16,
            rip: 0xffff_ffff_8100_0000,
            rflags: 0x246,
        },
        sregs: kvm_sregs {
            cs: seg(1),
            ds: seg(2),
            es: seg(3),
            fs: seg(4),
            gs: seg(5),
            ss: seg(6),
            tr: seg(7),
            ldt: seg(8),
            cr0: 0x8005_0033,
            cr2: 0xdead_b000,
            cr3: 0x1234_5000,
            cr4: 0x3606f0,
            cr8: 1,
            efer: 0xd01,
            apic_base: 0xfee0_0900,
            interrupt_bitmap: [1, 2, 3, 1 << 63],
            ..Default::default()
        },
        fpu: kvm_fpu {
            fcw: 0x37f,
            fsw: 1,
            ftwx: 2,
            last_opcode: 3,
            last_ip: 4,
            last_dp: 5,
            mxcsr: 0x1f80,
            ..Default::default()
        },
        xsave: kvm_xsave::default(),
        xcrs: kvm_xcrs {
            nr_xcrs: 2,
            ..Default::default()
        },
        msrs: vec![
            kvm_msr_entry {
                index: 0x10,
                reserved: 0,
                data: 123_456_789,
            },
            kvm_msr_entry {
                index: 0xc000_0080,
                reserved: 0,
                data: 0xd01,
            },
        ],
        lapic: kvm_lapic_state::default(),
        mp_state: kvm_mp_state { mp_state: 3 },
        events: kvm_vcpu_events::default(),
        debugregs: kvm_debugregs {
            db: [1, 2, 3, 4],
            dr6: 0xffff0ff0,
            dr7: 0x400,
            flags: 0,
            reserved: [0; 9],
        },
        cpuid: vec![cpuid_entry(0, 0), cpuid_entry(7, 0), cpuid_entry(7, 1)],
        tsc_khz: 2_894_560,
    };
    k.sregs.gdt.base = 0xffff_fe00_0000_1000;
    k.sregs.gdt.limit = 0x7f;
    k.sregs.idt.base = 0xffff_fe00_0000_0000;
    k.sregs.idt.limit = 0xfff;
    for (i, r) in k.fpu.fpr.as_flattened_mut().iter_mut().enumerate() {
        *r = i as u8;
    }
    for (i, r) in k.fpu.xmm.as_flattened_mut().iter_mut().enumerate() {
        *r = 255 - i as u8;
    }
    for (i, w) in k.xsave.region.iter_mut().enumerate() {
        *w = (i as u32).wrapping_mul(0x9e37_79b9);
    }
    k.xcrs.xcrs[0] = kvm_xcr {
        xcr: 0,
        reserved: 0,
        value: 7,
    };
    k.xcrs.xcrs[1] = kvm_xcr {
        xcr: 1,
        reserved: 0,
        value: 3,
    };
    for (i, r) in k.lapic.regs.iter_mut().enumerate() {
        *r = (i % 251) as std::os::raw::c_char;
    }
    k.events.exception.injected = 1;
    k.events.exception.nr = 14;
    k.events.exception.has_error_code = 1;
    k.events.exception.error_code = 2;
    k.events.interrupt.nr = 0x30;
    k.events.interrupt.shadow = 1;
    k.events.nmi.masked = 1;
    k.events.sipi_vector = 9;
    k.events.flags = 0x3f;
    k.events.smi.latched_init = 1;
    k.events.triple_fault.pending = 1;
    k.events.exception_has_payload = 1;
    k.events.exception_payload = 0xdead_b000;
    k
}

/// A chip of `id` whose 512-byte area is `bytes`.
fn chip(id: u32, bytes: &[u8]) -> kvm_irqchip {
    kvm_irqchip {
        chip_id: id,
        pad: 0,
        chip: kvm_irqchip__bindgen_ty_1::read_from_bytes(bytes).unwrap(),
    }
}

fn kvm_vm() -> KvmVmState {
    let mut master = kvm_irqchip {
        chip_id: KVM_IRQCHIP_PIC_MASTER,
        ..Default::default()
    };
    master.chip.pic = kvm_pic_state {
        irr: 1,
        imr: 0xfb,
        irq_base: 0x30,
        elcr_mask: 0xf8,
        ..Default::default()
    };
    let bytes: Vec<u8> = (0..512).map(|i| (i * 7) as u8).collect();
    let mut pit = kvm_pit_state2 {
        flags: 1,
        ..Default::default()
    };
    pit.channels[0].count = 0x10000;
    pit.channels[2].mode = 3;
    pit.channels[1].count_load_time = -5;
    KvmVmState {
        pic_master: master,
        pic_slave: chip(KVM_IRQCHIP_PIC_SLAVE, &[0; 512]),
        ioapic: chip(KVM_IRQCHIP_IOAPIC, &bytes),
        pit,
        clock: kvm_clock_data {
            clock: 1_000_000,
            flags: 6,
            realtime: 2,
            host_tsc: 3,
            ..Default::default()
        },
    }
}

#[test]
fn vcpu_state_round_trips_through_json_to_the_same_kvm_structures() {
    let k = kvm_vcpu();
    let state = json_round_trip(&VcpuState::from_kvm(3, &k));
    assert_eq!(state.id, 3);
    let back = state.to_kvm().unwrap();
    assert_eq!(back.regs, k.regs);
    assert_eq!(back.sregs, k.sregs);
    assert_eq!(back.fpu, k.fpu);
    assert_eq!(back.xsave.region, k.xsave.region);
    assert_eq!(back.xcrs, k.xcrs);
    assert_eq!(back.msrs, k.msrs);
    assert_eq!(back.lapic.regs, k.lapic.regs);
    assert_eq!(back.mp_state, k.mp_state);
    assert_eq!(back.events, k.events);
    assert_eq!(back.debugregs, k.debugregs);
    assert_eq!(back.cpuid, k.cpuid);
    assert_eq!(back.tsc_khz, 2_894_560);
    assert_eq!(back, k);
    assert_eq!(VcpuState::from_kvm(3, &back), state);
    // What the vmm hands to KVM_SET_MSRS and KVM_SET_CPUID2.
    let msrs = Msrs::from_entries(&back.msrs).unwrap();
    assert_eq!(msrs.as_slice(), k.msrs.as_slice());
    let cpuid = CpuId::from_entries(&back.cpuid).unwrap();
    assert_eq!(cpuid.as_slice(), k.cpuid.as_slice());
}

#[test]
fn vm_state_round_trips_through_json_to_the_same_kvm_structures() {
    let k = kvm_vm();
    let state = json_round_trip(&VmState::from_kvm(&k));
    assert_eq!(
        &state.pic_master.chip.as_bytes()[..16],
        &[0, 1, 0xfb, 0, 0, 0x30, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xf8]
    );
    let bytes: Vec<u8> = (0..512).map(|i| (i * 7) as u8).collect();
    assert_eq!(state.ioapic.chip.as_bytes(), &bytes[..]);
    let back = state.to_kvm().unwrap();
    assert_eq!(back.ioapic.chip_id, KVM_IRQCHIP_IOAPIC);
    assert_eq!(back.pit, k.pit);
    assert_eq!(back.clock, k.clock);
    assert_eq!(back, k);
    assert_eq!(VmState::from_kvm(&back), state);
}

/// `state` as JSON, changed by `edit`, read back.
fn edited<T: serde::Serialize + serde::de::DeserializeOwned>(
    state: &T,
    edit: impl FnOnce(&mut Value),
) -> Result<T, String> {
    let mut v = serde_json::to_value(state).unwrap();
    edit(&mut v);
    serde_json::from_str(&v.to_string()).map_err(|e| e.to_string())
}

fn array(v: &mut Value) -> &mut Vec<Value> {
    v.as_array_mut().expect("a JSON array")
}

#[test]
fn areas_of_the_wrong_size_are_refused_before_kvm_sees_them() {
    let s = VcpuState::from_kvm(0, &kvm_vcpu());
    let e = edited(&s, |v| {
        array(&mut v["kvm"]["lapic"]).pop();
    })
    .unwrap_err();
    assert!(
        e.starts_with("kvm_lapic_state is 1023 bytes, KVM takes 1024"),
        "{e}"
    );
    let e = edited(&s, |v| array(&mut v["kvm"]["xsave"]).push(0.into())).unwrap_err();
    assert!(
        e.starts_with("kvm_xsave is 4097 bytes, KVM takes 4096"),
        "{e}"
    );
    let e = edited(&s, |v| array(&mut v["kvm"]["regs"]).truncate(8)).unwrap_err();
    assert!(e.starts_with("kvm_regs is 8 bytes, KVM takes 144"), "{e}");
    let e = edited(&s, |v| v["kvm"]["fpu"]["xmm"] = "".into()).unwrap_err();
    assert!(
        e.starts_with("XMM registers is 0 bytes, KVM takes 256"),
        "{e}"
    );
    let e = edited(&s, |v| {
        array(&mut v["kvm"]["cpuid"][0]).pop();
    })
    .unwrap_err();
    assert!(
        e.starts_with("kvm_cpuid_entry2 is 39 bytes, KVM takes 40"),
        "{e}"
    );
    let mut bad = s.clone();
    bad.kvm.xcrs.nr_xcrs = 17;
    assert_eq!(
        bad.to_kvm(),
        Err(KvmStateError::TooMany {
            what: "XCRs",
            found: 17,
            max: 16
        })
    );
    let v = VmState::from_kvm(&kvm_vm());
    let e = edited(&v, |v| array(&mut v["ioapic"]).truncate(511)).unwrap_err();
    assert!(
        e.starts_with("kvm_irqchip is 511 bytes, KVM takes 520"),
        "{e}"
    );
    // A chip saved under another chip's id would make KVM_SET_IRQCHIP set that chip.
    let mut swapped = v.clone();
    swapped.pic_slave.chip_id = KVM_IRQCHIP_IOAPIC;
    assert_eq!(
        swapped.to_kvm().err().unwrap().to_string(),
        "PIC slave state has chip id 2, KVM's is 1"
    );
}

#[test]
fn lists_over_the_kernels_arrays_are_refused() {
    let s = VcpuState::from_kvm(0, &kvm_vcpu());
    let msr = serde_json::to_value(kvm_msr_entry::default()).unwrap();
    let e = edited(&s, |v| *array(&mut v["kvm"]["msrs"]) = vec![msr; 257]).unwrap_err();
    assert!(
        e.starts_with("MSRs: 257 entries, KVM takes at most 256"),
        "{e}"
    );
    let entry = serde_json::to_value(cpuid_entry(1, 0)).unwrap();
    let e = edited(&s, |v| *array(&mut v["kvm"]["cpuid"]) = vec![entry; 300]).unwrap_err();
    assert!(
        e.starts_with("CPUID entries: 300 entries, KVM takes at most 256"),
        "{e}"
    );
    // Built in code rather than read: `to_kvm` checks the same bounds.
    let mut big = s.clone();
    big.kvm.msrs = vec![Default::default(); 257];
    assert!(matches!(big.to_kvm(), Err(KvmStateError::TooMany { .. })));
    let mut big = s.clone();
    big.kvm.cpuid = vec![Default::default(); 257];
    assert!(matches!(big.to_kvm(), Err(KvmStateError::TooMany { .. })));
}

#[test]
fn a_section_without_cpuid_or_tsc_or_with_unknown_fields_is_refused() {
    let s = VcpuState::from_kvm(0, &kvm_vcpu());
    for field in ["cpuid", "tsc_khz"] {
        let e = edited(&s, |v| {
            v["kvm"].as_object_mut().unwrap().remove(field);
        })
        .unwrap_err();
        assert!(e.contains(&format!("missing field `{field}`")), "{e}");
    }
    let e = edited(&s, |v| v["kvm"]["bogus"] = 1.into()).unwrap_err();
    assert!(e.contains("unknown field `bogus`"), "{e}");
    let e = edited(&VmState::default(), |v| v["extra"] = 1.into()).unwrap_err();
    assert!(e.contains("unknown field `extra`"), "{e}");
}

#[test]
fn json_shape_is_kvm_bindings_bytes_and_hex() {
    let k = kvm_vcpu();
    let v = serde_json::to_value(VcpuState::from_kvm(1, &k)).unwrap();
    let keys: Vec<&String> = v["kvm"].as_object().unwrap().keys().collect();
    // (serde_json's map sorts its keys.)
    assert_eq!(
        keys,
        [
            "cpuid",
            "debugregs",
            "events",
            "fpu",
            "lapic",
            "mp_state",
            "msrs",
            "regs",
            "sregs",
            "tsc_khz",
            "xcrs",
            "xsave"
        ]
    );
    // Each KVM structure is what kvm-bindings writes: its bytes.
    assert_eq!(v["kvm"]["regs"], serde_json::to_value(k.regs).unwrap());
    assert_eq!(v["kvm"]["regs"].as_array().unwrap().len(), 144);
    assert_eq!(
        v["kvm"]["sregs"].as_array().unwrap()[..8],
        [0, 16, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(v["kvm"]["cpuid"].as_array().unwrap().len(), 3);
    assert_eq!(
        v["kvm"]["cpuid"][1],
        serde_json::to_value(k.cpuid[1]).unwrap()
    );
    assert_eq!(v["kvm"]["tsc_khz"], 2_894_560);
    // The FPU, by hand (kvm_fpu has no serde impl), keeps named fields and hex.
    assert_eq!(v["kvm"]["fpu"]["fcw"], 0x37f);
    assert!(v["kvm"]["fpu"]["fpr"]
        .as_str()
        .unwrap()
        .starts_with("00010203"));

    let serial = DeviceState::Serial(SerialState {
        in_buffer: b"ok\n".to_vec(),
        ..Default::default()
    });
    let text = serde_json::to_string(&serial).unwrap();
    assert!(text.starts_with(r#"{"kind":"serial","#), "{text}");
    assert!(text.ends_with(r#""in_buffer":"6f6b0a"}"#), "{text}");
    // Unknown fields and bad hex are refused, not ignored.
    let extra = text.replace(r#""scratch""#, r#""bogus":1,"scratch""#);
    assert!(serde_json::from_str::<DeviceState>(&extra).is_err());
    let bad_hex = text.replace("6f6b0a", "6f6b0");
    assert!(serde_json::from_str::<DeviceState>(&bad_hex).is_err());
    assert!(serde_json::from_str::<DeviceState>(r#"{"kind":"sound"}"#).is_err());
}

const FIELDS: [(&str, usize); 9] = [
    ("regs", 144),
    ("sregs", 312),
    ("xsave", 4096),
    ("xcrs", 392),
    ("lapic", 1024),
    ("mp_state", 4),
    ("events", 64),
    ("debugregs", 128),
    ("cpuid", 40),
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Any length of any KVM area reads back only at the structure's size, and nothing
    /// a section holds there makes the reader panic.
    #[test]
    fn every_area_is_read_only_at_its_size(field in 0..FIELDS.len(), len in 0usize..5000, fill in any::<u8>()) {
        let (name, size) = FIELDS[field];
        let s = VcpuState::from_kvm(0, &kvm_vcpu());
        let bytes: Vec<Value> = std::iter::repeat_n(Value::from(fill), len).collect();
        let r = edited(&s, |v| {
            let slot = if name == "cpuid" { &mut v["kvm"]["cpuid"][0] } else { &mut v["kvm"][name] };
            *slot = bytes.into();
        });
        prop_assert_eq!(r.is_ok(), len == size, "{} with {} bytes: {:?}", name, len, r.err());
    }

    /// Whatever a section's bytes are, reading them is an error or a state, never a panic.
    #[test]
    fn arbitrary_section_text_never_panics(cut in 0usize..40_000, flip in any::<u8>()) {
        let mut text = serde_json::to_vec(&VcpuState::from_kvm(0, &kvm_vcpu())).unwrap();
        let at = cut % text.len();
        text[at] ^= flip;
        text.truncate(text.len() - (cut % 7));
        let _ = serde_json::from_slice::<VcpuState>(&text);
        let _ = serde_json::from_slice::<VmState>(&text);
    }
}

#[test]
fn device_states_round_trip_and_convert() {
    let uart = vm_superio::serial::SerialState {
        line_control: 3,
        in_buffer: vec![1, 2, 3],
        ..Default::default()
    };
    let serial = SerialState::from(&uart);
    assert_eq!(vm_superio::serial::SerialState::from(&serial), uart);
    let q = virtio_queue::QueueState {
        max_size: 256,
        size: 128,
        ready: true,
        desc_table: 0x1000,
        avail_ring: 0x2000,
        used_ring: 0x3000,
        next_avail: 5,
        next_used: 4,
        event_idx_enabled: true,
    };
    let queue = QueueState::from(&q);
    assert_eq!(virtio_queue::QueueState::from(&queue), q);
    let transport = MmioTransportState {
        status: 0xf,
        acked_features: 1 << 32 | 1 << 5,
        queue_sel: 1,
        interrupt_status: 1,
        config_generation: 2,
        queues: vec![queue, queue],
        ..Default::default()
    };
    let states = [
        DeviceState::Serial(serial),
        DeviceState::VirtioNet {
            pci: None,
            transport: transport.clone(),
            net: NetState {
                mac: [0x52, 0x54, 0, 0x12, 0x34, 0x56],
                acked_features: 1 << 5,
                tap: "tap0".into(),
            },
        },
        DeviceState::VirtioBlk {
            pci: None,
            transport,
            blk: BlkState {
                path: "/var/lib/disk.img".into(),
                readonly: true,
                acked_features: 1,
                id: "blk0".into(),
            },
        },
    ];
    for s in &states {
        assert_eq!(&json_round_trip(s), s);
    }
    let net = serde_json::to_string(&states[1]).unwrap();
    assert!(net.contains(r#""mac":"52:54:00:12:34:56""#), "{net}");
}

/// A toy component, to show the trait's use end to end.
struct Counter(u64);

#[derive(Debug, thiserror::Error)]
#[error("counter state {0} is out of range")]
struct CounterError(u64);

impl Snapshottable for Counter {
    type State = u64;
    type Error = CounterError;

    fn save(&self) -> Result<u64, CounterError> {
        Ok(self.0)
    }

    fn restore(&mut self, state: &u64) -> Result<(), CounterError> {
        if *state > 1000 {
            return Err(CounterError(*state));
        }
        self.0 = *state;
        Ok(())
    }
}

#[test]
fn a_whole_snapshot_saves_and_restores() {
    use migration::manifest::{DeviceConfig, Manifest, MmioSlot};
    use migration::{section, SnapshotWriter};

    let manifest = Manifest {
        tandem_version: "0.1.0".into(),
        mem_bytes: 8 << 20,
        vcpus: 1,
        firmware: None,
        devices: vec![DeviceConfig::Net {
            pci: None,
            id: "net0".into(),
            tap: "tap0".into(),
            mac: [2, 0, 0, 0, 0, 1],
            rsc: true,
            slot: MmioSlot {
                base: 0xd000_0000,
                irq: 5,
            },
        }],
    };
    let mut guest = vec![0u8; 8 << 20];
    guest[0x7000..0x9000].fill(0x90);
    let vcpu = VcpuState::from_kvm(0, &kvm_vcpu());
    let counter = Counter(42);

    let mut w = SnapshotWriter::new(Vec::new()).unwrap();
    w.write_state(section::MANIFEST, &manifest).unwrap();
    w.write_state(&section::vcpu(0), &vcpu).unwrap();
    w.write_state(&section::device("counter"), &counter.save().unwrap())
        .unwrap();
    migration::write_memory(&mut w, section::MEMORY, [(0, guest.as_slice())]).unwrap();
    let file = w.finish().unwrap();
    // Two pages of data, the states, and up to a page of padding before the pages.
    assert!(file.len() < 36 << 10, "{} bytes", file.len());

    let mut r = common::open(&file).unwrap();
    let saved: Manifest = r.read_state(section::MANIFEST).unwrap();
    assert_eq!(migration::check_compatible(&saved, &manifest), Ok(vec![]));
    assert_eq!(r.read_state::<VcpuState>("vcpu.0").unwrap(), vcpu);
    let mut fresh = Counter(0);
    fresh
        .restore(&r.read_state(&section::device("counter")).unwrap())
        .unwrap();
    assert_eq!(fresh.0, 42);
    let mut restored = vec![0u8; 8 << 20];
    migration::read_memory(&mut r, section::MEMORY, &[(0, 8 << 20)], |gpa, b: &[u8]| {
        restored[gpa as usize..gpa as usize + b.len()].copy_from_slice(b);
        Ok::<(), std::io::Error>(())
    })
    .unwrap();
    assert!(restored == guest);
}

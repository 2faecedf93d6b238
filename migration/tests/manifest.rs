//! The compatibility check of a restore: every difference is named, backends may move.

use migration::manifest::{check_compatible, CompatError, DeviceConfig, Manifest, MmioSlot};

fn net(id: &str, tap: &str, mac_last: u8, base: u64) -> DeviceConfig {
    DeviceConfig::Net {
        pci: None,
        id: id.into(),
        tap: tap.into(),
        mac: [0x52, 0x54, 0, 0, 0, mac_last],
        rsc: false,
        slot: MmioSlot {
            base,
            irq: 5 + ((base - 0xd000_0000) >> 12) as u32,
        },
    }
}

fn blk(id: &str, path: &str, readonly: bool) -> DeviceConfig {
    DeviceConfig::Blk {
        pci: None,
        id: id.into(),
        path: path.into(),
        readonly,
        bytes: 64 << 20,
        serial: "data".into(),
        slot: MmioSlot {
            base: 0xd000_2000,
            irq: 7,
        },
    }
}

fn vm(mem_mib: u64, vcpus: u32, devices: Vec<DeviceConfig>) -> Manifest {
    Manifest {
        tandem_version: "0.1.0".into(),
        mem_bytes: mem_mib << 20,
        vcpus,
        firmware: None,
        devices,
    }
}

fn saved() -> Manifest {
    vm(
        128,
        1,
        vec![
            DeviceConfig::Serial { id: "com1".into() },
            net("eth0", "tap0", 1, 0xd000_0000),
            blk("blk0", "/srv/root.img", false),
        ],
    )
}

fn problems(requested: &Manifest) -> Vec<String> {
    match check_compatible(&saved(), requested) {
        Err(CompatError::Mismatch(p)) => p,
        Err(other) => panic!("not a snapshot's mismatch: {other:?}"),
        Ok(notes) => panic!("accepted, notes {notes:?}"),
    }
}

#[test]
fn the_same_vm_is_compatible() {
    assert_eq!(check_compatible(&saved(), &saved()), Ok(vec![]));
    // Device order and the writer's version do not matter.
    let mut other = saved();
    other.devices.reverse();
    other.tandem_version = "0.2.0".into();
    assert_eq!(check_compatible(&saved(), &other), Ok(vec![]));
}

#[test]
fn backends_may_move_and_are_reported() {
    let moved = vm(
        128,
        1,
        vec![
            DeviceConfig::Serial { id: "com1".into() },
            net("eth0", "tap7", 1, 0xd000_0000),
            blk("blk0", "/mnt/copy.img", false),
        ],
    );
    assert_eq!(
        check_compatible(&saved(), &moved),
        Ok(vec![
            "NIC eth0: snapshot was on tap0, now on tap7".to_string(),
            "disk blk0: snapshot was on /srv/root.img, now on /mnt/copy.img".to_string(),
        ])
    );
}

#[test]
fn every_difference_is_listed() {
    let requested = vm(
        256,
        2,
        vec![
            DeviceConfig::Serial { id: "com1".into() },
            blk("blk0", "/srv/root.img", true),
            net("eth1", "tap1", 2, 0xd000_1000),
        ],
    );
    assert_eq!(
        problems(&requested),
        [
            "snapshot has 128 MiB of memory, this VM asks for 256 MiB",
            "snapshot has 1 vCPU, this VM asks for 2",
            "snapshot has NIC eth0 on tap0; none given",
            "disk blk0: snapshot has it read-write, this VM asks for read-only",
            "this VM asks for NIC eth1 on tap1, which the snapshot does not have",
        ]
    );
    let err = check_compatible(&saved(), &requested).err().unwrap();
    assert!(err
        .to_string()
        .starts_with("the snapshot does not fit this VM: snapshot has 128 MiB of memory"));
}

#[test]
fn guest_visible_device_changes_are_refused() {
    let requested = vm(
        128,
        1,
        vec![
            DeviceConfig::Serial { id: "com1".into() },
            net("eth0", "tap0", 9, 0xd000_1000),
            net("blk0", "tap3", 3, 0xd000_3000),
        ],
    );
    assert_eq!(
        problems(&requested),
        [
            "NIC eth0: snapshot has MAC 52:54:00:00:00:01, this VM asks for 52:54:00:00:00:09",
            "NIC eth0: snapshot has it at MMIO 0xd0000000 irq 5, this VM puts it at MMIO 0xd0001000 irq 6",
            "snapshot has disk blk0 on /srv/root.img, this VM asks for NIC blk0 on tap3",
        ]
    );
}

#[test]
fn rsc_disk_size_and_disk_id_must_match() {
    let mut requested = saved();
    for d in &mut requested.devices {
        match d {
            DeviceConfig::Net { rsc, .. } => *rsc = true,
            DeviceConfig::Blk { bytes, serial, .. } => {
                *bytes = 32 << 20;
                *serial = "other".into();
            }
            DeviceConfig::Serial { .. } | DeviceConfig::PciHost { .. } => {}
        }
    }
    assert_eq!(
        problems(&requested),
        [
            "NIC eth0: snapshot has rsc=off, this VM asks for rsc=on",
            "disk blk0: snapshot has a disk of 64 MiB, /srv/root.img is 32 MiB",
            "disk blk0: snapshot has id \"data\", this VM asks for \"other\"",
        ]
    );
}

#[test]
fn a_manifest_without_the_newer_device_fields_still_reads() {
    let text = r#"{"mem_bytes":134217728,"vcpus":1,"devices":[
        {"kind":"net","id":"net0","tap":"t","mac":"52:54:00:00:00:01","slot":{"base":1,"irq":5}},
        {"kind":"blk","id":"blk0","path":"p","readonly":false,"slot":{"base":2,"irq":6}}]}"#;
    let m: Manifest = serde_json::from_str(text).unwrap();
    assert!(matches!(m.devices[0], DeviceConfig::Net { rsc: false, .. }));
    assert!(matches!(m.devices[1], DeviceConfig::Blk { bytes: 0, .. }));
}

#[test]
fn odd_memory_sizes_are_given_in_bytes() {
    let mut requested = saved();
    requested.mem_bytes += 4096;
    assert_eq!(
        problems(&requested),
        ["snapshot has 128 MiB of memory, this VM asks for 134221824 bytes"]
    );
}

#[test]
fn the_manifest_is_json_with_tagged_devices() {
    let text = serde_json::to_string(&saved()).unwrap();
    assert!(text.contains(r#"{"kind":"net","id":"eth0","tap":"tap0","mac":"52:54:00:00:00:01","rsc":false,"slot":{"base":3489660928,"irq":5}}"#), "{text}");
    let back: Manifest = serde_json::from_str(&text).unwrap();
    assert_eq!(back, saved());
}

#[test]
fn the_pci_host_bridge_must_be_asked_for_and_only_then() {
    let pci = DeviceConfig::PciHost { id: "pci0".into() };
    let mut with_pci = saved();
    with_pci.devices.insert(1, pci);
    assert_eq!(check_compatible(&with_pci, &with_pci), Ok(vec![]));
    assert_eq!(
        problems(&with_pci),
        vec!["this VM asks for PCI host bridge pci0 (--machine pci), which the snapshot does not have"]
    );
    match check_compatible(&with_pci, &saved()) {
        Err(CompatError::Mismatch(p)) => assert_eq!(
            p,
            vec!["snapshot has PCI host bridge pci0 (--machine pci); none given"]
        ),
        other => panic!("{other:?}"),
    }
}

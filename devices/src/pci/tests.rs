use super::*;

fn addr(slot: u32, reg: u32) -> [u8; 4] {
    (ENABLE | slot << 11 | reg).to_le_bytes()
}

fn read32(bus: &mut PciBus, slot: u32, reg: u32) -> u32 {
    bus.write(0, &addr(slot, reg));
    let mut b = [0u8; 4];
    bus.read(4, &mut b);
    u32::from_le_bytes(b)
}

#[test]
fn linux_finds_the_host_bridge() {
    let mut bus = PciBus::new();
    // pci_check_type1: a byte to 0xCFB, then CONFIG_ADDRESS echoes.
    bus.write(3, &[1]);
    bus.write(0, &0x8000_0000u32.to_le_bytes());
    let mut b = [0u8; 4];
    bus.read(0, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0x8000_0000);
    // pci_sanity_check: class (word at 0x0a) and vendor (word at 0).
    bus.write(0, &addr(0, 0x08));
    let mut w = [0u8; 2];
    bus.read(4 + 2, &mut w);
    assert_eq!(u16::from_le_bytes(w), 0x0600);
    assert_eq!(read32(&mut bus, 0, 0), 0x1237_8086);
    assert_eq!(read32(&mut bus, 0, 0x08), 0x0600_0002);
    // Nothing else on the bus; the enable bit matters.
    assert_eq!(read32(&mut bus, 1, 0), u32::MAX);
    assert_eq!(read32(&mut bus, 31, 0), u32::MAX);
    bus.write(0, &0u32.to_le_bytes());
    bus.read(4, &mut b);
    assert_eq!(b, [0xff; 4]);
    // Another bus, another function: absent.
    bus.write(0, &(ENABLE | 1 << 16).to_le_bytes());
    bus.read(4, &mut b);
    assert_eq!(b, [0xff; 4]);
    bus.write(0, &(ENABLE | 1 << 8).to_le_bytes());
    bus.read(4, &mut b);
    assert_eq!(b, [0xff; 4]);
    assert_eq!(bus.bad_accesses(), 0);
}

#[test]
fn only_writable_bits_change() {
    let mut bus = PciBus::new();
    // Vendor and device IDs are read-only; the command register is not.
    bus.write(0, &addr(0, 0));
    bus.write(4, &[0, 0, 0, 0]);
    bus.write(0, &addr(0, 0x04));
    bus.write(4, &[0xff, 0xff]);
    assert_eq!(read32(&mut bus, 0, 0), 0x1237_8086);
    assert_eq!(read32(&mut bus, 0, 0x04) & 0xffff, 0x0547);
    // A byte write in the middle of the dword.
    bus.write(0, &addr(0, 0x0c));
    bus.write(4 + 1, &[0x40]);
    assert_eq!(read32(&mut bus, 0, 0x0c), 0x0000_4000);
}

#[test]
fn senseless_accesses_are_counted_and_answered_with_ones() {
    let mut bus = PciBus::new();
    bus.write(0, &addr(0, 0));
    let mut b3 = [0u8; 3];
    bus.read(4, &mut b3);
    assert_eq!(b3, [0xff; 3]);
    let mut b2 = [0u8; 2];
    bus.read(4 + 3, &mut b2);
    assert_eq!(b2, [0xff; 2]);
    bus.write(4 + 2, &[0, 0, 0, 0]);
    bus.write(4, &[]);
    assert_eq!(bus.bad_accesses(), 4);
    assert_eq!(read32(&mut bus, 0, 0), 0x1237_8086);
    // Reserved address bits read back as zero.
    bus.write(0, &0xffff_ffffu32.to_le_bytes());
    let mut b = [0u8; 4];
    bus.read(0, &mut b);
    assert_eq!(u32::from_le_bytes(b), ADDRESS_BITS);
    // Every access of every size at every port offset: no panic.
    for offset in 0..8 {
        for len in 0..9 {
            let mut d = vec![0u8; len];
            bus.read(offset, &mut d);
            bus.write(offset, &d);
        }
    }
}

#[test]
fn state_restores_the_writable_bits_only() {
    let mut bus = PciBus::new();
    bus.write(0, &addr(0, 0x04));
    bus.write(4, &[0x06]);
    bus.write(0, &addr(0, 0x0c));
    let mut s = bus.state();
    assert_eq!(s.address, u32::from_le_bytes(addr(0, 0x0c)));
    // A forged file claims another device ID: the bridge stays an i440FX.
    s.functions[0].config[2] = 0x34;
    let mut fresh = PciBus::new();
    fresh.restore(&s).unwrap();
    assert_eq!(read32(&mut fresh, 0, 0), 0x1237_8086);
    assert_eq!(read32(&mut fresh, 0, 0x04) & 0xffff, 0x0006);

    let mut short = s.clone();
    short.functions[0].config.pop();
    assert_eq!(
        fresh.check_state(&short),
        Err(PciStateError::ConfigSize { slot: 0, len: 255 })
    );
    let mut other = s.clone();
    other.functions[0].slot = 3;
    let e = fresh.restore(&other).unwrap_err();
    assert!(e.to_string().contains("[(3, 0)]"), "{e}");
    let none = PciState {
        address: 0,
        functions: vec![],
        pm1_enable: 0,
    };
    assert!(fresh.restore(&none).is_err());
}

#[test]
fn other_functions_of_a_slot_are_reached_by_address() {
    let mut bus = PciBus::new();
    let f = Arc::new(Mutex::new(HostBridge(ConfigSpace::new(
        0x8086,
        0x7113,
        3,
        [6, 0x80, 0],
    ))));
    let (slot, function) = PM_FUNCTION;
    bus.add_function(slot, function, f).unwrap();
    // 00:01.3 through CONFIG_ADDRESS; 00:01.0 is absent.
    let at = |reg: u32| (ENABLE | 1 << 11 | 3 << 8 | reg).to_le_bytes();
    bus.write(0, &at(0));
    let mut b = [0u8; 4];
    bus.read(4, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0x7113_8086);
    assert_eq!(read32(&mut bus, 1, 0), 0xffff_ffff);
    // A slot with any function in it is not free.
    assert_eq!(bus.free_slot(), Some(2));
    assert!(bus
        .add_function(1, 8, Arc::new(Mutex::new(HostBridge(host_bridge()))))
        .is_err());
    // Its state names the function, and a state without it (a bus from
    // before the PM function) still fits.
    let s = bus.state();
    assert_eq!(
        s.functions
            .iter()
            .map(|f| (f.slot, f.function))
            .collect::<Vec<_>>(),
        vec![(0, 0), PM_FUNCTION]
    );
    let mut old = s.clone();
    old.functions.pop();
    bus.restore(&old).unwrap();
    let mut wrong = s.clone();
    wrong.functions[1].function = 2;
    assert!(bus.restore(&wrong).is_err());
}

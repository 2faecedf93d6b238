use super::*;

fn select(f: &mut FwCfg, item: u16) {
    f.write(0, &item.to_le_bytes());
}

fn read(f: &mut FwCfg, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    f.read(1, &mut b);
    b
}

fn two_ranges() -> FwCfg {
    FwCfg::new(&[(0, 3 << 30), (4 << 30, 1 << 30)], 2)
}

#[test]
fn signature_id_ram_and_cpus() {
    let mut f = two_ranges();
    // Selected at reset: the signature.
    assert_eq!(read(&mut f, 4), b"QEMU");
    select(&mut f, ID);
    assert_eq!(read(&mut f, 4), [1, 0, 0, 0]);
    select(&mut f, RAM_SIZE);
    assert_eq!(read(&mut f, 8), (4u64 << 30).to_le_bytes());
    select(&mut f, NB_CPUS);
    assert_eq!(read(&mut f, 2), [2, 0]);
    // Byte by byte, as Linux's probe reads, then past the end: zeros.
    select(&mut f, SIGNATURE);
    let bytes: Vec<u8> = (0..6).map(|_| read(&mut f, 1)[0]).collect();
    assert_eq!(bytes, b"QEMU\0\0");
    // An item that does not exist reads zeros.
    select(&mut f, 0x1234);
    assert_eq!(read(&mut f, 3), [0, 0, 0]);
    assert_eq!(f.bad_accesses(), 0);
}

#[test]
fn the_directory_names_the_files_and_e820_is_the_ram() {
    let mut f = two_ranges();
    select(&mut f, FILE_DIR);
    let count = u32::from_be_bytes(read(&mut f, 4).try_into().unwrap());
    assert_eq!(count, 2);
    let mut files = Vec::new();
    for _ in 0..count {
        let e = read(&mut f, 64);
        let size = u32::from_be_bytes(e[0..4].try_into().unwrap());
        let sel = u16::from_be_bytes(e[4..6].try_into().unwrap());
        let name: Vec<u8> = e[8..].iter().copied().take_while(|&b| b != 0).collect();
        files.push((String::from_utf8(name).unwrap(), size, sel));
    }
    assert_eq!(
        files,
        [
            ("bootorder".to_string(), 0, FILE_FIRST),
            ("etc/e820".to_string(), 40, FILE_FIRST + 1)
        ]
    );
    select(&mut f, FILE_FIRST + 1);
    let e820 = read(&mut f, 40);
    let entry = |i: usize| {
        let e = &e820[i * 20..i * 20 + 20];
        (
            u64::from_le_bytes(e[0..8].try_into().unwrap()),
            u64::from_le_bytes(e[8..16].try_into().unwrap()),
            u32::from_le_bytes(e[16..20].try_into().unwrap()),
        )
    };
    assert_eq!(entry(0), (0, 3 << 30, E820_RAM));
    assert_eq!(entry(1), (4 << 30, 1 << 30, E820_RAM));
}

#[test]
fn senseless_accesses_are_counted() {
    let mut f = two_ranges();
    select(&mut f, ID);
    f.write(0, &[1]);
    f.write(0, &[1, 0, 0, 0]);
    f.write(1, &[9]);
    let mut b = [0u8; 2];
    f.read(0, &mut b);
    assert_eq!(b, [0xff, 0xff]);
    assert_eq!(f.bad_accesses(), 4);
    // The selection stood.
    assert_eq!(read(&mut f, 4), [1, 0, 0, 0]);
    f.read(1, &mut []);
    for len in 0..70 {
        let mut d = vec![0u8; len];
        f.read(1, &mut d);
    }
}

#[test]
fn a_restored_read_goes_on_where_it_was() {
    let mut f = two_ranges();
    select(&mut f, SIGNATURE);
    read(&mut f, 2);
    let s = f.state();
    let mut g = two_ranges();
    g.restore(&s);
    assert_eq!(read(&mut g, 2), b"MU");
    g.restore(&FwCfgState {
        selected: SIGNATURE,
        offset: u64::MAX,
    });
    assert_eq!(read(&mut g, 2), [0, 0]);
}

#[test]
fn a_kernel_for_the_firmware_is_offered_in_qemus_items() {
    let mut f = two_ranges();
    select(&mut f, KERNEL_SIZE);
    assert_eq!(read(&mut f, 4), [0; 4]);
    f.set_kernel(KernelBlobs {
        setup: vec![1; 1024],
        kernel: vec![2; 3000],
        initrd: vec![3; 5],
        cmdline: b"console=ttyS0".to_vec(),
    });
    for (size, data, len, first) in [
        (SETUP_SIZE, SETUP_DATA, 1024u32, 1u8),
        (KERNEL_SIZE, KERNEL_DATA, 3000, 2),
        (INITRD_SIZE, INITRD_DATA, 5, 3),
    ] {
        select(&mut f, size);
        assert_eq!(read(&mut f, 4), len.to_le_bytes());
        select(&mut f, data);
        let d = read(&mut f, len as usize + 1);
        assert!(d[..len as usize].iter().all(|&b| b == first));
        assert_eq!(d[len as usize], 0);
    }
    select(&mut f, CMDLINE_SIZE);
    assert_eq!(read(&mut f, 4), 14u32.to_le_bytes());
    select(&mut f, CMDLINE_DATA);
    assert_eq!(read(&mut f, 14), b"console=ttyS0\0");
}

//! Unit tests of request parsing and execution over mock guest memory
//! and an in-memory disk: well-formed requests, errors, hostile chains.

use std::os::unix::fs::FileExt;

use virtio_queue::QueueT;

use super::*;
use crate::virtio::block::disk::tests::disk;
use crate::virtio::test_util::{Driver, DATA};

const HDR: u64 = DATA;
const BUF: u64 = DATA + 0x1000;
const STATUS: u64 = DATA + 0x100;
const ALL: u64 = features::DISCARD | features::WRITE_ZEROES;
const ID: &[u8; ID_BYTES] = b"tandem-test-disk-id!";

fn header(d: &Driver, at: u64, kind: u32, sector: u64) {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h[8..].copy_from_slice(&sector.to_le_bytes());
    d.write(at, &h);
}

fn parse(d: &Driver) -> Result<Request, Rejected> {
    let mut q = d.queue();
    let chain = q.pop_descriptor_chain(&d.mem).expect("a chain");
    Request::parse(chain, &d.mem)
}

/// Parses and executes the first chain; the status byte is preset to
/// 0xff so that an unwritten status shows.
fn exec(d: &Driver, disk: &dyn DiskBackend, acked: u64) -> Completion {
    d.write(STATUS, &[0xff]);
    let req = parse(d).expect("well-formed");
    let c = execute(&req, &d.mem, disk, acked, ID);
    assert_eq!(d.read(STATUS, 1)[0], c.status, "status byte written");
    c
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn read_returns_the_disk_bytes() {
    let (dk, raw) = disk(64 << 10, 0, false);
    raw.write_all_at(&pattern(4096, 9), 8 * 512).unwrap();
    let mut d = Driver::new(16);
    header(&d, HDR, kind::IN, 8);
    d.add_chain(&[(HDR, 16, false), (BUF, 4096, true), (STATUS, 1, true)]);
    let c = exec(&d, &dk, 0);
    assert_eq!(c.outcome, Outcome::Read(4096));
    assert_eq!((c.status, c.used_len), (status::OK, 4097));
    assert_eq!(d.read(BUF, 4096), pattern(4096, 9));
}

#[test]
fn write_reaches_the_file() {
    let (dk, raw) = disk(64 << 10, 0, false);
    let mut d = Driver::new(16);
    header(&d, HDR, kind::OUT, 2);
    d.write(BUF, &pattern(1024, 3));
    d.add_chain(&[(HDR, 16, false), (BUF, 1024, false), (STATUS, 1, true)]);
    let c = exec(&d, &dk, 0);
    assert_eq!(c.outcome, Outcome::Written(1024));
    assert_eq!((c.status, c.used_len), (status::OK, 1));
    let mut b = vec![0u8; 2048];
    raw.read_exact_at(&mut b, 512).unwrap();
    assert_eq!(&b[..512], &[0u8; 512][..]);
    assert_eq!(&b[512..1536], &pattern(1024, 3)[..]);
    assert_eq!(&b[1536..], &[0u8; 512][..]);
}

#[test]
fn framing_is_free() {
    // Header split in two; write data split; data and status of a
    // read in one descriptor.
    let (dk, raw) = disk(64 << 10, 0, false);
    let mut d = Driver::new(16);
    header(&d, HDR, kind::OUT, 1);
    d.write(HDR + 0x40, &d.read(HDR + 8, 8));
    d.write(BUF, &pattern(1024, 5));
    d.add_chain(&[
        (HDR, 8, false),
        (HDR + 0x40, 8, false),
        (BUF, 100, false),
        (BUF + 100, 924, false),
        (STATUS, 1, true),
    ]);
    assert_eq!(exec(&d, &dk, 0).outcome, Outcome::Written(1024));
    let mut b = vec![0u8; 1024];
    raw.read_exact_at(&mut b, 512).unwrap();
    assert_eq!(b, pattern(1024, 5));

    let mut d = Driver::new(16);
    header(&d, HDR, kind::IN, 1);
    d.add_chain(&[(HDR, 16, false), (BUF, 513, true)]);
    let req = parse(&d).unwrap();
    let c = execute(&req, &d.mem, &dk, 0, ID);
    assert_eq!((c.outcome, c.used_len), (Outcome::Read(512), 513));
    assert_eq!(d.read(BUF, 512), pattern(1024, 5)[..512].to_vec());
    assert_eq!(d.read(BUF + 512, 1), vec![status::OK]);
}

#[test]
fn flush_and_get_id() {
    let (dk, _raw) = disk(4096, 0, false);
    let mut d = Driver::new(16);
    header(&d, HDR, kind::FLUSH, 0);
    d.add_chain(&[(HDR, 16, false), (STATUS, 1, true)]);
    let c = exec(&d, &dk, 0);
    assert_eq!((c.outcome, c.status, c.used_len), (Outcome::Flushed, 0, 1));

    let mut d = Driver::new(16);
    header(&d, HDR, kind::GET_ID, 0);
    d.add_chain(&[(HDR, 16, false), (BUF, 20, true), (STATUS, 1, true)]);
    let c = exec(&d, &dk, 0);
    assert_eq!((c.outcome, c.used_len), (Outcome::Id, 21));
    assert_eq!(d.read(BUF, 20), ID.to_vec());
}

#[test]
fn out_of_range_and_bad_lengths_are_io_errors() {
    let (dk, raw) = disk(8 * 512, 0x11, false);
    let cases: [(u32, u64, u32); 6] = [
        (kind::IN, 8, 512),         // just past the end
        (kind::IN, 7, 1024),        // straddles the end
        (kind::OUT, 7, 1024),       // straddles the end
        (kind::OUT, u64::MAX, 512), // sector * 512 overflows
        (kind::IN, 1 << 55, 512),   // offset + len overflows
        (kind::IN, 0, 100),         // not whole sectors
    ];
    for (k, sector, len) in cases {
        let mut d = Driver::new(16);
        header(&d, HDR, k, sector);
        d.write(BUF, &[0xee; 1024]);
        let dir = k == kind::IN;
        d.add_chain(&[(HDR, 16, false), (BUF, len, dir), (STATUS, 1, true)]);
        let c = exec(&d, &dk, 0);
        assert_eq!(
            (c.outcome, c.status),
            (Outcome::IoError, status::IOERR),
            "{k} {sector} {len}"
        );
    }
    let mut b = vec![0u8; 8 * 512];
    raw.read_exact_at(&mut b, 0).unwrap();
    assert!(b.iter().all(|&x| x == 0x11), "disk unchanged");
}

#[test]
fn a_file_shrunk_under_the_device_gives_io_errors() {
    let (dk, raw) = disk(8 * 512, 0x11, false);
    raw.set_len(2 * 512).unwrap();
    let mut d = Driver::new(16);
    header(&d, HDR, kind::IN, 4);
    d.add_chain(&[(HDR, 16, false), (BUF, 512, true), (STATUS, 1, true)]);
    assert_eq!(exec(&d, &dk, 0).outcome, Outcome::IoError);
}

#[test]
fn unknown_types_are_unsupported() {
    let (dk, _raw) = disk(4096, 0, false);
    for k in [2, 10, 14, 99, u32::MAX, kind::DISCARD, kind::WRITE_ZEROES] {
        let mut d = Driver::new(16);
        header(&d, HDR, k, 0);
        d.write(BUF, &[0; 16]);
        d.add_chain(&[(HDR, 16, false), (BUF, 16, false), (STATUS, 1, true)]);
        // Discard and write-zeroes too, when not negotiated.
        let c = exec(&d, &dk, 0);
        assert_eq!(
            (c.outcome, c.status),
            (Outcome::Unsupported, status::UNSUPP)
        );
    }
}

#[test]
fn readonly_disks_refuse_writes() {
    let (dk, raw) = disk(8 * 512, 0x22, true);
    for k in [kind::OUT, kind::DISCARD, kind::WRITE_ZEROES] {
        let mut d = Driver::new(16);
        header(&d, HDR, k, 0);
        let mut seg = [0u8; 16];
        seg[8..12].copy_from_slice(&1u32.to_le_bytes());
        d.write(BUF, &seg);
        d.add_chain(&[(HDR, 16, false), (BUF, 512, false), (STATUS, 1, true)]);
        let c = exec(&d, &dk, ALL);
        assert_eq!(
            (c.outcome, c.status),
            (Outcome::IoError, status::IOERR),
            "{k}"
        );
    }
    let mut b = vec![0u8; 8 * 512];
    raw.read_exact_at(&mut b, 0).unwrap();
    assert!(b.iter().all(|&x| x == 0x22), "disk unchanged");
    // Reads and flushes still work.
    let mut d = Driver::new(16);
    header(&d, HDR, kind::IN, 0);
    d.add_chain(&[(HDR, 16, false), (BUF, 512, true), (STATUS, 1, true)]);
    assert_eq!(exec(&d, &dk, 0).outcome, Outcome::Read(512));
}

fn segments(d: &Driver, segs: &[(u64, u32, u32)]) -> u32 {
    for (i, &(sector, count, flags)) in segs.iter().enumerate() {
        let mut s = [0u8; 16];
        s[..8].copy_from_slice(&sector.to_le_bytes());
        s[8..12].copy_from_slice(&count.to_le_bytes());
        s[12..].copy_from_slice(&flags.to_le_bytes());
        d.write(BUF + 16 * i as u64, &s);
    }
    16 * segs.len() as u32
}

fn ranges_case(k: u32, segs: &[(u64, u32, u32)]) -> (Outcome, Vec<u8>) {
    let (dk, raw) = disk(64 << 10, 0x33, false);
    let mut d = Driver::new(16);
    header(&d, HDR, k, 0);
    let len = segments(&d, segs);
    d.add_chain(&[(HDR, 16, false), (BUF, len, false), (STATUS, 1, true)]);
    let c = exec(&d, &dk, ALL);
    let mut b = vec![0u8; 64 << 10];
    raw.read_exact_at(&mut b, 0).unwrap();
    (c.outcome, b)
}

#[test]
fn discard_and_write_zeroes() {
    let (o, b) = ranges_case(kind::DISCARD, &[(8, 8, 0), (32, 8, 0)]);
    assert_eq!(o, Outcome::Discarded);
    assert!(b[4096..8192].iter().all(|&x| x == 0));
    assert!(b[16384..20480].iter().all(|&x| x == 0));
    assert!(b[8192..16384].iter().all(|&x| x == 0x33));

    let (o, b) = ranges_case(kind::WRITE_ZEROES, &[(1, 3, 0), (64, 8, FLAG_UNMAP)]);
    assert_eq!(o, Outcome::Zeroed);
    assert!(b[512..2048].iter().all(|&x| x == 0));
    assert!(b[32768..36864].iter().all(|&x| x == 0));
    assert!(b[..512].iter().all(|&x| x == 0x33));

    // Unmap on a discard, unknown flags: unsupported, nothing done.
    for (k, flags) in [(kind::DISCARD, FLAG_UNMAP), (kind::WRITE_ZEROES, 4)] {
        let (o, b) = ranges_case(k, &[(0, 8, 0), (8, 8, flags)]);
        assert_eq!(o, Outcome::Unsupported);
        assert!(b.iter().all(|&x| x == 0x33));
    }
    // A range past the end, too many sectors or segments: errors, and
    // the valid segment before it is not executed either.
    let too_many: Vec<_> = (0..=MAX_SEGMENTS).map(|i| (u64::from(i), 1, 0)).collect();
    for segs in [
        vec![(0, 8, 0), (127, 2, 0)],
        vec![(0, 8, 0), (u64::MAX, 1, 0)],
        vec![(0, MAX_RANGE_SECTORS + 1, 0)],
        too_many,
    ] {
        let (o, b) = ranges_case(kind::WRITE_ZEROES, &segs);
        assert_eq!(o, Outcome::IoError, "{segs:?}");
        assert!(b.iter().all(|&x| x == 0x33));
    }
    // A segment that is not 16 bytes.
    let (dk, _raw) = disk(4096, 0, false);
    let mut d = Driver::new(16);
    header(&d, HDR, kind::DISCARD, 0);
    d.add_chain(&[(HDR, 16, false), (BUF, 10, false), (STATUS, 1, true)]);
    assert_eq!(exec(&d, &dk, ALL).outcome, Outcome::IoError);
}

fn rejected(d: &Driver) -> Rejected {
    parse(d).expect_err("malformed")
}

#[test]
fn malformed_chains_are_rejected() {
    let st = Some(GuestAddress(STATUS));
    // Header only: no status byte.
    let mut d = Driver::new(16);
    header(&d, HDR, kind::IN, 0);
    d.add_chain(&[(HDR, 16, false)]);
    assert_eq!(
        rejected(&d),
        Rejected {
            error: ChainError::NoStatus,
            status: None
        }
    );
    // A zero-length or readable "status".
    let mut d = Driver::new(16);
    d.add_chain(&[(HDR, 16, false), (STATUS, 0, true)]);
    assert_eq!(rejected(&d).error, ChainError::NoStatus);
    let mut d = Driver::new(16);
    d.add_chain(&[(HDR, 16, false), (STATUS, 1, false)]);
    assert_eq!(rejected(&d).error, ChainError::NoStatus);
    // A short header.
    let mut d = Driver::new(16);
    d.add_chain(&[(HDR, 15, false), (STATUS, 1, true)]);
    assert_eq!(
        rejected(&d),
        Rejected {
            error: ChainError::ShortHeader,
            status: st
        }
    );
    // A device-writable header.
    let mut d = Driver::new(16);
    d.add_chain(&[(HDR, 16, true), (STATUS, 1, true)]);
    assert_eq!(rejected(&d).error, ChainError::ShortHeader);
    // Readable after writable.
    let mut d = Driver::new(16);
    d.add_chain(&[
        (HDR, 16, false),
        (BUF, 512, true),
        (BUF, 512, false),
        (STATUS, 1, true),
    ]);
    assert_eq!(
        rejected(&d),
        Rejected {
            error: ChainError::WrongDirection,
            status: st
        }
    );
    // Read data the device could not write, write data it could.
    let mut d = Driver::new(16);
    header(&d, HDR, kind::IN, 0);
    d.add_chain(&[(HDR, 16, false), (BUF, 512, false), (STATUS, 1, true)]);
    assert_eq!(rejected(&d).error, ChainError::WrongDirection);
    let mut d = Driver::new(16);
    header(&d, HDR, kind::OUT, 0);
    d.add_chain(&[(HDR, 16, false), (BUF, 512, true), (STATUS, 1, true)]);
    assert_eq!(rejected(&d).error, ChainError::WrongDirection);
    let mut d = Driver::new(16);
    header(&d, HDR, kind::GET_ID, 0);
    d.add_chain(&[(HDR, 16, false), (BUF, 20, false), (STATUS, 1, true)]);
    assert_eq!(rejected(&d).error, ChainError::WrongDirection);
    // Buffers outside guest memory (4 MiB), or straddling its end.
    for (addr, len) in [(0xffff_ffff_0000, 512), ((4 << 20) - 256, 512)] {
        let mut d = Driver::new(16);
        header(&d, HDR, kind::IN, 0);
        d.add_chain(&[(HDR, 16, false), (addr, len, true), (STATUS, 1, true)]);
        assert_eq!(
            rejected(&d),
            Rejected {
                error: ChainError::Memory,
                status: st
            }
        );
    }
    // A status byte outside guest memory.
    let mut d = Driver::new(16);
    header(&d, HDR, kind::FLUSH, 0);
    d.add_chain(&[(HDR, 16, false), (0xffff_ffff_0000, 1, true)]);
    assert_eq!(
        rejected(&d),
        Rejected {
            error: ChainError::Memory,
            status: None
        }
    );
    // A loop: 0 -> 1 -> 0 -> ...
    let mut d = Driver::new(16);
    header(&d, HDR, kind::IN, 0);
    d.write_desc(0, HDR, 16, 1, 1);
    d.write_desc(1, BUF, 512, 1 | 2, 0);
    d.publish(0);
    assert_eq!(
        rejected(&d),
        Rejected {
            error: ChainError::Unterminated,
            status: None
        }
    );
    // A next index past the table.
    let mut d = Driver::new(16);
    d.write_desc(0, HDR, 16, 1, 200);
    d.publish(0);
    assert_eq!(rejected(&d).error, ChainError::Unterminated);
    // An empty chain (head past the table).
    let mut d = Driver::new(16);
    d.publish(300);
    let mut q = d.queue();
    if let Some(chain) = q.pop_descriptor_chain(&d.mem) {
        assert!(Request::parse(chain, &d.mem).is_err());
    }
}

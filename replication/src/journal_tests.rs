use proptest::prelude::*;

use super::*;

/// An image that fails its writes or flushes on demand.
#[derive(Debug)]
struct Flaky {
    data: Vec<u8>,
    fail_write: bool,
    flushes: u32,
}

impl BlockImage for Flaky {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.data.read_at(buf, offset)
    }
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        if self.fail_write {
            return Err(io::Error::other("injected"));
        }
        self.data.write_at(buf, offset)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.flushes += 1;
        Ok(())
    }
    fn len(&self) -> u64 {
        self.data.len() as u64
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect()
}

fn read(d: &mut SecondaryDisk<Vec<u8>>, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    d.guest_read(offset, &mut buf).unwrap();
    buf
}

#[test]
fn guest_sees_its_overlay_not_the_journal() {
    let base = pattern(3 * BLOCK_SIZE, 1);
    let mut d = SecondaryDisk::new(base.clone(), DEFAULT_JOURNAL_CAP);
    d.journal_primary_write(100, &[0xAA; 50]).unwrap();
    assert_eq!(read(&mut d, 0, base.len()), base, "journal invisible");
    d.guest_write(4090, &[0xBB; 12]).unwrap(); // crosses a block boundary
    let mut want = base.clone();
    want[4090..4102].fill(0xBB);
    assert_eq!(read(&mut d, 0, base.len()), want);
    assert_eq!(read(&mut d, 4095, 2), vec![0xBB, 0xBB]);
    let st = d.stats();
    assert_eq!(
        (st.journal_entries, st.journal_bytes, st.overlay_blocks),
        (1, 50, 2)
    );
    assert_eq!(d.image(), &base, "nothing written to the image yet");
}

#[test]
fn commit_applies_the_journal_in_order_and_drops_the_overlay() {
    let base = vec![0u8; 2 * BLOCK_SIZE];
    let mut d = SecondaryDisk::new(base, DEFAULT_JOURNAL_CAP);
    d.journal_primary_write(0, &[1; 10]).unwrap();
    d.journal_primary_write(5, &[2; 10]).unwrap();
    d.guest_write(0, &[9; 100]).unwrap();
    d.commit_checkpoint().unwrap();
    let mut want = vec![0u8; 2 * BLOCK_SIZE];
    want[..5].fill(1);
    want[5..15].fill(2);
    assert_eq!(d.image(), &want);
    assert_eq!(read(&mut d, 0, want.len()), want, "overlay dropped");
    let st = d.stats();
    assert_eq!(
        (
            st.journal_entries,
            st.journal_bytes,
            st.overlay_blocks,
            st.commits
        ),
        (0, 0, 0, 1)
    );
}

#[test]
fn failover_merges_the_overlay_and_drops_the_journal() {
    let base = pattern(BLOCK_SIZE * 2 + 100, 3);
    let mut d = SecondaryDisk::new(base.clone(), DEFAULT_JOURNAL_CAP);
    d.journal_primary_write(0, &[1; 10]).unwrap();
    d.guest_write(BLOCK_SIZE as u64 * 2 + 90, &[7; 10]).unwrap(); // short last block
    d.failover().unwrap();
    let mut want = base.clone();
    want[BLOCK_SIZE * 2 + 90..].fill(7);
    assert_eq!(d.image(), &want);
    assert!(d.stats().failed_over);
    // Plain disk from now on.
    d.guest_write(0, &[5; 3]).unwrap();
    assert_eq!(&d.image()[..3], &[5, 5, 5]);
    assert!(matches!(
        d.journal_primary_write(0, &[1]),
        Err(JournalError::FailedOver)
    ));
    assert!(matches!(
        d.commit_checkpoint(),
        Err(JournalError::FailedOver)
    ));
    assert_eq!(d.into_image()[..3], [5, 5, 5]);
}

#[test]
fn journal_cap_is_enforced() {
    let mut d = SecondaryDisk::new(vec![0u8; BLOCK_SIZE], 100);
    d.journal_primary_write(0, &[1; 60]).unwrap();
    let err = d.journal_primary_write(0, &[1; 41]).unwrap_err();
    assert!(matches!(
        err,
        JournalError::JournalFull {
            used: 60,
            cap: 100,
            len: 41
        }
    ));
    d.journal_primary_write(0, &[1; 40]).unwrap();
    assert_eq!(d.stats().journal_full, 1);
    d.commit_checkpoint().unwrap();
    d.journal_primary_write(0, &[1; 100]).unwrap();
}

#[test]
fn out_of_range_requests_are_errors() {
    let mut d = SecondaryDisk::new(vec![0u8; 1000], DEFAULT_JOURNAL_CAP);
    let oor = |r: Result<(), JournalError>| matches!(r, Err(JournalError::OutOfRange { .. }));
    assert!(oor(d.journal_primary_write(999, &[0; 2])));
    assert!(oor(d.journal_primary_write(u64::MAX, &[0; 1])));
    assert!(oor(d.guest_write(1000, &[0; 1])));
    assert!(oor(d.guest_write(u64::MAX - 1, &[0; 4])));
    let mut buf = [0u8; 8];
    assert!(oor(d.guest_read(996, &mut buf)));
    assert!(oor(d.guest_read(u64::MAX, &mut buf)));
    // Empty requests at the end are fine.
    d.guest_write(1000, &[]).unwrap();
    d.guest_read(1000, &mut []).unwrap();
    d.journal_primary_write(1000, &[]).unwrap();
    assert_eq!(d.stats().journal_entries, 0);
    assert_eq!(d.len(), 1000);
    assert!(!d.is_empty());
}

#[test]
fn a_failed_commit_blocks_failover_until_retried() {
    let image = Flaky {
        data: vec![0u8; BLOCK_SIZE],
        fail_write: false,
        flushes: 0,
    };
    let mut d = SecondaryDisk::new(image, DEFAULT_JOURNAL_CAP);
    d.journal_primary_write(0, &[1; 4]).unwrap();
    d.journal_primary_write(2, &[2; 4]).unwrap();
    d.guest_write(100, &[3; 4]).unwrap();
    d.image.fail_write = true;
    assert!(matches!(
        d.commit_checkpoint(),
        Err(JournalError::Io { .. })
    ));
    assert!(matches!(d.failover(), Err(JournalError::CommitIncomplete)));
    assert_eq!(d.stats().journal_entries, 2, "journal kept for a retry");
    d.image.fail_write = false;
    d.commit_checkpoint().unwrap();
    assert_eq!(&d.image().data[..6], &[1, 1, 2, 2, 2, 2]);
    assert_eq!(d.image().flushes, 1);
    d.failover().unwrap();
    assert_eq!(d.image().flushes, 2);
}

#[test]
fn vec_image_checks_ranges() {
    let mut v = vec![0u8; 10];
    assert!(v.write_at(&[1; 4], 8).is_err());
    assert!(v.read_at(&mut [0; 1], u64::MAX).is_err());
    v.write_at(&[1; 2], 8).unwrap();
    assert_eq!(BlockImage::len(&v), 10);
}

/// The image size of the property test: three blocks and a short one.
const SIZE: usize = 3 * BLOCK_SIZE + 517;

#[derive(Debug, Clone)]
enum Op {
    Primary(u64, Vec<u8>),
    Guest(u64, Vec<u8>),
    Read(u64, usize),
    Commit,
}

fn write_op() -> impl Strategy<Value = (u64, Vec<u8>)> {
    (0..SIZE, 0..2 * BLOCK_SIZE + 10, any::<u8>()).prop_map(|(off, len, seed)| {
        let len = len.min(SIZE - off);
        (off as u64, pattern(len, seed))
    })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => write_op().prop_map(|(o, d)| Op::Primary(o, d)),
        3 => write_op().prop_map(|(o, d)| Op::Guest(o, d)),
        3 => (0..SIZE, 0..2 * BLOCK_SIZE + 10)
            .prop_map(|(o, l)| Op::Read(o as u64, l.min(SIZE - o))),
        1 => Just(Op::Commit),
    ]
}

fn apply(model: &mut [u8], offset: u64, data: &[u8]) {
    let o = offset as usize;
    model[o..o + data.len()].copy_from_slice(data);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// The secondary guest sees a plain disk reset to the checkpoint image
    /// at each commit; each commit leaves the image equal to the primary's
    /// disk; failover leaves it equal to the checkpoint + the secondary's
    /// own writes.
    #[test]
    fn behaves_like_the_model(
        seed in any::<u8>(),
        ops in proptest::collection::vec(op(), 0..40),
    ) {
        let base = pattern(SIZE, seed);
        let mut disk = SecondaryDisk::new(base.clone(), u64::MAX);
        let mut primary = base.clone();
        let mut seen = base;
        for op in ops {
            match op {
                Op::Primary(o, d) => {
                    disk.journal_primary_write(o, &d).unwrap();
                    apply(&mut primary, o, &d);
                }
                Op::Guest(o, d) => {
                    disk.guest_write(o, &d).unwrap();
                    apply(&mut seen, o, &d);
                }
                Op::Read(o, l) => {
                    let mut buf = vec![0u8; l];
                    disk.guest_read(o, &mut buf).unwrap();
                    let o = o as usize;
                    prop_assert_eq!(&buf[..], &seen[o..o + l]);
                }
                Op::Commit => {
                    disk.commit_checkpoint().unwrap();
                    prop_assert_eq!(disk.image(), &primary);
                    seen.clone_from(&primary);
                }
            }
            let blocks = disk.stats().overlay_blocks;
            prop_assert!(blocks <= SIZE.div_ceil(BLOCK_SIZE) as u64);
        }
        let mut all = vec![0u8; SIZE];
        disk.guest_read(0, &mut all).unwrap();
        prop_assert_eq!(&all, &seen);
        disk.failover().unwrap();
        prop_assert_eq!(disk.image(), &seen);
    }
}

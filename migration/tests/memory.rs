//! The memory image: sparse round trips, layout checks, forged run tables, and a property
//! test over random images.

mod common;

use common::{forge, open, Raw};
use migration::format::{SnapshotWriter, FORMAT_VERSION};
use migration::memory::{
    is_zero, plan_mapping, scan_runs, verify_pages, ImageStats, Run, PAGE_SIZE,
};
use migration::{read_memory, validate_memory, write_memory, MemoryError};
use proptest::prelude::*;

const PAGE: usize = PAGE_SIZE as usize;
const MIB: u64 = 1 << 20;

/// Saves `regions` as the memory section of a snapshot in memory.
fn save(regions: &[(u64, &[u8])]) -> (Vec<u8>, ImageStats) {
    let mut w = SnapshotWriter::new(Vec::new()).unwrap();
    w.write_state("manifest", &"m").unwrap();
    let stats = write_memory(&mut w, "memory", regions.iter().copied()).unwrap();
    (w.finish().unwrap(), stats)
}

/// Restores the memory section of `file` into fresh zeroed regions shaped like `layout`.
fn restore(file: &[u8], layout: &[(u64, u64)]) -> Result<Vec<Vec<u8>>, MemoryError> {
    let mut mem: Vec<Vec<u8>> = layout.iter().map(|&(_, l)| vec![0; l as usize]).collect();
    let mut r = open(file)?;
    read_memory(&mut r, "memory", layout, |gpa, bytes: &[u8]| {
        let i = layout
            .iter()
            .position(|&(g, l)| gpa >= g && gpa < g + l)
            .ok_or("chunk outside every region")?;
        let at = (gpa - layout[i].0) as usize;
        mem[i][at..at + bytes.len()].copy_from_slice(bytes);
        Ok::<(), &str>(())
    })?;
    Ok(mem)
}

/// A memory section body written by hand.
fn body(page_size: u32, runs: &[(u64, u32)], data_pages: usize) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&page_size.to_le_bytes());
    b.extend_from_slice(&(runs.len() as u32).to_le_bytes());
    for (gpa, pages) in runs {
        b.extend_from_slice(&gpa.to_le_bytes());
        b.extend_from_slice(&pages.to_le_bytes());
    }
    b.resize(b.len() + data_pages * PAGE, 0x11);
    b
}

fn forged(runs: &[(u64, u32)], data_pages: usize) -> Vec<u8> {
    forged_raw(&body(4096, runs, data_pages))
}

/// A version 2 file whose memory section holds `b` (table and pages in one body).
fn forged_raw(b: &[u8]) -> Vec<u8> {
    forge(
        2,
        &[Raw {
            kind: 2,
            name: "memory",
            len: b.len() as u64,
            body: b,
        }],
    )
}

#[test]
fn zero_detection_sees_every_byte() {
    let mut page = vec![0u8; PAGE];
    assert!(is_zero(&page));
    for at in [0, 7, 8, 63, 64, 2049, PAGE - 1] {
        page[at] = 1;
        assert!(!is_zero(&page), "byte {at}");
        page[at] = 0;
    }
    assert!(is_zero(&[0; 65]));
    assert!(!is_zero(&[
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1
    ]));
}

#[test]
fn a_run_across_copy_chunks_stays_one_run() {
    // The writer copies memory out 16 pages at a time: a run over the
    // boundary of two copies is one run, and its bytes come back whole.
    let mut mem = vec![0u8; 40 * PAGE];
    for p in 14..19 {
        mem[p * PAGE + 7] = p as u8;
    }
    mem[39 * PAGE] = 1;
    let runs = scan_runs(&[(0, &mem)]);
    assert_eq!(
        runs,
        [
            Run {
                gpa: 14 * PAGE as u64,
                pages: 5
            },
            Run {
                gpa: 39 * PAGE as u64,
                pages: 1
            }
        ]
    );
    let (file, stats) = save(&[(0, &mem)]);
    assert_eq!(stats.pages, 6);
    let back = restore(&file, &[(0, 40 * PAGE_SIZE)]).unwrap();
    assert!(back[0] == mem);
}

#[test]
fn runs_split_at_zero_pages() {
    let mut mem = vec![0u8; 8 * PAGE];
    for p in [1, 2, 3, 6] {
        mem[p * PAGE + 100] = 9;
    }
    let runs = scan_runs(&[(0x10_0000, &mem)]);
    assert_eq!(
        runs,
        [
            Run {
                gpa: 0x10_1000,
                pages: 3
            },
            Run {
                gpa: 0x10_6000,
                pages: 1
            }
        ]
    );
}

#[test]
fn sparse_memory_round_trips_into_a_small_file() {
    // A low region and one above 4 GiB, like an x86 guest with a PCI hole.
    let mut low = vec![0u8; (32 * MIB) as usize];
    let mut high = vec![0u8; (16 * MIB) as usize];
    low[0] = 1;
    low[PAGE * 100..PAGE * 103].fill(0xab);
    let last = low.len() - 1;
    low[last] = 0xff;
    high[PAGE * 7 + PAGE - 1] = 5;
    let (file, stats) = save(&[(1 << 32, &high), (0, &low)]);
    assert_eq!(stats.runs, 4);
    assert_eq!(stats.pages, 6);
    assert!(file.len() < 32 << 10, "{} bytes for 6 pages", file.len());
    let layout = [(0, 32 * MIB), (1 << 32, 16 * MIB)];
    let mem = restore(&file, &layout).unwrap();
    assert!(mem[0] == low && mem[1] == high);
    let mut r = open(&file).unwrap();
    let runs = validate_memory(&mut r, "memory", &layout).unwrap();
    assert_eq!(runs.first().map(|r| r.gpa), Some(0));
    assert_eq!(runs.last().map(|r| r.gpa), Some((1 << 32) + 7 * PAGE_SIZE));
}

#[test]
fn the_sink_gets_ascending_chunks_of_at_most_one_mib() {
    let mem = vec![0x42u8; 300 * PAGE];
    let (file, _) = save(&[(0, &mem)]);
    let mut r = open(&file).unwrap();
    let mut chunks = Vec::new();
    read_memory(
        &mut r,
        "memory",
        &[(0, mem.len() as u64)],
        |gpa, b: &[u8]| {
            assert!(b.iter().all(|&x| x == 0x42));
            chunks.push((gpa, b.len()));
            Ok::<(), std::io::Error>(())
        },
    )
    .unwrap();
    assert_eq!(chunks, [(0, MIB as usize), (MIB, 44 * PAGE)]);
}

#[test]
fn an_image_larger_than_the_vm_is_refused_before_the_sink_runs() {
    let mut mem = vec![0u8; (4 * MIB) as usize];
    mem[0] = 1;
    let end = mem.len() - 1;
    mem[end] = 1;
    let (file, _) = save(&[(0, &mem)]);
    let mut r = open(&file).unwrap();
    let mut calls = 0;
    let err = read_memory(&mut r, "memory", &[(0, 2 * MIB)], |_, _: &[u8]| {
        calls += 1;
        Ok::<(), std::io::Error>(())
    })
    .err()
    .unwrap();
    assert_eq!(calls, 0);
    assert!(matches!(
        err,
        MemoryError::OutsideLayout {
            gpa: 0x3f_f000,
            pages: 1,
            ..
        }
    ));
    assert_eq!(
        err.to_string(),
        "memory image has 1 page(s) at 0x3ff000, outside this VM's memory (0x0..0x200000)"
    );
}

#[test]
fn runs_in_holes_or_across_regions_are_refused() {
    let layout = [(0, 2 * MIB), (4 * MIB, 2 * MIB)];
    for run in [
        (3 * MIB, 1),
        (2 * MIB - PAGE_SIZE, 2),
        (6 * MIB, 1),
        (!0xfff, 1),
    ] {
        let err = restore(&forged(&[run], run.1 as usize), &layout)
            .err()
            .unwrap();
        assert!(
            matches!(err, MemoryError::OutsideLayout { .. }),
            "{run:?}: {err}"
        );
    }
}

#[test]
fn overlapping_or_unordered_runs_are_refused() {
    let layout = [(0, 2 * MIB)];
    for runs in [
        [(0, 2), (PAGE_SIZE, 1)],
        [(0x5000, 1), (0x1000, 1)],
        [(0x1000, 1), (0x1000, 1)],
    ] {
        let err = restore(&forged(&runs, 3), &layout).err().unwrap();
        assert!(
            matches!(err, MemoryError::Overlap { .. }),
            "{runs:?}: {err}"
        );
    }
}

#[test]
fn forged_run_tables_are_refused_without_allocating() {
    let layout = [(0, 2 * MIB)];
    // A run count far beyond the body.
    let mut b = body(4096, &[], 0);
    b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    let err = restore(&forged_raw(&b), &layout).err().unwrap();
    assert!(matches!(err, MemoryError::Malformed(_)), "{err}");
    // More runs than the VM has pages.
    let runs: Vec<(u64, u32)> = (0..513).map(|i| (i * PAGE_SIZE, 1)).collect();
    let err = restore(&forged(&runs, 513), &layout).err().unwrap();
    assert!(matches!(err, MemoryError::TooManyPages { .. }), "{err}");
    // A run of u32::MAX pages.
    let err = restore(&forged(&[(0, u32::MAX)], 1), &layout)
        .err()
        .unwrap();
    assert!(matches!(err, MemoryError::OutsideLayout { .. }), "{err}");
    // Page data missing, or extra, or a foreign page size, or empty or unaligned runs.
    for (runs, pages) in [
        ([(0, 2)], 1),
        ([(0, 1)], 2),
        ([(0, 0)], 0),
        ([(0x800, 1)], 1),
    ] {
        let err = restore(&forged(&runs, pages), &layout).err().unwrap();
        assert!(matches!(err, MemoryError::Malformed(_)), "{runs:?}: {err}");
    }
    let err = restore(&forged_raw(&body(65536, &[], 0)), &layout)
        .err()
        .unwrap();
    assert!(matches!(err, MemoryError::Malformed(_)), "{err}");
    let err = restore(&forged_raw(&[0; 7]), &layout).err().unwrap();
    assert!(matches!(err, MemoryError::Malformed(_)), "{err}");
}

#[test]
fn regions_must_be_aligned_and_disjoint() {
    let mem = vec![0u8; 2 * PAGE];
    let mut w = SnapshotWriter::new(Vec::new()).unwrap();
    let err = write_memory(&mut w, "memory", [(0x800, &mem[..])])
        .err()
        .unwrap();
    assert!(matches!(err, MemoryError::Unaligned { .. }));
    let err = write_memory(&mut w, "memory", [(0, &mem[..100])])
        .err()
        .unwrap();
    assert!(matches!(err, MemoryError::Unaligned { .. }));
    let err = write_memory(&mut w, "memory", [(0x1000, &mem[..]), (0, &mem[..])])
        .err()
        .unwrap();
    assert!(matches!(err, MemoryError::RegionsOverlap { .. }));
    // The same checks guard the restoring VM's layout.
    let (file, _) = save(&[(0, &mem)]);
    let err = restore(&file, &[(0, 2 * PAGE_SIZE), (PAGE_SIZE, PAGE_SIZE)])
        .err()
        .unwrap();
    assert!(matches!(err, MemoryError::RegionsOverlap { .. }));
}

#[test]
fn a_failing_sink_is_reported_with_its_address() {
    let mut mem = vec![0u8; 4 * PAGE];
    mem[2 * PAGE] = 1;
    let (file, _) = save(&[(0x10_0000, &mem)]);
    let mut r = open(&file).unwrap();
    let err = read_memory(
        &mut r,
        "memory",
        &[(0x10_0000, 4 * PAGE_SIZE)],
        |_, _: &[u8]| Err(std::io::Error::other("guest memory gone")),
    )
    .err()
    .unwrap();
    assert!(matches!(err, MemoryError::Sink { gpa: 0x10_2000, .. }));
    assert!(err.to_string().ends_with("guest memory gone"), "{err}");
}

#[test]
fn a_missing_memory_section_is_named() {
    let file = forge(FORMAT_VERSION, &[]);
    let err = restore(&file, &[(0, MIB)]).err().unwrap();
    assert_eq!(err.to_string(), "the snapshot has no section \"memory\"");
}

/// One page of a generated image: zero, one byte set, or filled.
fn page_strategy() -> impl Strategy<Value = (u8, u16, u8)> {
    (0u8..4, any::<u16>(), 1u8..=255)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_images_round_trip_exactly(
        regions in prop::collection::vec(prop::collection::vec(page_strategy(), 1..24), 1..4)
    ) {
        let mut images = Vec::new();
        for pages in &regions {
            let mut mem = vec![0u8; pages.len() * PAGE];
            for (i, &(kind, at, val)) in pages.iter().enumerate() {
                let page = &mut mem[i * PAGE..(i + 1) * PAGE];
                match kind {
                    0 | 1 => {}
                    2 => page[usize::from(at) % PAGE] = val,
                    _ => page.iter_mut().enumerate().for_each(|(j, b)| *b = (j as u8) ^ val),
                }
            }
            images.push(mem);
        }
        // Regions 1 GiB apart, given in reverse order.
        let with_gpa: Vec<(u64, &[u8])> = images
            .iter()
            .enumerate()
            .rev()
            .map(|(i, m)| ((i as u64) << 30, m.as_slice()))
            .collect();
        let (file, stats) = save(&with_gpa);
        let nonzero: usize = images.iter().map(|m| m.chunks(PAGE).filter(|p| !is_zero(p)).count()).sum();
        prop_assert_eq!(stats.pages, nonzero as u64);
        let layout: Vec<(u64, u64)> = images
            .iter()
            .enumerate()
            .map(|(i, m)| ((i as u64) << 30, m.len() as u64))
            .collect();
        let restored = restore(&file, &layout).unwrap();
        prop_assert_eq!(restored, images);
    }
}

/// A version 3 image: its pages lie page-aligned in the file, in run order, where
/// [`plan_mapping`] says; a damaged page passes the file's CRC but not the pages' own.
#[test]
fn version_3_pages_are_mappable_and_checked_by_their_own_crc() {
    let mut mem = vec![0u8; (4 * MIB) as usize];
    mem[PAGE..3 * PAGE].fill(7);
    mem[10 * PAGE] = 9;
    let (mut file, stats) = save(&[(0, &mem)]);
    assert_eq!((stats.runs, stats.pages), (2, 3));
    let layout = [(0, 4 * MIB)];
    let mut r = open(&file).unwrap();
    assert_eq!(r.version(), FORMAT_VERSION);
    let plan = plan_mapping(&mut r, "memory", &layout).unwrap().unwrap();
    assert_eq!(plan.offset % PAGE_SIZE, 0);
    let at = plan.offset as usize;
    assert_eq!(&file[at..at + 2 * PAGE], &mem[PAGE..3 * PAGE]);
    assert_eq!(
        &file[at + 2 * PAGE..at + 3 * PAGE],
        &mem[10 * PAGE..11 * PAGE]
    );
    verify_pages(&mut r, "memory", &layout).unwrap();
    assert!(restore(&file, &layout).unwrap()[0] == mem);
    file[at + 2 * PAGE + 1] ^= 0xff;
    let mut r = open(&file).unwrap();
    let err = verify_pages(&mut r, "memory", &layout).err().unwrap();
    assert!(matches!(err, MemoryError::PagesCrc { .. }), "{err}");
    assert!(err.to_string().contains("the file is damaged"), "{err}");
    let err = restore(&file, &layout).err().unwrap();
    assert!(matches!(err, MemoryError::PagesCrc { .. }), "{err}");
}

/// A version 2 image (as tandem wrote before version 3) still restores, and is not
/// mappable.
#[test]
fn version_2_images_still_restore_and_are_copied() {
    let mut mem = vec![0u8; (2 * MIB) as usize];
    mem[5 * PAGE..7 * PAGE].fill(3);
    let mut w = SnapshotWriter::with_version(Vec::new(), 2).unwrap();
    w.write_state("manifest", &"m").unwrap();
    write_memory(&mut w, "memory", [(0, &mem[..])]).unwrap();
    let file = w.finish().unwrap();
    let layout = [(0, 2 * MIB)];
    let mut r = open(&file).unwrap();
    assert_eq!(r.version(), 2);
    assert!(r.section("memory.pages").is_none());
    assert_eq!(plan_mapping(&mut r, "memory", &layout).unwrap(), None);
    verify_pages(&mut r, "memory", &layout).unwrap();
    assert!(restore(&file, &layout).unwrap()[0] == mem);
}

/// A version 3 table whose runs do not account for its pages section is refused.
#[test]
fn a_version_3_table_that_miscounts_its_pages_is_refused() {
    let mut w = SnapshotWriter::new(Vec::new()).unwrap();
    w.write_section(
        "memory.pages",
        migration::format::SectionKind::Pages,
        &[1; 2 * PAGE],
    )
    .unwrap();
    let mut table = Vec::new();
    table.extend_from_slice(&4096u32.to_le_bytes());
    table.extend_from_slice(&1u32.to_le_bytes());
    table.extend_from_slice(&0u32.to_le_bytes());
    table.extend_from_slice(&0u32.to_le_bytes());
    table.extend_from_slice(&0u64.to_le_bytes());
    table.extend_from_slice(&1u32.to_le_bytes());
    w.write_section("memory", migration::format::SectionKind::Memory, &table)
        .unwrap();
    let file = w.finish().unwrap();
    let err = restore(&file, &[(0, MIB)]).err().unwrap();
    assert!(matches!(err, MemoryError::Malformed(_)), "{err}");
    // And a missing pages section is named.
    let mut w = SnapshotWriter::new(Vec::new()).unwrap();
    w.write_section("memory", migration::format::SectionKind::Memory, &table)
        .unwrap();
    let err = restore(&w.finish().unwrap(), &[(0, MIB)]).err().unwrap();
    assert!(err.to_string().contains("memory.pages"), "{err}");
}
